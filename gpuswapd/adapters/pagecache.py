"""The page cache of the resident's model files: how much of each is in RAM, and reading the rest in.

``measure`` maps each file read-only, a window at a time, and asks mincore(2) (through ctypes)
which of its pages are resident: nothing is read. ``prefetch`` reads a file in order, a chunk at
a time: a chunk already in the page cache is skipped (mincore again), the next one is announced
with posix_fadvise(WILLNEED) while this one is read, so the disk always has work queued. Between
chunks it looks at its ``stop`` event: the window's close ends it within one chunk. The bytes it
reads land in the page cache, where llama.cpp's mmap finds them when the resident starts.

Whatever a path names at read time is not trusted: every file is opened ``O_NONBLOCK`` (a FIFO
swapped in does not block a worker in open(2)) and ``O_NOFOLLOW`` with one symlink followed by hand
(a Hugging Face cache's snapshot links to its blob; a link to a link is refused), then ``fstat``:
only a regular file is measured or read. A prefetch reads only what was measured: the file it
opened must be the one measured (device, inode and size), else it is skipped and said so
(``Progress.skipped``), and it reads no more than the size measured.

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
from dataclasses import dataclass, field, replace
from typing import Protocol

PAGE = os.sysconf("SC_PAGE_SIZE")
WINDOW = 1 << 30  # mapped at once to ask mincore (its vector: one byte per page, 256 KiB)
CHUNK = 16 << 20  # read at once by a prefetch: how soon a stop is seen
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore sets bit 0 of a page's byte when it is resident


OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW


class NotRegular(OSError):
    """The path names no regular file (a FIFO, a device, a directory, a socket)."""


@dataclass(frozen=True)
class Identity:
    """Which file was measured: a prefetch reads it only if the file it opens is still this one."""

    device: int
    inode: int
    size: int


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
    identity: Identity | None = None  # the file measured (None: it could not be)

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
    measured: dict[str, Identity] = field(default_factory=dict)  # what it may read: each path's file as measured
    skipped: list[str] = field(default_factory=list)  # files it did not read, each with why


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
        """Read the files in order, skipping what is cached, until done or ``stop`` is set.

        Only a file as measured (``progress.measured``) is read; any other is skipped, and why is
        added to ``progress.skipped``.
        """
        for path in paths:
            if stop.is_set():
                break
            expected = progress.measured.get(path)
            if expected is None:
                progress.skipped.append(f"{path}: not measured")
                continue
            try:
                fd, st = open_file(path)
            except OSError as err:
                progress.skipped.append(f"{path}: {_why(err)} (it was a regular file when measured)")
                continue
            try:
                found = Identity(st.st_dev, st.st_ino, st.st_size)
                if found != expected:
                    progress.skipped.append(f"{path}: not the file measured (device {found.device}, inode "
                                            f"{found.inode}, {found.size} bytes; measured: device {expected.device}, "
                                            f"inode {expected.inode}, {expected.size} bytes)")
                    continue
                _prefetch_fd(fd, expected.size, stop, progress)
            except OSError as err:
                progress.skipped.append(f"{path}: {_why(err)}")
            finally:
                os.close(fd)
        return progress


def open_file(path: str) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without blocking; follow one symlink, no more; return it and its fstat.

    O_NONBLOCK: a FIFO opens at once (and is refused), instead of holding the caller until a writer
    comes. O_NOFOLLOW: a link is followed here, once, to the path it names (a link to a link is
    refused: ELOOP). NotRegular for anything but a regular file.
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        if err.errno != errnos.ELOOP or not os.path.islink(path):
            raise
        target = os.path.join(os.path.dirname(path), os.readlink(path))
        fd = os.open(target, OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errnos.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def measure_file(path: str) -> FileCache:
    """Measure one file; a file that cannot be measured says why."""
    real = os.path.realpath(path)
    try:
        fd, st = open_file(path)
    except NotRegular:
        return FileCache(path, real, error="not a regular file")
    except OSError as err:
        denied = err.errno in (errnos.EACCES, errnos.EPERM)
        try:
            st = os.stat(path)
        except OSError:  # EACCES here: a directory on the way that gpuswapd may not search
            return FileCache(path, real, error=_why(err), denied=denied)
        return replace(_owned(path, real, st), size=st.st_size, error=_why(err), denied=denied)
    try:
        cached = cached_bytes(fd, 0, st.st_size)
    except OSError as err:
        return replace(_owned(path, real, st), size=st.st_size, error=_why(err))
    finally:
        os.close(fd)
    return replace(_owned(path, real, st), size=st.st_size, cached=cached,
                   identity=Identity(st.st_dev, st.st_ino, st.st_size))


def _owned(path: str, real: str, st: os.stat_result) -> FileCache:
    """Start a file's record with its mode, owner and group (for a message about permissions)."""
    return FileCache(path, real, mode=f"{stat.S_IMODE(st.st_mode):04o}", owner=_name(pwd.getpwuid, st.st_uid),
                     group=_name(grp.getgrgid, st.st_gid))


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


def _prefetch_fd(fd: int, size: int, stop: threading.Event, progress: Progress) -> None:
    """Read ``size`` bytes of an open file into the page cache, what is not there yet, until ``stop``."""
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
