"""torch.compile's cache is a folder no other user can write (``worker/compile_cache.py``):
inductor imports and loads what it finds there, and its default,
``<tmp>/torchinductor_<user>``, is a name another user of a shared node can take first.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from torch._inductor.runtime import cache_dir_utils

from raytrain_app.worker import compile_cache
from raytrain_app.worker.compile_cache import CACHE_VARIABLE, use_private_compile_cache


@pytest.fixture
def default_dir(tmp_path, monkeypatch) -> Path:
    """Inductor's default cache folder, moved into ``tmp_path``; the variable unset, and
    restored after the test (the function under test sets it)."""
    saved = os.environ.pop(CACHE_VARIABLE, None)
    path = tmp_path / "torchinductor_me"
    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(path))
    yield path
    os.environ.pop(CACHE_VARIABLE, None)
    if saved is not None:
        os.environ[CACHE_VARIABLE] = saved


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _assert_fell_back(chosen: Path, default: Path, warned: str) -> None:
    """``chosen`` is a new private folder, and ``warned`` says which was not used and how
    to keep the cache."""
    assert chosen != default and os.environ[CACHE_VARIABLE] == str(chosen)
    assert chosen.is_dir() and _mode(chosen) == 0o700
    assert f"{default}, torch.compile's default cache, is not a folder" in warned
    assert f"set {CACHE_VARIABLE}" in warned


def _warning(caplog) -> str:
    (record,) = [r for r in caplog.records if r.name == compile_cache.__name__]
    assert record.levelno == logging.WARNING
    return record.getMessage()


def test_a_default_folder_not_there_yet_is_made_private_and_used(default_dir, caplog):
    assert use_private_compile_cache() == default_dir
    assert os.environ[CACHE_VARIABLE] == str(default_dir)
    assert _mode(default_dir) & 0o077 == 0  # 0700 under any umask
    assert not caplog.records


def test_this_users_own_folder_as_torch_made_it_keeps_its_cache(default_dir, caplog):
    default_dir.mkdir(mode=0o755)  # torch's os.makedirs under the usual umask
    (default_dir / "kept").write_text("a compiled kernel")
    assert use_private_compile_cache() == default_dir
    assert (default_dir / "kept").exists()
    assert not caplog.records


def test_a_folder_others_can_write_is_not_used(default_dir, caplog):
    default_dir.mkdir()
    default_dir.chmod(0o777)
    _assert_fell_back(use_private_compile_cache(), default_dir, _warning(caplog))


def test_another_users_folder_is_not_used(default_dir, caplog, monkeypatch):
    default_dir.mkdir(mode=0o755)
    someone_else = default_dir.lstat().st_uid + 1
    monkeypatch.setattr(compile_cache.os, "getuid", lambda: someone_else)
    _assert_fell_back(use_private_compile_cache(), default_dir, _warning(caplog))


def test_a_link_in_its_place_is_not_followed(default_dir, caplog, tmp_path):
    elsewhere = tmp_path / "planted"
    elsewhere.mkdir(mode=0o700)
    default_dir.symlink_to(elsewhere)
    _assert_fell_back(use_private_compile_cache(), default_dir, _warning(caplog))


def test_a_folder_the_user_chose_is_theirs(default_dir, caplog, tmp_path):
    chosen = tmp_path / "mine"
    os.environ[CACHE_VARIABLE] = str(chosen)
    assert use_private_compile_cache() is None
    assert os.environ[CACHE_VARIABLE] == str(chosen)
    assert not default_dir.exists() and not caplog.records


def test_the_worker_compiles_into_a_private_cache(default_dir, capfd, monkeypatch, tmp_path):
    """The worker loop's compile (``model_setup``) with a default folder others can write:
    it trains, compiled into a private folder instead."""
    import functools
    from dataclasses import replace

    import torch
    from loop_harness import LocalSession, make_task

    from raytrain_app.worker.loop import WorkerLoop

    default_dir.mkdir()
    default_dir.chmod(0o777)
    torch._dynamo.reset()
    # aot_eager: dynamo and AOT autograd as inductor runs them, without a C++ build.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    task = make_task(tmp_path, epochs=1)
    task.plan = replace(task.plan, compile=True)
    loop = WorkerLoop(task, LocalSession(tmp_path / "ckpt"))
    try:
        result = loop.run()
    finally:
        torch._dynamo.reset()
    assert isinstance(loop.stepper.model, torch._dynamo.eval_frame.OptimizedModule)
    assert len(result["history"]) == 1
    # The worker's own logging (setup_logging) writes it to stderr.
    _assert_fell_back(Path(os.environ[CACHE_VARIABLE]), default_dir, capfd.readouterr().err)
