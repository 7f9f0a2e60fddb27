"""Workloads: import targets, built-in names, data preparation and the factory protocol checks."""

from __future__ import annotations

import sys
import textwrap

import pyarrow.parquet as pq
import pytest
from torch import nn

from raytrain_app.config import config_from_dict
from raytrain_app.data import synthetic_wind
from raytrain_app.errors import BadInputError
from raytrain_app.protocol import DataSplits, ModelSpec
from raytrain_app.workloads import (
    BUILTIN_MODELS,
    FactoryRef,
    build_data,
    build_model,
    import_target,
    model_factory,
    prepare_data,
)

# Small synthetic data: 2 series of 300 hours give train and val windows of the default size.
SMALL = {"num_turbines": 2, "num_hours": 300}
WIND_COLUMNS = {
    "feature_columns": list(synthetic_wind.FEATURE_COLUMNS),
    "target_column": synthetic_wind.TARGET_COLUMN,
    "group_column": synthetic_wind.GROUP_COLUMN,
    "time_column": synthetic_wind.TIME_COLUMN,
}


def data_section(**data):
    return config_from_dict({"data": data}).data


def model_section(**model):
    return config_from_dict({"model": model}).model


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------- import_target


@pytest.mark.parametrize("target", ["no_colon", "pkg.mod:", ":build", ""])
def test_import_target_rejects_malformed_targets(target):
    with pytest.raises(BadInputError) as info:
        import_target(target, "model.target")
    message = one_line(info)
    assert "model.target" in message and "package.module:function" in message


def test_import_target_names_the_key_when_the_module_is_missing():
    with pytest.raises(BadInputError) as info:
        import_target("nonexistent_pkg.mod:build", "data.target")
    message = one_line(info)
    assert "data.target" in message and "nonexistent_pkg" in message
    assert "PYTHONPATH" in message


def test_import_target_names_the_key_when_the_attribute_is_missing():
    with pytest.raises(BadInputError) as info:
        import_target("raytrain_app.models.wind_transformer:no_such_build", "model.target")
    message = one_line(info)
    assert "model.target" in message and "no_such_build" in message


def test_import_target_returns_the_attribute():
    from raytrain_app.models import wind_transformer

    assert import_target(BUILTIN_MODELS["wind_transformer"], "model.name") is wind_transformer.build


# --------------------------------------------------------------------------- model_factory


def test_model_factory_resolves_a_builtin_name_to_its_target():
    ref = model_factory(model_section(name="wind_transformer", params={"d_model": 16}))
    assert ref.target == BUILTIN_MODELS["wind_transformer"]
    assert ref.params == {"d_model": 16}
    import_target(ref.target, ref.config_key)  # importable wherever a worker runs


def test_model_factory_passes_a_user_target_through():
    ref = model_factory(model_section(target="my_pkg.models:build", params={"width": 3}))
    assert ref == FactoryRef("my_pkg.models:build", {"width": 3}, "model.target")


def test_unknown_builtin_model_lists_the_alternatives():
    with pytest.raises(BadInputError) as info:
        model_factory(model_section(name="resnet"))
    message = one_line(info)
    assert "model.name='resnet'" in message
    assert "wind_transformer" in message and "model.target" in message


def test_unknown_builtin_data_lists_the_alternatives(tmp_path):
    with pytest.raises(BadInputError) as info:
        prepare_data(data_section(name="imagenet"), tmp_path / "data", seed=0)
    message = one_line(info)
    assert "data.name='imagenet'" in message
    assert "synthetic_wind" in message and "data.target" in message
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------- prepare_data


def test_synthetic_data_is_written_once_and_builds_train_and_val(tmp_path):
    data_dir = tmp_path / "data"
    section = data_section(
        name="synthetic_wind", params={**SMALL, "stride": 2, "season_length": 24}
    )
    ref = prepare_data(section, data_dir, seed=0)
    files = list(data_dir.iterdir())
    assert len(files) == 1 and files[0].suffix == ".parquet"
    assert pq.read_metadata(files[0]).num_rows == 2 * 300
    assert ref.params["path"] == str(files[0])
    assert ref.params["stride"] == 2  # window params reach the windowing
    assert ref.params["season_length"] == 24

    assert prepare_data(section, data_dir, seed=0) == ref  # cached, not regenerated
    assert list(data_dir.iterdir()) == files

    splits = build_data(ref, seed=0)
    assert isinstance(splits, DataSplits)
    assert len(splits.train) > 0 and len(splits.val) > 0
    x, y = splits.train[0]
    assert x.shape == (splits.info["context_length"], len(synthetic_wind.FEATURE_COLUMNS) + 1)
    assert y.shape == (splits.info["horizon"],)


def test_synthetic_data_depends_on_the_seed(tmp_path):
    section = data_section(name="synthetic_wind", params=SMALL)
    assert prepare_data(section, tmp_path, seed=0) != prepare_data(section, tmp_path, seed=1)
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"name": "synthetic_wind", "params": {"num_turbnes": 2}}, "data.params.num_turbnes"),
        ({"name": "synthetic_wind", "params": {"target_column": "x"}}, "data.params.target_column"),
        ({"path": "x.parquet", "params": {"num_turbines": 2}}, "data.params.num_turbines"),
        ({"name": "synthetic_wind", "params": {"missing": "ffill"}}, "data.params.missing"),
    ],
)
def test_unknown_data_params_name_the_key_and_write_nothing(tmp_path, section, key):
    with pytest.raises(BadInputError) as info:
        prepare_data(data_section(**section), tmp_path / "data", seed=0)
    assert key in one_line(info)
    assert not (tmp_path / "data").exists()


def test_user_parquet_path_trains_with_its_columns(tmp_path):
    path = tmp_path / "farm.parquet"
    pq.write_table(synthetic_wind.generate(num_turbines=2, num_hours=300, seed=3), path)
    ref = prepare_data(
        data_section(path=str(tmp_path / "*.parquet"), params=WIND_COLUMNS), tmp_path / "d", 0
    )
    assert ref.config_key == "data.path"
    assert not (tmp_path / "d").exists()  # user data is read in place, not copied
    splits = build_data(ref, seed=0)
    assert len(splits.train) > 0 and len(splits.val) > 0
    assert splits.info["feature_columns"] == WIND_COLUMNS["feature_columns"]
    assert splits.info["num_features"] == len(WIND_COLUMNS["feature_columns"]) + 1


def test_data_path_without_matching_files_is_bad_input(tmp_path):
    # Found out when the driver lists the files (to decide data.streaming: auto).
    with pytest.raises(BadInputError) as info:
        prepare_data(
            data_section(path="/nonexistent/*.parquet", params=WIND_COLUMNS), tmp_path, seed=0
        )
    assert "/nonexistent/*.parquet" in one_line(info)


def test_model_target_that_cannot_be_imported_names_the_key():
    ref = model_factory(model_section(target="nonexistent_pkg.mod:build"))
    with pytest.raises(BadInputError) as info:
        build_model(ref, {})
    assert "model.target" in one_line(info)


# --------------------------------------------------------------------------- user factories


USER_MODULE = "raytrain_test_user_workload"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable user module with factories that keep, and that break, the protocol."""
    (tmp_path / f"{USER_MODULE}.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch.utils.data import TensorDataset

            from raytrain_app import DataSplits, ModelSpec, StepOutput

            def _step(module, batch):
                x, y = batch
                loss = torch.nn.functional.mse_loss(module(x), y)
                return StepOutput(loss=loss, num_samples=len(x))

            def good_model(params, data_info):
                return ModelSpec(torch.nn.Linear(data_info["n"], params["out"]), _step)

            def good_data(params, seed):
                g = torch.Generator().manual_seed(seed)
                x = torch.randn(params["rows"], 3, generator=g)
                ds = TensorDataset(x, torch.zeros(params["rows"], 1))
                return DataSplits(train=ds, val=ds, info={"n": 3})

            def bare_module(params, data_info):
                return torch.nn.Linear(3, 1)

            def tuple_data(params, seed):
                return ([], [])
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    sys.modules.pop(USER_MODULE, None)


def test_user_factories_receive_their_params(user_module):
    splits = build_data(FactoryRef(f"{user_module}:good_data", {"rows": 5}, "data.target"), 0)
    assert len(splits.train) == 5 and dict(splits.info) == {"n": 3}
    spec = build_model(FactoryRef(f"{user_module}:good_model", {"out": 1}), splits.info)
    assert isinstance(spec, ModelSpec)
    assert isinstance(spec.module, nn.Linear) and spec.module.in_features == 3


def test_data_target_is_passed_through_by_prepare_data(user_module, tmp_path):
    section = data_section(target=f"{user_module}:good_data", params={"rows": 4})
    ref = prepare_data(section, tmp_path / "data", seed=0)
    assert ref == FactoryRef(f"{user_module}:good_data", {"rows": 4}, "data.target")
    assert len(build_data(ref, seed=0).train) == 4


def test_model_factory_returning_a_bare_module_is_bad_input(user_module):
    ref = FactoryRef(f"{user_module}:bare_module", {}, "model.target")
    with pytest.raises(BadInputError) as info:
        build_model(ref, {})
    message = one_line(info)
    assert "model.target" in message and "bare_module" in message
    assert "Linear" in message and "ModelSpec" in message


def test_data_factory_returning_a_tuple_is_bad_input(user_module):
    ref = FactoryRef(f"{user_module}:tuple_data", {}, "data.target")
    with pytest.raises(BadInputError) as info:
        build_data(ref, seed=0)
    message = one_line(info)
    assert "data.target" in message and "tuple" in message and "DataSplits" in message
