"""A checkpoint file written around the page cache, digested as it is written.

What torch.save writes into (``store._atomic_torch_save``): a new file, written front to
back, whose SHA-256 is taken from the bytes as they pass, so that the manifest needs no
second read of the file.

Why around the page cache (``O_DIRECT``): a background checkpoint competes for the CPU
with the training, and through the page cache the kernel spends more CPU on the bytes
than the writer itself: 1.0-2.8 s of kernel time for 1.2 GB on a 2-core VM (page
allocation, dirty tracking, writeback), against 0.05 s for the same bytes written with
``O_DIRECT`` (``benchmarks/README.md``, "Checkpoints off the step's path"). Nothing reads
a checkpoint back soon after it is written, so caching it only evicts the training's
own pages.

``O_DIRECT`` wants the memory, the file offset and the length of each write aligned to
the device's block size; torch.save's records are neither. So the bytes are gathered in
one page-aligned buffer (``mmap``) and written ``BUFFER_BYTES`` at a time, the tail (not a
whole block) through the page cache. A filesystem that refuses ``O_DIRECT`` (tmpfs on
older kernels, some network and FUSE filesystems), at the open or at a write, gets every
byte through the page cache instead: the same file, only slower.

Every copy and write lets the GIL go (numpy's copy, ``hashlib`` past 2 KiB, ``os.write``),
so the training thread beside a background save runs as it would beside a process.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from typing import Any

import numpy as np

# 16 MiB: large enough that a write's fixed cost is nothing beside its bytes, small
# enough to sit in a writer thread's memory beside a checkpoint's host copy.
BUFFER_BYTES = 16 << 20
# Bytes are digested from the buffer right after they are copied into it, a piece this
# size at a time, while they are still in the CPU's cache: the tensor's memory is read
# once, not once by the copy and again by SHA-256 (memory bandwidth is what a training
# step beside the writer shares with it).
DIGEST_BYTES = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every write is cached


class DigestingFile:
    """A new file, written sequentially (``write``), with its size and SHA-256.

    Args:
        path: the file to create (truncated if it exists).
        direct: bypass the page cache where the filesystem allows it.
    """

    def __init__(self, path: str | os.PathLike, *, direct: bool = True) -> None:
        self.name = os.fspath(path)  # a file object's name: the path it writes
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.direct_bytes = 0  # of ``size``, those written around the page cache
        self._fd, self.direct = _open_new(self.name, direct and bool(_O_DIRECT))
        self._buffer = mmap.mmap(-1, BUFFER_BYTES) if self.direct else None
        self._gathered = np.frombuffer(self._buffer, np.uint8) if self._buffer else None
        self._filled = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if not self.direct:
            self.sha256.update(view)
            _write_all(self._fd, view)
            return len(view)
        source = np.frombuffer(view, np.uint8)
        taken = 0
        while taken < len(source):
            start = self._filled
            part = source[taken : taken + min(BUFFER_BYTES - start, DIGEST_BYTES)]
            self._gathered[start : start + len(part)] = part  # the GIL let go
            self.sha256.update(self._gathered[start : start + len(part)])  # still in cache
            self._filled += len(part)
            taken += len(part)
            if self._filled == BUFFER_BYTES:
                self._write_gathered()
                if not self.direct:  # refused: the rest goes through the page cache
                    self.sha256.update(view[taken:])
                    _write_all(self._fd, view[taken:])
                    break
        return len(view)

    def flush(self) -> None:
        """Nothing: bytes still gathered go out in ``close``, and torch.save flushes only
        at its end, where ``close`` follows."""

    def close(self) -> None:
        """Write what is still gathered and close the file (on error, too)."""
        if self._fd < 0:
            return
        try:
            if self._filled:
                self._cached()  # the tail is not a whole block
                _write_all(self._fd, memoryview(self._gathered[: self._filled]))
                self._filled = 0
        finally:
            os.close(self._fd)
            self._fd = -1
            self._gathered = None  # the buffer's last view: it can be closed now
            if self._buffer is not None:
                self._buffer.close()

    def __enter__(self) -> DigestingFile:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None:
            self._filled = 0  # a failed save's file is left unfinished, not completed
        self.close()

    def _write_gathered(self) -> None:
        whole = memoryview(self._gathered[: self._filled])
        try:
            written = os.write(self._fd, whole)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            written = 0  # the filesystem took the open but refuses direct writes
        self.direct_bytes += written
        if written < len(whole):  # refused, or a short write: the rest through the cache
            self._cached()
            _write_all(self._fd, whole[written:])
        self._filled = 0

    def _cached(self) -> None:
        """Every later write goes through the page cache."""
        if self.direct:
            import fcntl  # POSIX only, and only O_DIRECT's systems get here

            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            self.direct = False


def _open_new(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | _O_DIRECT, 0o666), True  # mode as open(..., "wb")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


def _write_all(fd: int, view: memoryview) -> None:
    """``os.write`` until every byte is in: a write may take less than it is given (2 GiB
    at most on Linux, less on a signal)."""
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])
