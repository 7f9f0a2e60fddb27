"""What ``raytrain_app.train`` and ``raytrain_app.tune`` do before they import the driver's
modules (torch, Ray Train or Tune: 3 s of imports): where the run would start an embedded
Ray, it refuses a run directory another run writes and a ``model.target`` /
``data.target`` module that is not on the path, then begins that Ray's start beside the
imports and checks that follow (``ray_connection.embedded_ray_beside``). It imports
neither torch nor Ray Train.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from raytrain_app.config import RaytrainConfig
from raytrain_app.driver.ray_connection import embedded_ray_beside, ray_would_start_here
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.driver.run_lease import refuse_if_held
from raytrain_app.factory_targets import locate_targets


@contextmanager
def run_begun(
    cfg: RaytrainConfig, address: str | None, local: bool, command: str = "train"
) -> Iterator[None]:
    """The body (the driver's ``train``, or ``tune``'s sweep: ``command``) runs beside the
    start of the Ray it will use, where one starts here; a run directory another run
    writes and a factory module that is not on the path are refused first, before a Ray
    starts for nothing (``Launch.checked`` refuses them too, wherever Ray runs)."""
    if ray_would_start_here(address, local):
        refuse_if_held(RunDirectory.for_config(cfg).location.uri, command)
        locate_targets(cfg.model, cfg.data)
    with embedded_ray_beside(address, local):
        yield
