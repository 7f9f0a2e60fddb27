"""No credential reaches a file: the config is written to config.yaml, every checkpoint's
meta.json, summary.json's neighbours, Tune's best config and a job's entrypoint, so no key
of it may hold a URI with credentials (one rule, ``config.base.refuse_credentials``, for
every key; the message names the variables that take them instead: test_config.py)."""

from __future__ import annotations

import pytest

from raytrain_app.config import ConfigError, config_from_dict
from raytrain_app.config.keys import _schema_paths

SECRET = "hunter2"
URI = f"https://me:{SECRET}@host.example/x"


def _nested(key: str, value: object) -> dict:
    """``{"a": {"b": value}}`` for the dotted key ``a.b``."""
    data: object = value
    for part in reversed(key.split(".")):
        data = {part: data}
    return data


@pytest.mark.parametrize(
    "value",
    [URI, [URI], {"url": URI}, {"choice": ["/a", {"nested": URI}]}],
    ids=["uri", "in_a_list", "in_a_mapping", "deeper"],
)
def test_no_key_of_the_config_takes_a_uri_with_credentials(value):
    # before: tracking.mlflow_tracking_uri, wandb_project, every params and param_space
    # took one, and config.yaml and meta.json kept it verbatim
    taken, shown = [], []
    for key in _schema_paths():
        try:
            config_from_dict(_nested(key, value))
            taken.append(key)
        except ConfigError as refused:
            if SECRET in str(refused):
                shown.append(key)
    assert (taken, shown) == ([], [])


def test_the_message_names_the_key_inside_a_mapping_and_where_the_credentials_go():
    with pytest.raises(ConfigError) as refused:
        config_from_dict({}, ['data.params={source: {url: "s3://KEY:hunter2@bucket/x"}}'])
    message = str(refused.value)
    assert message.startswith("invalid value for 'data.params'")
    assert "['source']['url'] = 's3://***@bucket/x'" in message
    assert "AWS_SECRET_ACCESS_KEY in the environment instead" in message
    assert SECRET not in message and "\n" not in message


def test_a_uri_without_credentials_in_a_mapping_is_kept():
    params = {"url": "https://host.example/data@2024", "path": "s3://bucket/a@b"}
    assert config_from_dict({"data": {"params": params}}).data.params == params
