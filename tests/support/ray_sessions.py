"""One Ray instance for a test session: its own temp dir and ports, the test workloads
importable in its workers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator

import ray
from paths import EXAMPLES, TEST_WORKLOADS

from raytrain_app.driver.embedded_ray import make_token_private_before_start
from raytrain_app.planning.environment import apply_ray_train_defaults
from raytrain_app.testing.isolation import ray_temp_dir
from raytrain_app.testing.ports import free_ports


@contextlib.contextmanager
def session_ray(num_cpus: int, num_gpus: int | None = None) -> Iterator[dict]:
    """``ray.init`` as raytrain's embedded Ray; yields the cluster's resources."""
    temp_dir = ray_temp_dir()
    apply_ray_train_defaults(embedded=True)  # a one-machine Ray, as raytrain's embedded one
    # Workers inherit the environment of the process that starts Ray: this is how the
    # examples/ user package becomes importable in them, as PYTHONPATH=examples does for users.
    saved_pythonpath = os.environ.get("PYTHONPATH")
    paths = [str(EXAMPLES), str(TEST_WORKLOADS)]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, saved_pythonpath]))
    # Ray's own ports are 0 (the OS picks free ones); the dashboard (the State API some
    # tests query) and the Prometheus endpoint (``MetricsScrape``) get free ports too, so
    # parallel sessions never collide.
    dashboard_port, metrics_port = free_ports(2)
    # Its token file 0600, as the embedded Ray makes it. Ray's own would be 0644 in the
    # session's HOME, and every later embedded start in this process would warn about it:
    # a second line on stderr, which failed test_cli's one-line plan errors in a CI run
    # where they came after the distributed tier on the same xdist worker.
    make_token_private_before_start()
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        dashboard_port=dashboard_port,
        _metrics_export_port=metrics_port,
        # Workers export their metrics every second instead of every 10: a short test run
        # shows up on the endpoint while it trains.
        _system_config={"metrics_report_interval_ms": 1000},
        _temp_dir=temp_dir,
        logging_level="WARNING",
    )
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_pythonpath


# A sample line of Prometheus' text format: name{labels} value.
_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class MetricsScrape(threading.Thread):
    """Polls the session Ray's Prometheus endpoint while a run trains: every sample seen
    whose name starts with ``prefix``, as (name, labels, value)."""

    def __init__(self, prefix: str = "ray_raytrain_", interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        port = ray._private.worker._global_node.metrics_export_port
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.prefix, self.interval_s = prefix, interval_s
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                text = urllib.request.urlopen(self.url, timeout=5).read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                found = _SAMPLE.match(line) if line.startswith(self.prefix) else None
                if found:
                    name, labels, value = found.groups()
                    self.samples.append((name, dict(_LABEL.findall(labels)), float(value)))

    def __enter__(self) -> MetricsScrape:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join()
