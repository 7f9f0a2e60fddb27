"""A DistributedSampler that can start an epoch part-way, for exact mid-epoch resumes."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose next epoch can skip the samples a checkpoint already saw.

    The order is still the seeded permutation of ``seed + epoch``, so a resumed epoch
    yields exactly the tail an uninterrupted one would have, without loading the skipped
    samples.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def skip_next(self, num_samples: int) -> None:
        """Leave out this rank's first ``num_samples`` indices of the next iteration only."""
        self._skip = num_samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        return iter(indices[skip:])
