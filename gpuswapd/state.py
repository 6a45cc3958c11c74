"""The state directory: the current window, written atomically, and a history of windows."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from gpuswapd.errors import ConfigError
from gpuswapd.record import WindowRecord

HISTORY_KEEP = 200


class StateStore:
    """Reads and writes ``current.json`` and ``history.jsonl`` in the state directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.current = self.dir / "current.json"
        self.history_file = self.dir / "history.jsonl"

    def prepare(self) -> None:
        """Create the directory (mode 0750) and check it is writable."""
        try:
            self.dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"daemon.state_dir: cannot write {self.dir}: {err.strerror}") from err

    def save(self, record: WindowRecord) -> None:
        """Write the current window: temporary file, fsync, rename, fsync the directory."""
        self.write_current(json.dumps(record.to_dict(), separators=(",", ":")).encode())

    def write_current(self, data: bytes) -> None:
        """Write already serialized window data atomically."""
        self._write_atomic(self.current, data)

    def load(self) -> WindowRecord | None:
        """Read the current window, if one was left open; a torn or foreign file is set aside."""
        try:
            data = json.loads(self.current.read_bytes())
            return WindowRecord.from_dict(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            # The rename makes a torn write impossible; this is a hand-edited or foreign file.
            self.current.replace(self.current.with_suffix(".json.corrupt"))
            raise

    def clear(self) -> None:
        """Forget the current window (it has been closed and recorded in history)."""
        with contextlib.suppress(FileNotFoundError):
            self.current.unlink()
        self._fsync_dir()

    def append_history(self, record: WindowRecord) -> None:
        """Add a finished window to the history, keeping the last ``HISTORY_KEEP``."""
        lines = self._history_lines()[-(HISTORY_KEEP - 1):]
        lines.append(json.dumps(record.to_dict()))
        self._write_atomic(self.history_file, ("\n".join(lines) + "\n").encode())

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        """Return the last ``limit`` finished windows, newest last."""
        out = []
        for line in self._history_lines()[-limit:]:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def _history_lines(self) -> list[str]:
        try:
            return [ln for ln in self.history_file.read_text().splitlines() if ln.strip()]
        except FileNotFoundError:
            return []

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
