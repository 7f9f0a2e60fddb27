"""raytrain's worker loop without Ray: the same ``WorkerLoop`` on a process group torchrun made.

    torchrun --standalone --nproc_per_node=2 benchmarks/torchrun_loop.py --config JSON

The DDP parity breakdown runs it between raytrain on Ray and the plain DDP script
(``torchrun_ddp.py``): raytrain-on-Ray / this = what Ray's runtime costs (its processes,
polls and scheduling), this / plain = what raytrain's loop does beyond a textbook loop (the
per-step agreement, global metric sums, the resumable sampler). It writes ``metrics.csv``
in the config's run directory like a raytrain run; checkpoints are written by the loop
and dropped here (persisting them is Ray's part, outside the timed epochs).
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from raytrain_app.config import config_from_dict, config_to_dict
from raytrain_app.driver.run_directory import RunDirectory
from raytrain_app.planning.environment import detect_environment
from raytrain_app.planning.rules import make_plan, resolve_config
from raytrain_app.worker.loop import WorkerLoop, WorkerTask
from raytrain_app.worker.session import InProcessSession
from raytrain_app.workloads import model_factory, prepare_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a raytrain config as JSON")
    cfg = config_from_dict(json.loads(parser.parse_args().config))
    dist.init_process_group("gloo")  # torchrun's env:// variables
    plan = make_plan(cfg, detect_environment())
    resolved = resolve_config(cfg, plan)
    run_dir = RunDirectory.for_config(resolved)
    if dist.get_rank() == 0:  # generate the data once; the other rank reads the cache
        run_dir.write_config(resolved)
        prepare_data(resolved.data, run_dir.data, resolved.experiment.seed)
    dist.barrier()
    task = WorkerTask(
        config=config_to_dict(resolved),
        plan=plan,
        data=prepare_data(resolved.data, run_dir.data, resolved.experiment.seed),
        model=model_factory(resolved.model),
        run_dir=str(run_dir.root),
    )
    WorkerLoop(task, InProcessSession()).run()  # rank and DDP from torchrun's group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
