"""Finding the raylet of an embedded Ray as soon as it has registered with the GCS.

``ray.init()`` returns once the raylet it started has registered. Ray's lookup
(``ray._private.services.get_node``, Ray's C++ ``GlobalStateAccessor::GetNode`` in Ray 2.58
to 2.60) asks the GCS, then sleeps a fixed second before asking again. The raylet registers
only once its dashboard agent serves, 1.1-1.6 s after it starts, so ``ray.init()`` returned
up to a second after that. On a quiet machine Ray's start was the longer of the two things
a cold run waits for before its controller starts (the other is the driver's imports;
benchmarks/README.md, "First step"). ``after_registration`` waits for
the registration in steps of 20 ms first, so that Ray's lookup finds the node on its first
try. ``driver.embedded_ray`` puts it in place of Ray's lookup while an embedded Ray starts.
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.02
# After this long Ray's own lookup takes over: a raylet that never registers fails as it
# did, this much later.
WAIT_LIMIT_S = 10.0


def after_registration(ray_lookup: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
    """Ray's ``get_node(gcs_address, node_id)``, called once the node has registered (or
    ``WAIT_LIMIT_S`` has passed, or the GCS could not be asked: Ray's lookup then reports
    what it finds, as it would have)."""

    @functools.wraps(ray_lookup)
    def lookup_once_registered(gcs_address: str, node_id: str) -> Any:
        wait_until_registered(gcs_address, node_id)
        return ray_lookup(gcs_address, node_id)

    return lookup_once_registered


def wait_until_registered(
    gcs_address: str,
    node_id: str,
    poll_s: float = POLL_S,
    limit_s: float = WAIT_LIMIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Ask the GCS at ``gcs_address`` every ``poll_s`` whether node ``node_id`` (hex) is
    alive; whether it was within ``limit_s``."""
    gcs = _gcs_state(gcs_address)
    if gcs is None:
        return False
    deadline = clock() + limit_s
    try:
        while True:
            if _alive(gcs, node_id):
                return True
            if clock() >= deadline:
                return False
            sleep(poll_s)
    except Exception as error:  # any failure: Ray's own lookup then reports what it finds
        logger.debug("asking the GCS for the raylet failed (%s); Ray's lookup goes on", error)
        return False
    finally:
        gcs.disconnect()


def _gcs_state(gcs_address: str) -> Any:
    """Ray's reader of the GCS's tables (Ray 2.58-2.60 have it), for ``gcs_address``; None
    where this Ray has none."""
    try:
        state = importlib.import_module("ray._private.state")
        services = importlib.import_module("ray._private.services")
        gcs = state.GlobalState()
        gcs._initialize_global_state(services._get_gcs_client_options(gcs_address))
    except (ImportError, AttributeError, TypeError) as error:
        logger.debug("this Ray's GCS tables cannot be read here (%s)", error)
        return None
    return gcs


def _alive(gcs: Any, node_id: str) -> bool:
    return any(node.get("NodeID") == node_id and node.get("Alive") for node in gcs.node_table())
