"""The progress bar the driver draws from rank 0's snapshots (``run_control`` fetches them).

``tqdm.auto`` renders as a widget in notebooks. Nothing on the training hot path waits
for the driver.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

_POLL_INTERVAL_S = 0.5


class EpochBars:
    """One tqdm bar per epoch, drawn from rank 0's snapshots."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        self._tqdm_kwargs = {"leave": True, "dynamic_ncols": True, **tqdm_kwargs}
        self._bar: tqdm | None = None
        self._epoch: int | None = None

    def show(self, snap: dict[str, Any]) -> None:
        if snap["epoch"] != self._epoch:
            self.close()
            self._epoch = snap["epoch"]
            # The first snapshot of an epoch arrives some steps in: those steps are where
            # the bar starts, not progress made in no time (a rate of 500,000 steps/s).
            self._bar = tqdm(
                total=snap["steps"],
                initial=snap["step"],
                desc=f"epoch {self._epoch}/{snap['epochs']}",
                unit="step",
                **self._tqdm_kwargs,
            )
        self._bar.update(snap["step"] - self._bar.n)
        self._bar.set_postfix(
            loss=f"{snap['loss']:.4f}",
            samples_s=f"{snap['samples_per_s']:.0f}",
            workers=snap["workers"],  # an elastic run changes its size
            refresh=False,
        )
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
