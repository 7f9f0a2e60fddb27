"""Built-in synthetic wind-power dataset: generated once on the driver and cached as Parquet.

Each turbine's wind speed is a regional weather signal shared by all turbines, plus a
turbine-local signal, a diurnal cycle and a per-turbine mean offset. Both weather signals
are smooth over several days, so power a few hours ahead is predictable from the past two
days of features; power comes from a standard cut-in / rated / cut-out power curve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_app.errors import BadInputError
from raytrain_app.storage.location import temporary_file

logger = logging.getLogger(__name__)

FEATURE_COLUMNS = (
    "wind_speed",
    "wind_dir_sin",
    "wind_dir_cos",
    "temperature",
    "hour_sin",
    "hour_cos",
)
TARGET_COLUMN = "power"
GROUP_COLUMN = "turbine_id"
TIME_COLUMN = "timestamp"

# Keys of ``data.params`` that go to the generator; the rest go to the windowing.
GENERATOR_PARAMS = ("num_turbines", "num_hours")

CUT_IN_SPEED = 3.0
RATED_SPEED = 12.0
CUT_OUT_SPEED = 25.0

# Part of the cache key: bump it whenever the generated values change, so old caches are not reused.
_GENERATOR_VERSION = 1
_START = np.datetime64("2024-01-01T00:00:00", "s")
_AR_PHI = 0.97
_NOISE_STD = 0.02


def power_curve(wind_speed: np.ndarray) -> np.ndarray:
    """Fraction of rated power (0..1) of an idealised turbine at the given wind speeds (m/s)."""
    v = np.asarray(wind_speed, dtype=np.float64)
    # Cubic in speed between cut-in and rated, as the kinetic power of the wind is.
    ramp = (v**3 - CUT_IN_SPEED**3) / (RATED_SPEED**3 - CUT_IN_SPEED**3)
    power = np.where(v < RATED_SPEED, ramp, 1.0)
    return np.where((v < CUT_IN_SPEED) | (v > CUT_OUT_SPEED), 0.0, power)


def _smooth_noise(rng: np.random.Generator, num_series: int, num_hours: int) -> np.ndarray:
    """Unit-variance smooth noise of shape ``[num_series, num_hours]``.

    White noise filtered twice by an AR(1) with ``phi = 0.97``: multi-day correlation with
    a smoother path than a single AR(1), which makes the near future predictable.
    """
    # Impulse response of two AR(1) filters in series: (k + 1) * phi**k, truncated where negligible.
    kernel_len = int(np.ceil(np.log(1e-6) / np.log(_AR_PHI))) * 2
    k = np.arange(kernel_len)
    kernel = (k + 1) * _AR_PHI**k
    kernel /= np.linalg.norm(kernel)
    # The noise starts kernel_len hours early so that hour 0 is already stationary.
    noise = rng.standard_normal((num_series, num_hours + kernel_len))
    n_fft = noise.shape[1] + kernel_len
    filtered = np.fft.irfft(np.fft.rfft(noise, n_fft) * np.fft.rfft(kernel, n_fft), n_fft)
    return filtered[:, kernel_len : kernel_len + num_hours]


def _weather(
    rng: np.random.Generator, num_turbines: int, num_hours: int, hours: np.ndarray
) -> dict[str, np.ndarray]:
    """Wind speed, direction and temperature, each ``[num_turbines, num_hours]`` float64."""
    regional = _smooth_noise(rng, 3, num_hours)  # speed, direction, temperature
    local = _smooth_noise(rng, 3 * num_turbines, num_hours).reshape(3, num_turbines, num_hours)
    hour_of_day = hours % 24
    day = hours / 24.0

    mean_speed = 7.5 + rng.normal(0.0, 0.8, size=(num_turbines, 1))
    # Afternoon maximum, as daytime mixing brings faster air down to hub height.
    diurnal = 1.2 * np.sin(2 * np.pi * (hour_of_day - 9) / 24)
    raw_speed = mean_speed + 3.5 * regional[0] + 1.5 * local[0] + diurnal
    # Softplus keeps speed non-negative while staying linear (so smooth) at normal speeds.
    wind_speed = np.logaddexp(0.0, raw_speed)

    prevailing = np.deg2rad(240.0 + rng.normal(0.0, 10.0, size=(num_turbines, 1)))
    wind_dir = prevailing + np.deg2rad(70.0) * regional[1] + np.deg2rad(20.0) * local[1]

    seasonal = -10.0 * np.cos(2 * np.pi * (day - 15) / 365.25)
    temp_diurnal = 4.0 * np.sin(2 * np.pi * (hour_of_day - 9) / 24)
    temperature = 10.0 + seasonal + temp_diurnal + 3.0 * regional[2] + 0.5 * local[2]
    return {"wind_speed": wind_speed, "wind_dir": wind_dir, "temperature": temperature}


def generate(num_turbines: int = 8, num_hours: int = 8760, seed: int = 0) -> pa.Table:
    """Generate the synthetic wind-power table; deterministic for the arguments.

    Returns:
        One row per (turbine, hour), sorted by turbine then time, with ``turbine_id``,
        ``timestamp`` (hourly from 2024-01-01), ``FEATURE_COLUMNS`` and ``power``.
    """
    if num_turbines < 1 or num_hours < 1:
        raise BadInputError(
            f"data.params.num_turbines and data.params.num_hours must be >= 1, "
            f"got {num_turbines} and {num_hours}."
        )
    rng = np.random.default_rng(seed)
    hours = np.arange(num_hours, dtype=np.float64)
    weather = _weather(rng, num_turbines, num_hours, hours)
    power = power_curve(weather["wind_speed"])
    power = np.clip(power + rng.normal(0.0, _NOISE_STD, size=power.shape), 0.0, 1.0)

    hour_angle = 2 * np.pi * (hours % 24) / 24
    shape = (num_turbines, num_hours)
    values = {
        "wind_speed": weather["wind_speed"],
        "wind_dir_sin": np.sin(weather["wind_dir"]),
        "wind_dir_cos": np.cos(weather["wind_dir"]),
        "temperature": weather["temperature"],
        "hour_sin": np.broadcast_to(np.sin(hour_angle), shape),
        "hour_cos": np.broadcast_to(np.cos(hour_angle), shape),
        TARGET_COLUMN: power,
    }
    times = _START + np.arange(num_hours).astype("timedelta64[h]").astype("timedelta64[s]")
    arrays = {
        GROUP_COLUMN: pa.array(np.repeat(np.arange(num_turbines, dtype=np.int32), num_hours)),
        TIME_COLUMN: pa.array(np.tile(times, num_turbines), pa.timestamp("s")),
    }
    for name, column in values.items():
        arrays[name] = pa.array(np.ascontiguousarray(column, dtype=np.float32).reshape(-1))
    return pa.table(arrays)


def _digest(num_turbines: int, num_hours: int, seed: int) -> str:
    """Short stable hash of the generator arguments, used in the cache file name."""
    key = {
        "version": _GENERATOR_VERSION,
        "num_turbines": int(num_turbines),
        "num_hours": int(num_hours),
        "seed": int(seed),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def materialize(cache_dir: Path, *, num_turbines: int, num_hours: int, seed: int) -> Path:
    """Write the generated table to a Parquet file in ``cache_dir`` once, and return its path.

    The file name carries a hash of the arguments, so different arguments never share a
    file and the same arguments are generated only once. The write is atomic (temporary
    file, then rename), so concurrent callers and crashes never leave a partial file.
    Parquet has no seconds unit, so ``timestamp`` reads back as ``timestamp("ms")``.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / f"synthetic_wind-{_digest(num_turbines, num_hours, seed)}.parquet"
    if target.exists():
        return target
    table = generate(num_turbines=num_turbines, num_hours=num_hours, seed=seed)
    fd, tmp = temporary_file(target)  # readable by whoever shares the cache, as the umask says
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info("Generated synthetic wind data (%d rows) at %s", table.num_rows, target)
    return target
