"""Training runs under several layouts, one after another in one process group, for
tests/test_planning.py (the layout advisor's ranking against measured runs).

    python tests/layout_timing_run.py RUNS.json OUT.json        # the tests: N forked ranks

``RUNS.json`` lists ``{"name": ..., "config": YAML or null, "overrides": [key=value, ...]}``,
every run on the job's
ranks; each builds ``mimo_train.training.trainer.Trainer`` and trains to ``train.steps``.
``OUT.json`` (rank 0) gets, per run, every rank's CPU seconds of its main thread in each train
step (``step_cpu_s[rank][step]``, ``Trainer.train_step``: the work a rank did, whatever else
shared the machine's cores), the run's wall seconds and its step records. One process group
for all of them: megatron-core and the models load once.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from mimo_train.config import TrainConfig
from mimo_train.families.registry import resolve
from mimo_train.training.trainer import Trainer


def main(runs_path: str, out_path: str) -> None:
    with open(runs_path) as f:
        runs = json.load(f)
    results = {}
    for run in runs:
        trainer = Trainer(resolve(TrainConfig.load(run.get("config"), run["overrides"])))
        steps: list[float] = []
        step = trainer.train_step

        def timed(iterator, step=step, steps=steps):
            start = time.thread_time()
            try:
                return step(iterator)
            finally:
                steps.append(time.thread_time() - start)
        trainer.train_step = timed
        wall = time.perf_counter()
        records = trainer.run()
        wall = time.perf_counter() - wall
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, steps)
        results[run["name"]] = {"step_cpu_s": gathered, "wall_s": wall,
                                "records": [r for r in records if "loss" in r]}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
