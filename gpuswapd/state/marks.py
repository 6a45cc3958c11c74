"""What gpuswapd stopped, kept apart from the state document: one file per unit or timer.

    /run/gpuswapd/NAME.stopped/strata.service       written (and fsync'd) before the stop
    /run/gpuswapd/NAME.stopped/agent-sync.timer     removed once it runs again

Each file holds the ``CLOCK_MONOTONIC`` second it was written: a unit that became active after
it (systemd's ``ActiveEnterTimestampMonotonic``) ran again since, whoever started it, and its mark
is stale (one whose removal failed, gpuswapd killed before it could retry).

gpuswapd starts a unit or a timer only to undo its own stop. The state document says what a
window stopped; this second record says it too, so that what gpuswapd stopped is known even when
every copy of the document is torn or a window's record was lost: a baseline restore starts
exactly the names found here, and nothing else. It lives under /run, which a reboot clears, as
it should: after a reboot systemd starts what is enabled, and nothing is gpuswapd's to undo.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuswapd import clock
from gpuswapd.errors import StateError


def _plain(name: str) -> bool:
    """Tell whether ``name`` is a unit's name that can be a file's (no path, nothing hidden)."""
    return bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


class Marks:
    """The names gpuswapd stopped, one file each in a directory (None: kept in memory, for tests)."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.dir = Path(directory) if directory is not None else None
        self._memory: dict[str, float] = {}

    def add(self, names: list[str], stamp: float | None = None) -> None:
        """Record that gpuswapd is about to stop these units or timers (fsync'd before it returns).

        ``stamp``: the CLOCK_MONOTONIC second to record, if not now (a restore's first start).
        """
        names = [n for n in names if _plain(n)]
        if not names:
            return
        stamp = clock.kernel_monotonic() if stamp is None else stamp
        if self.dir is None:
            self._memory.update(dict.fromkeys(names, stamp))
            return
        try:
            self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            for name in names:
                fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, f"{stamp:.6f}\n".encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._fsync_dir()
        except OSError as err:
            raise StateError(f"cannot record what gpuswapd stops in {self.dir}: {err.strerror or err}; "
                             f"nothing was stopped (check {self.dir.parent})") from err

    def remove(self, names: list[str]) -> None:
        """Forget these names: they run again (or are their operator's now)."""
        if self.dir is None:
            for name in names:
                self._memory.pop(name, None)
            return
        try:
            for name in names:
                if _plain(name):
                    (self.dir / name).unlink(missing_ok=True)
            self._fsync_dir()
        except FileNotFoundError:
            return
        except OSError as err:
            raise StateError(f"cannot clear what gpuswapd stopped in {self.dir}: {err.strerror or err}") from err

    def read(self) -> list[str]:
        """List what gpuswapd stopped and has not started again (sorted)."""
        return sorted(self.read_times())

    def read_times(self) -> dict[str, float | None]:
        """Map each name gpuswapd stopped to the CLOCK_MONOTONIC second of its mark (None: not said)."""
        if self.dir is None:
            return dict(self._memory)
        try:
            return {p.name: _stamp(p) for p in self.dir.iterdir() if _plain(p.name)}
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise StateError(f"cannot read what gpuswapd stopped in {self.dir}: {err.strerror or err}") from err

    def _fsync_dir(self) -> None:
        assert self.dir is not None
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _stamp(path: Path) -> float | None:
    """Read a mark's second (an empty file, an older gpuswapd's, or anything else: None)."""
    try:
        text = path.read_text(errors="replace")[:64].strip()
    except FileNotFoundError:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


def marks_dir(runtime: str | os.PathLike[str], instance: str, kind: str = "stopped") -> Path:
    """Return where instance ``instance`` records what it stopped (``/run/gpuswapd/NAME.stopped``).

    ``kind`` "starting": where it records the starts of its restores under way, until each ends
    (``/run/gpuswapd/NAME.starting``, same layout): a unit found failed after one came up under
    gpuswapd's own start, not its operator's.
    """
    return Path(runtime) / f"{instance}.{kind}"


def memory_marks(store: Any, kind: str = "stopped") -> Marks:
    """Return the in-memory record kept with a state directory that is not on disk (a simulation's, a test's).

    It lives as long as that object, across restarts of the daemon over it, as /run outlives a process.
    """
    marks = getattr(store, f"{kind}_marks", None)
    if not isinstance(marks, Marks):
        marks = Marks(None)
        setattr(store, f"{kind}_marks", marks)
    return marks
