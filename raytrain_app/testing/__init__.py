"""Helpers for tests and benchmarks of raytrain and of users' own code, as Ray ships
``ray.cluster_utils`` and torch ships ``torch.testing``: free ports, processes found by their
command line, a private HOME and environment, and a private Ray head stopped by PID.

Nothing in the product imports this package.
"""
