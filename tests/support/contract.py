"""What design.md promises users, in one place for the tests that check it."""

from __future__ import annotations

# `raytrain plan --json` has at least these keys.
PLAN_JSON_KEYS = {
    "world_size",
    "per_worker_batch_size",
    "grad_accum_steps",
    "max_batch_per_worker",
    "effective_batch_size",
    "precision",
    "backend",
    "strategy",
    "lr",
}
