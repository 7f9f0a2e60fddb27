"""Which of this shell's variables go with the run: those that reach the stores it names.

Ray Train's workers and controller, Tune's trials, Ray Data's prepare tasks and a submitted
job run where the driver's environment is not (the nodes of a running cluster), yet they
read and write the run's stores. They get the variables those stores need, and only when
the config names such a store: S3's when any value of it is in S3 (``data.cache_dir`` as
much as ``experiment.output_dir``, a factory's ``params`` and a value ``tune.param_space``
sweeps as much as a key's), an MLflow server's when MLflow logs to one.
``storage_env_vars`` decides for every place that sends variables; a store's credentials
never travel with a run that does not use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from raytrain_app.config import RaytrainConfig, config_to_dict, flatten
from raytrain_app.planning.environment import variables_set
from raytrain_app.storage.location import uri_scheme

# The AWS variables that authenticate and locate an S3 store. Never the ones that name files
# or profiles of this machine (AWS_PROFILE, AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE,
# AWS_CA_BUNDLE): on the cluster they name nothing, or override the cluster's own access.
S3_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    # S3-compatible stores (MinIO, Ceph, moto) may not take the AWS SDK's default
    # aws-chunked uploads with trailing checksums; "when_required" turns them off.
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)
# What MLflow's client authenticates to a server with, the URI holding none (config.base);
# never a certificate's path, which names a file of this machine.
MLFLOW_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def store_schemes(cfg: RaytrainConfig) -> dict[str, set[str]]:
    """The URI schemes each value of the config names, by dotted key (``data.params.url``,
    ``tune.param_space.data.path.choice``), for the keys naming any: every path and URI the
    run may reach, whichever key or parameter holds it."""
    found = {}
    for key, value in flatten(config_to_dict(cfg)).items():
        schemes = {uri_scheme(text) for text in _strings(value)} - {None}
        if schemes:
            found[key] = schemes
    return found


def s3_keys(cfg: RaytrainConfig) -> list[str]:
    """The config keys naming a location in S3."""
    return [key for key, schemes in store_schemes(cfg).items() if "s3" in schemes]


def _strings(value: Any) -> Iterator[str]:
    """Every string in a value (``["s3://a", {"b": "/c"}]``), at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def logs_to_mlflow_server(cfg: RaytrainConfig) -> bool:
    """Whether the run logs to an MLflow server (http or https), not a file store."""
    uri = cfg.tracking.mlflow_tracking_uri
    return cfg.tracking.mlflow and uri is not None and uri_scheme(uri) in ("http", "https")


def storage_env_vars(cfg: RaytrainConfig) -> dict[str, str]:
    """The variables set here that the stores ``cfg`` names need, for the run's processes
    on other nodes: S3's when a location is in S3, MLflow's for an MLflow server, nothing
    for a run whose stores are all local paths or shared filesystems."""
    names = [
        *(S3_VARIABLES if s3_keys(cfg) else ()),
        *(MLFLOW_VARIABLES if logs_to_mlflow_server(cfg) else ()),
    ]
    return variables_set(names)
