"""llama.cpp's slots: what each holds (``GET /slots``), and its KV cache saved to and restored from a file.

llama-server (its README's "GET /slots" and "POST /slots/{id_slot}?action=save|restore") lists::

    [{"id": 0, "n_ctx": 4096, "is_processing": false, "n_prompt_tokens": 1566, ...}, ...]

where ``n_prompt_tokens`` is what the slot's cache holds (absent for a slot that never served).
With ``--slot-save-path DIR`` it saves a slot to ``DIR/FILENAME`` and answers
``{"id_slot": 0, "filename": ..., "n_saved": 1566, "n_written": 12345678, "timings": {"save_ms": ...}}``,
and restores one with ``{"n_restored": ..., "n_read": ...}``. A slot busy with a request is saved
or restored once that request is done. The files live on the server's side: gpuswapd names them,
lists and removes them (``SlotDir``), and never reads them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Protocol

from gpuswapd.adapters.props import _object
from gpuswapd.adapters.streams import snip
from gpuswapd.errors import BadResponse, FilesError


@dataclass(frozen=True)
class Slot:
    """One slot: its id, its context, the tokens its cache holds, and whether it is busy."""

    id: int
    n_ctx: int
    tokens: int
    processing: bool


@dataclass(frozen=True)
class SlotFile:
    """What a save or a restore did: the slot, the file, its tokens and bytes, and the server's milliseconds."""

    slot: int
    filename: str
    tokens: int
    bytes: int
    ms: float


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parse_slots(raw: bytes, where: str) -> list[Slot]:
    """Read llama-server's ``/slots``: each slot's id, context, cached tokens and whether it works."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BadResponse(f"{where}: the answer is not JSON: {snip(raw)}") from err
    if not isinstance(body, list):
        raise BadResponse(f"{where}: not a list of slots: {snip(raw)}")
    out = []
    for item in body:
        ident = _int(item.get("id")) if isinstance(item, dict) else None
        if ident is None or not isinstance(item, dict):
            raise BadResponse(f"{where}: a slot without an id: {snip(raw)}")
        out.append(Slot(ident, _int(item.get("n_ctx")) or 0, _int(item.get("n_prompt_tokens")) or 0,
                        item.get("is_processing") is True))
    return out


def parse_slot_file(raw: bytes, where: str, save: bool) -> SlotFile:
    """Read the answer to a slot's save (``n_saved``, ``n_written``) or restore (``n_restored``, ``n_read``)."""
    body = _object(raw, where)
    tokens = _int(body.get("n_saved" if save else "n_restored"))
    nbytes = _int(body.get("n_written" if save else "n_read"))
    slot = _int(body.get("id_slot"))
    if tokens is None or nbytes is None or slot is None:
        raise BadResponse(f"{where}: no id_slot, {'n_saved and n_written' if save else 'n_restored and n_read'}: "
                          f"{snip(raw)}")
    timings = body.get("timings")
    ms = timings.get("save_ms" if save else "restore_ms") if isinstance(timings, dict) else None
    filename = body.get("filename")
    return SlotFile(slot, filename if isinstance(filename, str) else "", tokens, nbytes,
                    float(ms) if isinstance(ms, (int, float)) and not isinstance(ms, bool) else 0.0)


@dataclass(frozen=True)
class FileIdentity:
    """A model file as the file system has it: a restore into another file is refused."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    def key(self) -> str:
        """Return it as one line, for a fingerprint."""
        return f"{self.path}:{self.size}:{self.mtime_ns}:{self.inode}"


class SlotFiles(Protocol):
    """The slot save directory and the model file, as gpuswapd sees them (the fakes have their own)."""

    def identity(self, path: str) -> FileIdentity:
        """Stat the model file (links followed)."""

    def listing(self, directory: str, prefix: str) -> dict[str, int]:
        """List the files of ``directory`` whose names start with ``prefix``, with their sizes."""

    def free(self, directory: str) -> int:
        """Say how many bytes the directory's file system has free for an unprivileged writer."""

    def remove(self, directory: str, names: list[str]) -> list[str]:
        """Remove these files of ``directory`` (one missing already is fine); return those removed."""


class SlotDir:
    """The real file system."""

    def identity(self, path: str) -> FileIdentity:
        """Stat the model file (links followed)."""
        try:
            st = os.stat(path)
        except OSError as err:
            raise FilesError(f"{path}: {err.strerror or err}: the resident's model file cannot be looked at, so "
                             "its slots are not saved") from err
        if not stat.S_ISREG(st.st_mode):
            raise FilesError(f"{path}: not a file")
        return FileIdentity(path, st.st_size, st.st_mtime_ns, st.st_ino)

    def listing(self, directory: str, prefix: str) -> dict[str, int]:
        """List the files of ``directory`` whose names start with ``prefix``, with their sizes."""
        out: dict[str, int] = {}
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                        try:
                            out[entry.name] = entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            continue
        except OSError as err:
            raise FilesError(f"{directory}: {err.strerror or err}: the slot save directory cannot be listed "
                             "(gpuswapd needs ReadWritePaths= on it, and write access through its group)") from err
        return out

    def free(self, directory: str) -> int:
        """Say how many bytes the directory's file system has free for an unprivileged writer."""
        try:
            st = os.statvfs(directory)
        except OSError as err:
            raise FilesError(f"{directory}: {err.strerror or err}") from err
        return st.f_bavail * st.f_frsize

    def remove(self, directory: str, names: list[str]) -> list[str]:
        """Remove these files of ``directory`` (one missing already is fine); return those removed."""
        removed = []
        failed = []
        for name in names:
            if "/" in name or name in ("", ".", ".."):
                continue
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                continue
            except OSError as err:
                failed.append(f"{name} ({err.strerror or err})")
        if failed:
            raise FilesError(f"{directory}: could not remove {', '.join(failed)}: gpuswapd needs write access to "
                             "the directory (its group, with ReadWritePaths=)")
        return removed
