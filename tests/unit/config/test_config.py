"""Unit tests for raytrain_app.config: schema defaults, YAML, overrides and error messages."""

from pathlib import Path

import pytest
import yaml

from raytrain_app.config import (
    ConfigError,
    RaytrainConfig,
    config_from_dict,
    config_to_dict,
    diff_configs,
    dump_config_yaml,
    flatten,
    load_config,
    save_config,
)


def config_error(data=None, overrides=()) -> str:
    """The message of the ConfigError raised for ``data`` plus ``overrides``."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(data or {}, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def file_error(path) -> str:
    """The message of the ConfigError raised when loading ``path``."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- defaults


def test_defaults():
    cfg = RaytrainConfig()
    assert cfg.experiment.name == "quickstart"
    assert cfg.model.name == "wind_transformer" and cfg.model.target is None
    assert cfg.data.name == "synthetic_wind" and cfg.data.path is None
    assert cfg.train.global_batch_size == 64
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.train.grad_clip == 1.0
    assert cfg.scaling.num_workers == "auto"
    assert cfg.precision == "auto"
    assert cfg.fault_tolerance.max_failures == 3
    assert cfg.tune.scheduler == "asha"


def test_every_field_has_a_description():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation)

    walk(RaytrainConfig)


def test_quickstart_only_overrides_num_workers_and_window_stride():
    cfg = load_config()
    assert cfg.experiment.name == "quickstart"
    assert cfg.scaling.num_workers == 2
    assert diff_configs(cfg, RaytrainConfig()) == ["data.params.stride", "scaling.num_workers"]


def test_empty_mapping_gives_defaults_but_an_empty_file_is_refused(tmp_path):
    assert config_from_dict({}) == RaytrainConfig()
    assert load_config(write(tmp_path, "{}")) == RaytrainConfig()
    # an empty file is more likely the wrong file or a cut-short write than a wish for defaults
    for text in ("", "# only a comment\n"):
        message = file_error(write(tmp_path, text))
        assert "is empty" in message and "--config" in message


def test_config_from_dict_does_not_mutate_input():
    data = {"model": {"params": {"a": 1}}}
    config_from_dict(data, ["model.params.b=2"])
    assert data == {"model": {"params": {"a": 1}}}


# --------------------------------------------------------------------------- YAML and round trip


def test_yaml_file_loading(tmp_path):
    path = write(
        tmp_path,
        "experiment: {name: my-run_1.0}\n"
        "train:\n  lr: 3e-4\n  epochs: 2\n  grad_clip: null\n"
        "scaling: {num_workers: 4, use_gpu: false}\n"
        "precision: bf16\n",
    )
    cfg = load_config(path)
    assert cfg.experiment.name == "my-run_1.0"
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.epochs == 2
    assert cfg.train.grad_clip is None
    assert cfg.scaling.num_workers == 4 and cfg.scaling.use_gpu is False
    assert cfg.precision == "bf16"


def test_float_fields_accept_ints():
    cfg = config_from_dict({"train": {"lr": 1}, "scaling": {"cpus_per_worker": 2}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.scaling.cpus_per_worker == 2.0


def test_round_trip(tmp_path):
    cfg = config_from_dict(
        {
            "experiment": {"name": "roundtrip", "seed": 7},
            "model": {
                "target": "my_pkg.models:build",
                "params": {"d": 64, "s": "3e-4", "t": "yes"},
            },
            "data": {"path": "data/*.parquet"},
            "train": {"lr": 1e-5, "grad_clip": None},
            "tune": {"param_space": {"train.lr": {"loguniform": [1e-5, 1e-2]}}},
        }
    )
    path = save_config(cfg, tmp_path / "nested" / "config.yaml")
    assert path.exists()
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.model.params["s"] == "3e-4"  # strings that look like floats stay strings
    assert yaml.safe_load(dump_config_yaml(cfg)) is not None
    assert load_config(save_config(RaytrainConfig(), tmp_path / "d.yaml")) == RaytrainConfig()


def test_dump_keeps_section_order():
    text = dump_config_yaml(RaytrainConfig())
    top = [line.split(":")[0] for line in text.splitlines() if not line.startswith(" ")]
    assert top == list(RaytrainConfig.model_fields)
    assert list(config_to_dict(RaytrainConfig())) == list(RaytrainConfig.model_fields)


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("override", "section", "key", "expected"),
    [
        ("train.epochs=3", "train", "epochs", 3),
        ("train.lr=3e-4", "train", "lr", 3e-4),
        ("train.lr=0.01", "train", "lr", 0.01),
        ("train.grad_clip=null", "train", "grad_clip", None),
        ("train.max_batch_per_worker=16", "train", "max_batch_per_worker", 16),
        ("scaling.use_gpu=false", "scaling", "use_gpu", False),
        ("scaling.num_workers=auto", "scaling", "num_workers", "auto"),
        ("scaling.num_workers=4", "scaling", "num_workers", 4),
        ("distributed.find_unused_parameters=true", "distributed", "find_unused_parameters", True),
        ("experiment.name=sweep-1", "experiment", "name", "sweep-1"),
        ("fault_tolerance.max_failures=-1", "fault_tolerance", "max_failures", -1),
    ],
)
def test_override_values(override, section, key, expected):
    value = getattr(getattr(load_config(overrides=[override]), section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_override_top_level_scalar_and_later_wins():
    cfg = load_config(overrides=["precision=fp16", "train.epochs=2", "train.epochs=9"])
    assert cfg.precision == "fp16"
    assert cfg.train.epochs == 9


def test_override_creates_nested_params():
    cfg = load_config(overrides=["model.params.d_model=64", "model.params.block.heads=4"])
    assert cfg.model.params == {"d_model": 64, "block": {"heads": 4}}


def test_override_target_replaces_name_from_file():
    # the quickstart names model.name explicitly; --set target must still switch sources
    cfg = load_config(overrides=["model.target=my_pkg.models:build"])
    assert cfg.model.name is None and cfg.model.target == "my_pkg.models:build"


def test_override_glob_path_is_a_string():
    cfg = load_config(overrides=["data.path=*.parquet"])
    assert cfg.data.path == "*.parquet" and cfg.data.name is None


def test_override_whole_section_mapping():
    cfg = load_config(overrides=["model={target: 'my_pkg.models:build', params: {d: 8}}"])
    assert cfg.model.target == "my_pkg.models:build" and cfg.model.params == {"d": 8}
    message = config_error({}, ["train={lrr: 1}"])
    assert "unknown config key 'train.lrr' (did you mean 'train.lr'?)" in message
    assert "--set train={lrr: 1}" in message


def test_single_string_override_is_one_override():
    assert config_from_dict({}, "train.epochs=2").train.epochs == 2


# --------------------------------------------------------------------------- sources


def test_target_alone_drops_default_name(tmp_path):
    cfg = load_config(write(tmp_path, 'model: {target: "my_pkg.models:build"}\n'))
    assert cfg.model.name is None and cfg.model.target == "my_pkg.models:build"


def test_data_path_alone_ok():
    cfg = config_from_dict({"data": {"path": "data/*.parquet"}})
    assert cfg.data.name is None and cfg.data.path == "data/*.parquet"


def test_assigning_target_drops_default_name():
    cfg = RaytrainConfig()
    cfg.model.target = "my_pkg.models:build"
    assert cfg.model.name is None


def test_model_name_and_target_together_is_an_error():
    message = config_error({"model": {"name": "wind_transformer", "target": "a.b:c"}})
    assert "'model'" in message and "name" in message and "target" in message
    assert "keep exactly one" in message


def test_no_source_is_an_error():
    message = config_error({"data": {"name": None}})
    assert "'data'" in message and "name, path, target" in message


def test_bad_target_form():
    message = config_error({}, ["model.target=not-a-target"])
    assert "'model.target'" in message and "package.module:attribute" in message


def test_unsafe_experiment_name():
    message = config_error({"experiment": {"name": "../elsewhere"}})
    assert "'experiment.name'" in message and "'../elsewhere'" in message


# --------------------------------------------------------------------------- unknown keys


def test_unknown_section_key_suggests():
    message = config_error({"train": {"lrr": 0.1}})
    assert message == "unknown config key 'train.lrr' (did you mean 'train.lr'?)"


def test_unknown_top_level_key_suggests_section():
    assert "unknown config key 'trian' (did you mean 'train'?)" in config_error({"trian": {}})


def test_key_in_wrong_section_suggests_its_home():
    assert "did you mean 'train.lr'?" in config_error({"lr": 0.1})


def test_unknown_key_without_close_match_lists_valid_keys():
    message = config_error({"fault_tolerance": {"zzz": 1}})
    assert "'fault_tolerance.zzz'" in message and "max_failures" in message


def test_unknown_key_via_set_names_the_flag():
    message = config_error({}, ["train.lrr=0.1"])
    assert "unknown config key 'train.lrr' (did you mean 'train.lr'?)" in message
    assert "--set train.lrr=0.1" in message


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "scaling:\n  num_worker: 2\n")
    message = file_error(path)
    assert "unknown config key 'scaling.num_worker'" in message
    assert "'scaling.num_workers'" in message and str(path) in message


def test_keys_inside_params_are_free_form():
    cfg = config_from_dict({"model": {"params": {"anything": {"goes": 1}}}})
    assert cfg.model.params["anything"]["goes"] == 1


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("data", "overrides", "expected"),
    [
        (
            {"train": {"global_batch_size": -3}},
            (),
            "invalid value for 'train.global_batch_size': -3 (must be an integer >= 1 and "
            "<= 1000000000)",
        ),
        (
            {"train": {"global_batch_size": 64.5}},
            (),
            "invalid value for 'train.global_batch_size': 64.5 (must be an integer >= 1 and "
            "<= 1000000000)",
        ),
        (
            {"precision": "fp8"},
            (),
            "invalid value for 'precision': 'fp8' (allowed: auto, fp32, bf16, fp16)",
        ),
        (
            {"train": {"min_lr_ratio": 1.0}},
            (),
            "invalid value for 'train.min_lr_ratio': 1.0 (must be a number >= 0 and < 1)",
        ),
        (
            {"train": {"grad_clip": 0}},
            (),
            "invalid value for 'train.grad_clip': 0 (must be a number > 0 or null)",
        ),
        (
            {"scaling": {"use_gpu": "maybe"}},
            (),
            "invalid value for 'scaling.use_gpu': 'maybe' (allowed: auto, true, false)",
        ),
        (
            {"distributed": {"find_unused_parameters": "no"}},
            (),
            "invalid value for 'distributed.find_unused_parameters': 'no' (allowed: true, false)",
        ),
        (
            {"train": {"epochs": "5"}},
            (),
            "invalid value for 'train.epochs': '5' (must be an integer >= 1)",
        ),
        (
            {"train": {"lr": True}},
            (),
            "invalid value for 'train.lr': true (must be a number > 0)",
        ),
    ],
)
def test_bad_values(data, overrides, expected):
    assert config_error(data, overrides) == expected


def test_bad_value_via_set_names_the_flag():
    message = config_error({}, ["scaling.num_workers=0"])
    assert message == (
        "invalid value for 'scaling.num_workers': 0 (must be auto, an integer >= 1 and <= 100000 "
        "or [min, max] of integers >= 1 and <= 100000), "
        "from --set scaling.num_workers=0"
    )


def test_bad_value_in_file_names_the_file(tmp_path):
    path = write(tmp_path, "tune: {mode: maximize}\n")
    message = file_error(path)
    assert "invalid value for 'tune.mode': 'maximize' (allowed: min, max)" in message
    assert str(path) in message


def test_section_that_is_not_a_mapping():
    message = config_error({"train": 5})
    assert "invalid value for 'train': 5" in message and "global_batch_size" in message


# --------------------------------------------------------------------------- file and flag errors


def test_missing_file(tmp_path):
    message = file_error(tmp_path / "nope.yaml")
    assert message.startswith("config file '") and "nope.yaml' not found" in message
    assert "--config" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\n  epochs: [1\n")
    message = file_error(path)
    assert str(path) in message and "not valid YAML" in message and "line " in message


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.1\ntrain:\n  epochs: 2\n")
    message = file_error(path)
    assert "duplicate key 'train'" in message and "line 3" in message


def test_non_mapping_yaml(tmp_path):
    message = file_error(write(tmp_path, "- train\n- lr\n"))
    assert "must contain a mapping" in message and "not a list" in message


def test_set_without_equals():
    message = config_error({}, ["train.lr"])
    assert "--set train.lr" in message and "KEY=VALUE" in message


def test_set_with_empty_key_part():
    assert "'train..lr'" in config_error({}, ["train..lr=1"])


def test_set_under_a_scalar_is_an_error():
    message = config_error({}, ["train.lr.value=1"])
    assert "'train.lr.value'" in message and "'train.lr' is a single value" in message


def test_set_under_a_scalar_inside_params_is_an_error():
    message = config_error({"model": {"params": {"a": 5}}}, ["model.params.a.b=1"])
    assert "'model.params.a'" in message and "not a mapping" in message


# --------------------------------------------------------------------------- hostile input

# Nine lines whose every alias stands for ten of the line above: 10**10 values in 647 bytes.
ALIAS_BOMB = (
    "model:\n  params:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + ("".join(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)))
)


@pytest.mark.timeout(20)
def test_an_alias_bomb_is_refused_at_once_naming_the_file(tmp_path):
    # loaded before, as 10**10 shared values that the first dump of the config would build
    path = write(tmp_path, ALIAS_BOMB)
    assert path.stat().st_size < 1000
    message = file_error(path)
    assert message.startswith(f"config file '{path}' is too large to load: it expands to more")
    assert "nest fewer &anchors/*aliases" in message


@pytest.mark.timeout(20)
def test_an_alias_bomb_in_a_set_value_is_refused_naming_the_flag():
    flow = ALIAS_BOMB.split("params:\n", 1)[1].replace("\n    ", ", ").strip()
    item = f"model.params={{{flow.removeprefix('    ')}}}"
    message = config_error({}, [item])
    assert message.startswith(f"--set {item} is too large to load")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model:\n  params: &a {x: *a}\n", "a *alias refers to a value that contains it"),
        (f"model:\n  params: {{x: {'[' * 150}{']' * 150}}}\n", "more than 100 levels deep"),
        (f"model:\n  params: {{x: {'[' * 5000}{']' * 5000}}}\n", "more than 100 levels deep"),
        ("train: {lr: 0.1}\n" + "#" * (1 << 20), "more than 1048576 bytes"),
    ],
    ids=["recursive_alias", "deep", "deeper_than_python_recursion", "oversized"],
)
def test_hostile_yaml_is_a_one_line_error_naming_the_file(tmp_path, text, expected):
    path = write(tmp_path, text)
    message = file_error(path)
    assert message.startswith(f"config file '{path}' is too large to load") and expected in message


def test_plain_anchors_and_merge_keys_still_load(tmp_path):
    text = "model:\n  params:\n    base: &b {width: 8, depth: 2}\n    wide: {<<: *b, width: 16}\n"
    params = load_config(write(tmp_path, text)).model.params
    assert params == {"base": {"width": 8, "depth": 2}, "wide": {"width": 16, "depth": 2}}


@pytest.mark.parametrize(
    "key",
    [
        "train.lr",
        "train.weight_decay",
        "train.grad_clip",
        "train.ema.decay",
        "scaling.cpus_per_worker",
        "scaling.gpus_per_worker",
        "scaling.elastic_resize_interval_s",
        "tune.reduction_factor",
    ],
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400"])
def test_a_non_finite_number_is_refused_naming_the_key(key, value):
    # .inf passed every "> 0" bound before, and train.lr=.inf planned a run
    message = config_error({}, [f"{key}={value}"])
    shown = ".inf" if value == "1e400" else value
    assert message.startswith(f"invalid value for '{key}': {shown} (must be a finite number")
    assert message.endswith(f"from --set {key}={value}")


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("item", "shown", "allowed"),
    [
        (
            "train.global_batch_size=1000000000000000000000",
            "1000000000000000000000",
            "<= 1000000000",
        ),
        ("train.global_batch_size=1e21", "1e+21", "an integer >= 1 and <= 1000000000"),
        ("train.max_batch_per_worker=10000000000", "10000000000", "<= 1000000000"),
        ("train.base_batch_size=10000000000", "10000000000", "<= 1000000000"),
        ("scaling.num_workers=[1, 10000000000]", "[1, 10000000000]", "integers >= 1 and <= 100000"),
    ],
)
def test_batch_and_worker_counts_are_bounded(item, shown, allowed):
    # a batch of 10**21 was valid and hung the plan's divisor search
    key = item.split("=")[0]
    message = config_error({}, [item])
    assert message.startswith(f"invalid value for '{key}': {shown} (") and allowed in message


@pytest.mark.parametrize(
    ("key", "uri", "redacted", "variable"),
    [
        (
            "experiment.output_dir",
            "s3://AKIAEXAMPLE:hunter2zz@bucket/runs",
            "s3://***@bucket/runs",
            "AWS_SECRET_ACCESS_KEY",
        ),
        (
            "data.path",
            "s3://AKIAEXAMPLE:hunter2/zz+x@bucket/d.parquet",
            "s3://***@bucket/d.parquet",
            "AWS_SECRET_ACCESS_KEY",
        ),
        (
            "data.cache_dir",
            "gs://token@bucket/cache",
            "gs://***@bucket/cache",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ),
        # issue 37: written verbatim into config.yaml and every checkpoint's meta.json
        (
            "tracking.mlflow_tracking_uri",
            "https://me:hunter2@mlflow.example:5000",
            "https://***@mlflow.example:5000",
            "MLFLOW_TRACKING_PASSWORD",
        ),
        (
            "tracking.mlflow_tracking_uri",
            "https://token@mlflow.example",
            "https://***@mlflow.example",
            "MLFLOW_TRACKING_TOKEN",
        ),
        (
            "tracking.mlflow_tracking_uri",
            "postgresql+psycopg2://me:hunter2@db.example/mlflow",
            "postgresql+psycopg2://***@db.example/mlflow",
            "PGPASSWORD",
        ),
    ],
)
def test_a_uri_with_credentials_is_refused_without_showing_them(key, uri, redacted, variable):
    for message in (config_error({}, [f"{key}={uri}"]), config_error(_nested(key, uri))):
        assert message.startswith(f"invalid value for '{key}': '{redacted}' (the URI carries")
        assert variable in message and "in the environment instead)" in message
        assert "hunter2" not in message and "AKIAEXAMPLE" not in message and "token" not in message


def _nested(key: str, value: str) -> dict:
    section, name = key.split(".")
    return {section: {name: value}}


def test_uris_without_credentials_are_kept():
    cfg = config_from_dict(
        {}, ["experiment.output_dir=s3://bucket/runs/a@b", "data.path=x.parquet"]
    )
    assert (cfg.experiment.output_dir, cfg.data.path) == ("s3://bucket/runs/a@b", "x.parquet")


# --------------------------------------------------------------------------- diff and flatten


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": {}, "f": [1]}) == {
        "a.b": 1,
        "a.c.d": 2,
        "e": {},
        "f": [1],
    }
    assert flatten({"lr": 1}, prefix="train") == {"train.lr": 1}


def test_diff_configs_equal():
    quickstart = load_config(overrides=["scaling.num_workers=auto", "data.params={}"])
    assert diff_configs(RaytrainConfig(), quickstart) == []


def test_diff_configs_reports_changed_keys_sorted():
    a = RaytrainConfig()
    b = config_from_dict({"train": {"lr": 0.01, "epochs": 9}, "model": {"params": {"d": 1}}})
    assert diff_configs(a, b) == ["model.params.d", "train.epochs", "train.lr"]


def test_diff_configs_ignore_prefixes():
    a = RaytrainConfig()
    b = config_from_dict({"train": {"epochs": 9}, "scaling": {"num_workers": 4}})
    assert diff_configs(a, b, ignore=["train.epochs"]) == ["scaling.num_workers"]
    assert diff_configs(a, b, ignore=["scaling", "train"]) == []
    # a prefix matches whole key parts only
    assert diff_configs(a, b, ignore=["train.epoch"]) == ["scaling.num_workers", "train.epochs"]
