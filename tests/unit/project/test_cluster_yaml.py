"""cluster/ray-cluster.yaml passes Ray's own schema and its stricter config preparation."""

from __future__ import annotations

import copy
import json
from importlib import resources

import click
import jsonschema
import pytest
import yaml
from paths import ROOT
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = ROOT / "cluster" / "ray-cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((resources.files("ray") / "autoscaler" / "ray-schema.json").read_text())


def test_matches_the_schema_shipped_with_ray(config, schema):
    jsonschema.validate(config, schema)


def test_passes_rays_own_preparation_and_validation(config):
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    # The local provider turns worker_ips into a fixed-size worker node type.
    assert prepared["provider"]["type"] == "local"
    assert len(prepared["provider"]["worker_ips"]) == 2


def test_starts_ray_with_token_auth_and_installs_the_project(config):
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert config["file_mounts"]["~/.ray/auth_token"]
    setup = " ".join(config["setup_commands"])
    assert setup.index("install --quiet torch") < setup.index("-e ~/raytrain_app")


def test_the_dashboard_binds_to_localhost_unless_the_user_opts_in(config):
    (start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=${RAYTRAIN_DASHBOARD_HOST:-127.0.0.1}" in start.split()
    assert "0.0.0.0" not in start
    # The token reaches the nodes as a file and is never on a command line.
    commands = [*config["setup_commands"], *config["head_start_ray_commands"]]
    commands += config["worker_start_ray_commands"]
    assert not any("RAY_AUTH_TOKEN=" in c or "ray-token" in c for c in commands)


def test_the_validation_catches_a_broken_config(config, schema):
    broken = copy.deepcopy(config)
    broken["provider"].pop("head_ip")
    jsonschema.validate(broken, schema)  # the schema lets a missing head_ip through ...
    with pytest.raises(click.ClickException, match="head_ip"):  # ... Ray's preparation does not
        validate_config(prepare_config(broken))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**config, "not_a_key": 1}, schema)
