"""A W&B run in offline mode under ``<run dir>/wandb`` (``wandb sync`` uploads it); a
resumed run continues the same W&B run. A sweep's trials are runs in one group."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raytrain_app.tracking.base import Tracker, epoch_scalars


class WandbTracker(Tracker):
    """A W&B run in offline mode under ``<run dir>/wandb``; ``wandb sync`` uploads it.

    ``group``: the sweep a trial's run belongs to (W&B shows a group's runs together).
    """

    def __init__(
        self,
        run_dir: Path,
        project: str,
        name: str,
        params: dict,
        run_id: str | None,
        group: str | None = None,
    ) -> None:
        import wandb

        self.run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project=project,
            name=name,
            group=group,
            id=run_id,
            resume="allow" if run_id else None,
            config=params,
            settings=wandb.Settings(console="off", silent=True, disable_git=True),
        )
        self.run_id = self.run.id

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({f"step/{key}": value for key, value in scalars.items()}, step=step)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(
            {f"epoch/{key}": value for key, value in epoch_scalars(row).items()}, step=step
        )

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # finish() returns before W&B's service has written the offline file; shutting the
        # service down waits for it (this process may exit right after training).
        wandb.teardown()


def _offline_records(data: bytes) -> list[bytes]:
    """The records of a W&B offline file: a 7-byte header, then LevelDB's log format
    (32 KiB blocks of records with a 7-byte header each; a long record spans blocks)."""
    block, header, records, pending = 32768, 7, [], b""
    offset = header  # ":W&B", a magic number and a version
    while offset + header <= len(data):
        left = block - offset % block
        if left < header:  # the block's tail is padding
            offset += left
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        if kind == 0:  # zeroes: nothing more was written
            break
        pending += data[offset + header : offset + header + length]
        offset += header + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(pending)
            pending = b""
    return records


def read_wandb_offline_run(path: Path) -> dict[str, Any]:
    """What a W&B offline run file (``wandb/offline-run-*/run-<id>.wandb``) holds, as
    ``wandb sync`` would upload it: ``id``, ``name``, ``group``, ``config`` (top-level
    keys) and ``history`` (one dict per logged step)."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"config": {}, "history": []}
    for data in _offline_records(Path(path).read_bytes()):
        record = pb.Record.FromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(
                id=record.run.run_id, name=record.run.display_name, group=record.run.run_group
            )
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            run["history"].append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
            continue
        else:
            continue
        run["config"].update({item.key: json.loads(item.value_json) for item in updates})
    return run
