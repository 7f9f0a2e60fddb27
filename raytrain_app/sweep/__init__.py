"""``raytrain tune``: the Ray Tune layer (driver side) and its YAML search space; each
trial runs the worker loop itself on one device."""
