"""The state directory: one versioned state document with its last good copy, and the history.

    state.json       {"version": 2, "seq": N, "window": {...} | null, "parked": null, "queue": [],
                      "held_down": {"UNIT": since}, "resident": {"baseline": ..., ...}, "sha256": "..."}
    state.prev.json  the document as it was before the last write
    history.jsonl    finished windows, newest last

Each write goes to a temporary file of its own, is written whole and fsync'd, then the current
document is linked as the previous copy and the new one renamed over it: at every instant both
names hold a complete document. A document whose checksum does not match (a torn or corrupted
file), that another version wrote, or that cannot be read at all is skipped for the other copy;
the readable copy with the highest ``seq`` wins. A previous copy is never newer than what was
acted on, and every change is recorded before it is made, so an older record always says at
least as much as needs undoing. Nothing readable at all is ``Unreadable``: the daemon then
restores the baseline the configuration describes.

gpuswapd 0.1 kept the window alone in ``current.json``; it is migrated on first start.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from gpuswapd import clock
from gpuswapd.errors import ConfigError
from gpuswapd.protocol import JsonObject
from gpuswapd.record import WindowRecord

VERSION = 2
HISTORY_KEEP = 200
MAX_DOCUMENT = 4 * 1024 * 1024  # far above any real document; a bigger file is not ours
_counter = itertools.count()


@dataclass
class Document:
    """The state gpuswapd keeps across restarts."""

    seq: int = 0
    window: WindowRecord | None = None
    parked: JsonObject | None = None
    queue: list[JsonObject] = field(default_factory=list)
    # Resident units an operator stopped while no window was open: left down until started again.
    held_down: dict[str, float] = field(default_factory=dict)
    # What the resident is (gpuswapd.window.baseline.Known): its baseline, its footprint, a change left.
    resident: JsonObject | None = None
    # The daemon's time when it was written (clock.sample): the next start in this boot continues it.
    clock: JsonObject | None = None


@dataclass(frozen=True)
class Loaded:
    """What reading the state directory found."""

    document: Document | None  # None: nothing was ever written (a fresh install)
    problems: list[str]  # copies that could not be used, and why
    migrated: bool = False

    @property
    def unreadable(self) -> bool:
        """Tell whether state existed but no copy of it could be used."""
        return self.document is None and bool(self.problems)


def encode(document: Document) -> bytes:
    """Serialize a document with its checksum (one line of JSON)."""
    with clock.document_frame():  # the daemon's own time, continued by the next start in this boot
        window = document.window.to_dict() if document.window else None
    body: JsonObject = {"version": VERSION, "seq": document.seq, "window": window,
                        "parked": document.parked, "queue": document.queue, "clock": clock.sample()}
    if document.held_down:
        body["held_down"] = document.held_down
    if document.resident:
        body["resident"] = document.resident
    # The checksum covers the sorted body without it, and sits in its sorted place: each half is
    # serialized once (the state is written at every change of the window).
    before = json.dumps({k: v for k, v in body.items() if k < "sha256"}, sort_keys=True, separators=(",", ":"))
    after = json.dumps({k: v for k, v in body.items() if k > "sha256"}, sort_keys=True, separators=(",", ":"))
    canonical = f"{before[:-1]},{after[1:]}".encode()
    digest = hashlib.sha256(canonical).hexdigest()
    return f'{before[:-1]},"sha256":"{digest}",{after[1:]}\n'.encode()


def decode(data: bytes) -> Document:
    """Parse and check a document; ValueError says what is wrong with it."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to be a state document") from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg} at byte {err.pos}): torn or corrupted") from None
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    if body.get("version") != VERSION:
        raise ValueError(f"version {body.get('version')!r}, this gpuswapd reads version {VERSION}")
    claimed = body.pop("sha256", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if claimed != hashlib.sha256(canonical).hexdigest():
        raise ValueError("checksum mismatch: torn or corrupted")
    seq, parked, queue = body.get("seq"), body.get("parked"), body.get("queue")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError("seq: expected a counter")
    if parked is not None and not isinstance(parked, dict):
        raise ValueError("parked: expected an object or null")
    if not isinstance(queue, list):
        raise ValueError("queue: expected a list")
    held = body.get("held_down") or {}
    if not isinstance(held, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and
                                             not isinstance(v, bool) for k, v in held.items()):
        raise ValueError("held_down: expected an object of unit names and times")
    resident = body.get("resident")
    if resident is not None and not isinstance(resident, dict):
        raise ValueError("resident: expected an object or null")
    stamp = body.get("clock")
    if stamp is not None and not isinstance(stamp, dict):
        raise ValueError("clock: expected an object or null")
    window = body.get("window")
    with clock.document_frame():
        record = None if window is None else WindowRecord.from_dict(window)
    return Document(seq=seq, window=record, parked=parked, queue=queue,
                    held_down={k: float(v) for k, v in held.items()}, resident=resident, clock=stamp)


class StateStore:
    """Reads and writes the state document and the history in the state directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.current = self.dir / "state.json"
        self.previous = self.dir / "state.prev.json"
        self.legacy = self.dir / "current.json"
        self.history_file = self.dir / "history.jsonl"

    def prepare(self) -> None:
        """Create the directory (mode 0750) and check it is writable."""
        try:
            self.dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            probe = self.dir / f".write-test.{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"daemon.state_dir: cannot write {self.dir}: {err.strerror}") from err

    # -- the document ------------------------------------------------------------------------

    def load(self) -> Loaded:
        """Read the newest usable copy of the document (migrating gpuswapd 0.1's file)."""
        found: list[Document] = []
        problems: list[str] = []
        for path in (self.current, self.previous):
            try:
                found.append(decode(_read(path)))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as err:
                problems.append(f"{path.name}: {_why(err)}")
        if found:
            return Loaded(max(found, key=lambda d: d.seq), problems)
        return self._migrate(problems)

    def _migrate(self, problems: list[str]) -> Loaded:
        try:
            data = _read(self.legacy)
        except FileNotFoundError:
            return Loaded(None, problems)
        except OSError as err:
            return Loaded(None, [*problems, f"{self.legacy.name}: {_why(err)}"])
        try:
            try:
                raw = json.loads(data)
            except RecursionError:
                raise ValueError("nested too deeply") from None
            document = Document(seq=1, window=WindowRecord.from_dict(raw))
        except (ValueError, UnicodeDecodeError) as err:
            return Loaded(None, [*problems, f"{self.legacy.name}: {_why(err)}"])
        self.write(encode(document))
        self.legacy.replace(self.legacy.with_name("current.json.migrated"))
        self._fsync_dir()
        return Loaded(document, problems, migrated=True)

    def write(self, data: bytes) -> None:
        """Replace the document, keeping the one before as the previous copy."""
        tmp = self.dir / f".state.{os.getpid()}.{next(_counter)}.tmp"
        link = self.dir / f".prev.{os.getpid()}.{next(_counter)}.tmp"
        try:
            _write_new(tmp, data)
            with contextlib.suppress(FileNotFoundError):  # the first document has no previous one
                os.link(self.current, link)
                os.replace(link, self.previous)
            os.replace(tmp, self.current)
        finally:
            for leftover in (tmp, link):  # rename(2) of two links to one file leaves the source
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
        self._fsync_dir()

    def set_aside(self) -> list[str]:
        """Copy unreadable files for a person to look at; name the copies.

        The originals stay until a good document replaces them: should gpuswapd stop before,
        the next start finds them unreadable again and restores the baseline again.
        """
        kept = []
        for path in (self.current, self.previous, self.legacy):
            if path.exists():
                target = path.with_name(path.name + ".unreadable")
                with contextlib.suppress(OSError):
                    shutil.copyfile(path, target)
                    kept.append(target.name)
        return kept

    # -- history -----------------------------------------------------------------------------

    def append_history(self, records: list[JsonObject]) -> None:
        """Add finished windows to the history, keeping the last ``HISTORY_KEEP``."""
        lines = [*self._history_lines(), *(json.dumps(r, separators=(",", ":")) for r in records)]
        self._replace(self.history_file, ("\n".join(lines[-HISTORY_KEEP:]) + "\n").encode())

    def history(self, limit: int = 20) -> list[JsonObject]:
        """Return the last ``limit`` finished windows, newest last."""
        out = []
        for line in self._history_lines()[-limit:]:
            with contextlib.suppress(ValueError, RecursionError):
                out.append(json.loads(line))
        return out

    def _history_lines(self) -> list[str]:
        try:
            return [ln for ln in self.history_file.read_text(errors="replace").splitlines() if ln.strip()]
        except FileNotFoundError:
            return []

    def _replace(self, path: Path, data: bytes) -> None:
        tmp = self.dir / f".{path.name}.{os.getpid()}.{next(_counter)}.tmp"
        try:
            _write_new(tmp, data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        data = f.read(MAX_DOCUMENT + 1)
    if len(data) > MAX_DOCUMENT:
        raise ValueError(f"larger than {MAX_DOCUMENT} bytes: not a state document")
    return data


def _write_new(path: Path, data: bytes) -> None:
    """Write a new file (never one that exists) whole, and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte: os.write may write less than asked (a full disk, a signal)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(28, "No space left on device")  # ENOSPC: nothing more would fit
        view = view[written:]


def _why(err: BaseException) -> str:
    if isinstance(err, OSError):
        return err.strerror or str(err)
    return str(err)
