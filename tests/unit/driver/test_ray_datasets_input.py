"""The driver's checks of a data factory's RayDataSplits: one line naming data.target."""

from __future__ import annotations

import pytest

from raytrain_app.driver.ray_datasets import load_data_splits
from raytrain_app.errors import BadInputError
from raytrain_app.workloads import FactoryRef


def _ref(name: str) -> FactoryRef:
    return FactoryRef(f"ray_data_factories:{name}", {}, "data.target")


def _message(name: str, command: str = "train") -> str:
    with pytest.raises(BadInputError) as info:
        load_data_splits(_ref(name), seed=0, global_batch_size=4, command=command)
    message = str(info.value)
    assert "\n" not in message and f"data.target='ray_data_factories:{name}'" in message
    return message


def test_a_factory_returning_neither_splits_is_refused():
    assert "returned dict, not raytrain_app.DataSplits or RayDataSplits" in _message("not_splits")


@pytest.mark.parametrize("command", ["tune", "predict", "local"])
def test_commands_without_ray_train_refuse_ray_datasets(command):
    message = _message("torch_lists", command)
    assert "returns RayDataSplits" in message and "data.path" in message


def test_train_refuses_what_is_not_a_ray_dataset():
    assert "whose train is list, not a ray.data.Dataset" in _message("torch_lists")


def test_train_refuses_a_to_batch_that_cannot_be_called():
    assert "to_batch is not callable" in _message("uncallable_to_batch")
