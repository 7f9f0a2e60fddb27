"""A checkpoint file is written around the page cache (``direct_file.DigestingFile``):
the bytes on disk, their size and their SHA-256 are exactly what was written, however the
writes fall against its buffer, and a filesystem that refuses ``O_DIRECT`` (at the open or
at a write) gets the same file through the page cache."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import shutil
import subprocess

import pytest
import torch

from raytrain_app.checkpoint import direct_file, store
from raytrain_app.checkpoint.direct_file import DigestingFile

SMALL_BUFFER = 64 << 10  # many buffers' worth in a test's few MB


def _direct_io_works(folder) -> bool:
    probe = folder / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    probe.unlink()
    return True


def _pieces(total: int, seed: int = 0) -> list[bytes]:
    """Writes of every kind of size: a few bytes (torch.save's headers), odd sizes, and
    pieces larger than the buffer (a tensor's record)."""
    rng = random.Random(seed)
    pieces, written = [], 0
    while written < total:
        size = rng.choice([1, 7, 63, 4096, 4097, SMALL_BUFFER - 1, 3 * SMALL_BUFFER + 5])
        pieces.append(rng.randbytes(size))
        written += size
    return pieces


def _write(path, pieces, **kwargs) -> DigestingFile:
    with DigestingFile(path, **kwargs) as out:
        for piece in pieces:
            assert out.write(memoryview(piece)) == len(piece)
    return out


def _assert_is(path, out: DigestingFile, pieces) -> None:
    expected = b"".join(pieces)
    assert path.read_bytes() == expected
    assert out.size == len(expected)
    assert out.sha256.hexdigest() == hashlib.sha256(expected).hexdigest()


def _write_with(tmp_path, monkeypatch, name: str, replacement, seed: int) -> DigestingFile:
    """Write a file with ``os.<name>`` replaced, and check it is every byte written."""
    monkeypatch.setattr(direct_file.os, name, replacement)
    pieces = _pieces(1 << 20, seed=seed)
    out = _write(tmp_path / "f", pieces)
    monkeypatch.undo()
    _assert_is(tmp_path / "f", out, pieces)
    return out


@pytest.fixture
def small_buffer(monkeypatch):
    monkeypatch.setattr(direct_file, "BUFFER_BYTES", SMALL_BUFFER)


def test_the_file_is_every_byte_written_whatever_the_sizes_of_the_writes(tmp_path, small_buffer):
    pieces = _pieces(2 << 20)
    out = _write(tmp_path / "f", pieces)
    _assert_is(tmp_path / "f", out, pieces)
    if _direct_io_works(tmp_path):
        # All but the tail (less than one buffer) went around the page cache.
        assert out.size - SMALL_BUFFER < out.direct_bytes <= out.size
        assert out.direct_bytes % SMALL_BUFFER == 0


def test_a_checkpoint_written_around_the_page_cache_leaves_it_there_no_more(tmp_path):
    """What the writer is for: a 64 MB checkpoint's pages are not left in the page cache
    (fincore, util-linux), as they are when it is written through it."""
    if not _direct_io_works(tmp_path):
        pytest.fail(f"{tmp_path}'s filesystem refuses O_DIRECT: run this test on a disk")
    assert shutil.which("fincore"), "fincore (Debian's util-linux) is needed"
    state = {"w": torch.randn(16 << 20)}

    def resident_bytes(path) -> int:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.split()[0])

    written = {}
    for direct in (True, False):
        path = tmp_path / f"direct-{direct}.pt"
        with DigestingFile(path, direct=direct) as out:
            torch.save(state, out)
        written[direct] = resident_bytes(path)
        assert torch.equal(store.load_tensors(path)["w"], state["w"])
    assert written[True] <= direct_file.BUFFER_BYTES  # at most the tail
    assert written[False] >= out.size // 2


def test_a_filesystem_that_refuses_direct_io_at_the_open_gets_the_same_file(
    tmp_path, monkeypatch, small_buffer
):
    real_open = os.open

    def no_direct_io(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    out = _write_with(tmp_path, monkeypatch, "open", no_direct_io, seed=1)
    assert out.direct_bytes == 0


def test_a_filesystem_that_refuses_direct_writes_gets_the_same_file(
    tmp_path, monkeypatch, small_buffer
):
    """Some filesystems take the open with O_DIRECT and refuse the writes (EINVAL): the
    refused buffer and every later byte go through the page cache."""
    if not _direct_io_works(tmp_path):
        pytest.fail(f"{tmp_path}'s filesystem refuses O_DIRECT: run this test on a disk")
    real_write = os.write

    def refused_while_direct(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    out = _write_with(tmp_path, monkeypatch, "write", refused_while_direct, seed=2)
    assert out.direct_bytes == 0


def test_a_short_direct_write_is_finished_through_the_page_cache(
    tmp_path, monkeypatch, small_buffer
):
    real_write = os.write
    short = []

    def half_of_the_first(fd, data):
        if not short:
            short.append(len(data))
            return real_write(fd, memoryview(data)[: len(data) // 2])
        return real_write(fd, data)

    _write_with(tmp_path, monkeypatch, "write", half_of_the_first, seed=3)
    assert short, "no write was made"


def test_a_failed_save_leaves_its_file_unfinished_and_the_error_its_own(tmp_path, small_buffer):
    pieces = _pieces(256 << 10, seed=4)
    out = DigestingFile(tmp_path / "f")
    with pytest.raises(RuntimeError, match="the save failed"), out:
        for piece in pieces:
            out.write(piece)
        raise RuntimeError("the save failed")
    # What was gathered but not yet written is dropped, not written as if it were whole.
    assert (tmp_path / "f").stat().st_size < out.size
    out.close()  # a second close does nothing
