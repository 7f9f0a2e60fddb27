"""Data factories that return RayDataSplits, right and wrong, for the driver's checks."""

from __future__ import annotations

from raytrain_app.protocol import RayDataSplits


def _rows(rows):
    return rows


def not_splits(params: dict, seed: int) -> dict:
    return {"train": None}


def torch_lists(params: dict, seed: int) -> RayDataSplits:
    """Lists where Ray Datasets belong (enough for the commands that refuse Ray Datasets)."""
    return RayDataSplits(train=[1, 2], val=[3], to_batch=_rows)


def uncallable_to_batch(params: dict, seed: int) -> RayDataSplits:
    return RayDataSplits(train=[1, 2], val=[3], to_batch="rows_to_tensors")


def tiny(params: dict, seed: int) -> RayDataSplits:
    """``params["rows"]`` training rows (one column ``id``) and 3 validation rows."""
    import ray.data

    return RayDataSplits(ray.data.range(params["rows"]), ray.data.range(3), to_batch=_rows)
