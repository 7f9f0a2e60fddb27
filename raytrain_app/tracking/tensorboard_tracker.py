"""TensorBoard event files under ``<run dir>/tensorboard``, through tensorboardX (Ray
brings it). A resumed run gets a new event file whose ``purge_step`` makes TensorBoard drop
what the previous segment logged after the checkpoint, so redone steps appear once."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raytrain_app.tracking.base import Tracker, epoch_scalars

TENSORBOARD_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    """Event files under ``<run dir>/tensorboard`` through tensorboardX (comes with Ray).

    The writer opens at the first scalar, as Lightning's TensorBoard logger does: importing
    tensorboardX took 0.3 s of rank 0's way to the first step, where every other rank waits
    for it (benchmarks/README.md, "First step").
    """

    def __init__(self, logdir: Path, resumed_step: int) -> None:
        self.logdir, self.resumed_step = logdir, resumed_step
        self._writer: Any = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            step = self.resumed_step
            self._writer = SummaryWriter(
                logdir=str(self.logdir),
                # TensorBoard drops events at or after purge_step from the earlier files.
                purge_step=step + 1 if step else None,
                flush_secs=30,
                filename_suffix=f".step{step}",  # one file per run segment
            )
        return self._writer

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"step/{key}", value, step)

    def log_epoch(self, step: int, row: Mapping[str, float]) -> None:
        for key, value in epoch_scalars(row).items():
            self.writer.add_scalar(f"epoch/{key}", value, step)
        self.writer.flush()  # an epoch is never lost to a crash between flushes

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()


def read_tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """The scalars of a run's event files as TensorBoard shows them: ``{tag: {step: value}}``.

    Files are read in order; a session start with a step (tensorboardX's ``purge_step``)
    drops the values logged at or after that step before it, as TensorBoard does.
    """
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset + 12 <= len(data):  # TFRecord: length, crc, payload, crc
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == SessionLog.START and event.step:
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars
