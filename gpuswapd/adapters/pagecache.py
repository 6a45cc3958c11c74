"""The page cache of the resident's model files: how much of each is in RAM, and reading the rest in.

``measure`` maps each file read-only, a window at a time, and asks mincore(2) (through ctypes)
which of its pages are resident: nothing is read. ``prefetch`` reads a file in order, a chunk at
a time: a chunk already in the page cache is skipped (mincore again), the next one is announced
with posix_fadvise(WILLNEED) while this one is read, so the disk always has work queued. Between
chunks it looks at its ``stop`` event: the window's close ends it within one chunk. The bytes it
reads land in the page cache, where llama.cpp's mmap finds them when the resident starts.

These are blocking calls: gpuswapd runs them on the ``files`` lane's workers (gpuswapd/outside.py).
"""

from __future__ import annotations

import ctypes
import errno as errnos
import grp
import os
import pwd
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PAGE = os.sysconf("SC_PAGE_SIZE")
WINDOW = 1 << 30  # mapped at once to ask mincore (its vector: one byte per page, 256 KiB)
CHUNK = 16 << 20  # read at once by a prefetch: how soon a stop is seen
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore sets bit 0 of a page's byte when it is resident


@dataclass(frozen=True)
class FileCache:
    """One file: its size, how much of it is in the page cache, or why that cannot be told."""

    path: str
    real: str  # the file it names, links resolved (two names of one file count once)
    size: int = 0
    cached: int = 0  # bytes in the page cache
    error: str | None = None  # why it could not be measured (missing, unreadable, not a file)
    denied: bool = False  # it exists but gpuswapd may not read it (permissions)
    mode: str = ""  # e.g. "0640", with owner and group, for a message about permissions
    owner: str = ""
    group: str = ""

    @property
    def ratio(self) -> float:
        """Return the fraction in the page cache (1.0 for an empty file)."""
        return 1.0 if self.size <= 0 else min(1.0, self.cached / self.size)


@dataclass(frozen=True)
class Measured:
    """The files as measured, and the host memory available (MemAvailable) then."""

    files: tuple[FileCache, ...]
    mem_available: int | None


@dataclass
class Progress:
    """What a prefetch has done so far: written by its worker, read by whoever stops it."""

    cached: int = 0  # bytes of the files known to be in the page cache
    read: int = 0  # bytes it read from disk


class Files(Protocol):
    """The page cache as gpuswapd uses it (the simulation and the fast tests have their own)."""

    def measure(self, paths: Sequence[str]) -> Measured:
        """Measure how much of each file is in the page cache, and the host memory available."""

    def prefetch(self, paths: Sequence[str], stop: threading.Event, progress: Progress) -> Progress:
        """Read what of the files is not in the page cache yet, until done or ``stop`` is set."""


class PageCache:
    """The real page cache of this machine, through mincore(2) and posix_fadvise(2)."""

    def measure(self, paths: Sequence[str]) -> Measured:
        """Measure each file (each real file once); read MemAvailable."""
        seen: set[str] = set()
        out = []
        for path in paths:
            found = measure_file(path)
            if found.real in seen:
                continue
            seen.add(found.real)
            out.append(found)
        return Measured(tuple(out), mem_available())

    def prefetch(self, paths: Sequence[str], stop: threading.Event, progress: Progress) -> Progress:
        """Read the files in order, skipping what is cached, until done or ``stop`` is set."""
        for path in paths:
            if stop.is_set():
                break
            try:
                _prefetch_file(path, stop, progress)
            except OSError:
                continue  # measured as missing or unreadable already, or gone since: the next one
        return progress


def measure_file(path: str) -> FileCache:
    """Measure one file; a file that cannot be measured says why."""
    real = os.path.realpath(path)
    try:
        st = os.stat(path)
    except OSError as err:  # EACCES here: a directory on the way that gpuswapd may not search
        return FileCache(path, real, error=_why(err), denied=err.errno in (errnos.EACCES, errnos.EPERM))
    owner, group = _name(pwd.getpwuid, st.st_uid), _name(grp.getgrgid, st.st_gid)
    mode = f"{stat.S_IMODE(st.st_mode):04o}"
    if not stat.S_ISREG(st.st_mode):
        return FileCache(path, real, error="not a regular file", mode=mode, owner=owner, group=group)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        return FileCache(path, real, st.st_size, error=_why(err), denied=err.errno in (errnos.EACCES, errnos.EPERM),
                         mode=mode, owner=owner, group=group)
    try:
        size = os.fstat(fd).st_size
        return FileCache(path, real, size, cached_bytes(fd, 0, size), mode=mode, owner=owner, group=group)
    except OSError as err:
        return FileCache(path, real, st.st_size, error=_why(err), mode=mode, owner=owner, group=group)
    finally:
        os.close(fd)


def cached_bytes(fd: int, offset: int, length: int) -> int:
    """Count the bytes of ``fd`` from ``offset`` (page-aligned) for ``length`` that are in the page cache."""
    total, end = 0, offset + length
    while offset < end:
        span = min(WINDOW, end - offset)
        pages = (span + PAGE - 1) // PAGE
        total += min(span, _resident_pages(fd, offset, span, pages) * PAGE)
        offset += span
    return total


def _resident_pages(fd: int, offset: int, span: int, pages: int) -> int:
    addr = _mmap(None, span, _PROT_READ, _MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        raise _os_error("mmap")
    try:
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(addr), span, vec) != 0:
            raise _os_error("mincore")
        return bytes(vec).translate(_LOW_BIT).count(1)
    finally:
        _libc.munmap(ctypes.c_void_p(addr), span)


def _prefetch_file(path: str, stop: threading.Event, progress: Progress) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = memoryview(bytearray(CHUNK))
        before: dict[int, int] = {}  # chunk -> bytes of it cached before this prefetch touched it

        def announce(offset: int) -> None:
            """Note what of a chunk is cached, then ask the kernel to start reading the rest."""
            if offset < size and offset not in before:
                n = min(CHUNK, size - offset)
                before[offset] = cached_bytes(fd, offset, n)
                if before[offset] < n:
                    os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)

        offset = 0
        announce(offset)
        while offset < size and not stop.is_set():
            n = min(CHUNK, size - offset)
            announce(offset + n)  # the disk has the next chunk queued while this one is copied
            if cached_bytes(fd, offset, n) < n:
                _read(fd, buf[:n], offset)
            brought = n - before.pop(offset)
            progress.read += brought
            progress.cached += brought
            offset += n
    finally:
        os.close(fd)


def _read(fd: int, view: memoryview, offset: int) -> None:
    """Read ``view`` full from ``offset`` (the copy is thrown away: the page cache keeps the pages)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            return  # the file shrank meanwhile
        done += got


def evict(path: str) -> None:
    """Drop a file's pages from the page cache (posix_fadvise DONTNEED; pages mapped by a process stay)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mem_available() -> int | None:
    """Read MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _why(err: OSError) -> str:
    if err.filename is None and err.strerror:
        # A call on the open file (mmap, mincore), named in its message: its EPERM is a system
        # call filter's (the unit's SystemCallFilter=), not the file's mode.
        return err.strerror
    if err.errno == errnos.ENOENT:
        return "no such file"
    if err.errno in (errnos.EACCES, errnos.EPERM):
        return "permission denied"
    return err.strerror or str(err)


def _name(lookup: object, ident: int) -> str:
    try:
        return str(lookup(ident)[0])  # type: ignore[operator]
    except (KeyError, OverflowError):
        return str(ident)


def _os_error(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = getattr(_libc, "mmap64", _libc.mmap)
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value
