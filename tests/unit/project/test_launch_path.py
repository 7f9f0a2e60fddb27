"""Following the config through ``train``: how often the reader jumps between modules.

A reader of ``train`` opens each module it calls, and each module those call (depth 2:
the steps and what each step does), but not a step's own helpers. The trace records the
module the innermost such call runs in, with Ray and the trainer stood in (as
tests/unit/api/test_cli.py does); a "stop" is each change of module, a "return" a stop
at a module already left. The base modules (config, storage, errors, logging, protocol)
are read everywhere and never count. Issue 33 measured a start that zig-zagged: 43 stops
and 35 returns at depth 2 before the ``Launch`` (133 and 115 at depth 3).

Along the same path, the launch sizes the data once (``data.streaming: auto``).

Run as a script to print the path: ``python tests/unit/project/test_launch_path.py [depth]``.
"""

from __future__ import annotations

import itertools
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BASE = (
    "raytrain_app.config",
    "raytrain_app.storage",
    "raytrain_app.errors",
    "raytrain_app.logging_setup",
    "raytrain_app.protocol",
)


class ModulePath:
    """``sys.setprofile`` hook: the modules control passes through, down to ``depth``
    changes of module below the entry point."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.stack: list[tuple[str, bool]] = []  # (module, followed) of raytrain frames
        self.stops: list[str] = []

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event not in ("call", "return"):
            return
        name = frame.f_globals.get("__name__") or ""
        if not name.startswith("raytrain_app"):
            return
        if event == "call":
            chain = [module for module, followed in self.stack if followed] + [name]
            depth = 1 + sum(1 for a, b in itertools.pairwise(chain) if a != b)
            followed = all(f for _, f in self.stack) and depth <= self.depth
            self.stack.append((name, followed and not name.startswith(BASE)))
        elif self.stack:
            self.stack.pop()
        shown = [module for module, followed in self.stack if followed]
        if shown and (not self.stops or self.stops[-1] != shown[-1]):
            self.stops.append(shown[-1])

    @property
    def returns(self) -> int:
        """Stops at a module the path had already left."""
        return sum(1 for i, module in enumerate(self.stops) if module in self.stops[:i])


@contextmanager
def stood_in_ray(monkeypatch: pytest.MonkeyPatch, cwd: Path) -> Iterator[None]:
    """An embedded Ray that is never started and a trainer that returns at once."""
    import ray

    from raytrain_app.driver import executors, launch, ray_connection
    from raytrain_app.planning.environment import Resources

    started: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(k))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cluster = Resources(cpus=2, gpus=0, nodes=1, source="ray cluster")
    monkeypatch.setattr(ray_connection, "ray_cluster_resources", lambda: (cluster, None))
    monkeypatch.setattr(launch, "check_shared", lambda *args: None)  # asks Ray's nodes
    result = types.SimpleNamespace(return_value={"history": []}, checkpoint=None)
    monkeypatch.setattr(executors, "run_trainer", lambda *args, **kwargs: (result, None))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(cwd)
    saved = dict(os.environ)  # train() sets Ray Train's variables
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def follow_train(depth: int) -> ModulePath:
    """Train the quickstart for one epoch under the hook (Ray and trainer stood in)."""
    from raytrain_app.config import load_config
    from raytrain_app.driver.training import train

    cfg = load_config(None, ["train.epochs=1", "scaling.num_workers=2"])
    path = ModulePath(depth)
    sys.setprofile(path)
    try:
        train(cfg, progress=False)
    finally:
        sys.setprofile(None)
    return path


def test_following_the_config_through_train_returns_to_a_module_at_most_14_times(
    monkeypatch, tmp_path
):
    with stood_in_ray(monkeypatch, tmp_path):
        path = follow_train(depth=2)
    shown = " -> ".join(m.removeprefix("raytrain_app.") for m in path.stops)
    assert path.stops[0] == "raytrain_app.driver.training", shown
    assert path.returns <= 14, shown


def test_whether_the_data_streams_is_decided_from_one_listing(monkeypatch, tmp_path):
    """``data.streaming: auto`` sizes ``data.path`` once: the plan made again against the
    embedded Ray keeps the choice made before Ray started, instead of listing a bucket of
    many files a second time."""
    from stream_data import PARAMS, series_table, write_files

    from raytrain_app.config import config_from_dict
    from raytrain_app.data import stream_choice
    from raytrain_app.driver.training import train

    sized: list[int] = []
    size = stream_choice.file_bytes
    monkeypatch.setattr(
        stream_choice, "file_bytes", lambda files: sized.append(len(files)) or size(files)
    )
    folder = write_files(tmp_path / "data", series_table())
    cfg = config_from_dict(
        {
            "experiment": {"name": "listed", "output_dir": str(tmp_path / "runs")},
            "data": {"path": str(folder), "params": PARAMS},
            "model": {"target": "window_regression:build_model", "params": {"hidden": 8}},
            "train": {"epochs": 1},
            "scaling": {"num_workers": 2},
        }
    )
    with stood_in_ray(monkeypatch, tmp_path):
        train(cfg, progress=False)
    assert sized == [2]  # one sizing of the two files (it was two before Ray and after)


if __name__ == "__main__":
    import tempfile

    depth = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as scratch:
        stand_ins = stood_in_ray(patch, Path(scratch))
        with stand_ins:
            followed = follow_train(depth)
    print(f"{len(followed.stops)} stops, {followed.returns} returns")
    print(" -> ".join(m.removeprefix("raytrain_app.") for m in followed.stops))
