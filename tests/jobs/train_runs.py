"""Several training runs one after another in one process group, for tests/test_dtypes.py
(one forked rank) and tests/test_planning.py (the layout advisor's ranking: four).

    python tests/jobs/train_runs.py RUNS.json OUT.json        # the tests: N forked ranks

``RUNS.json`` lists ``{"name": ..., "config": YAML (optional), "overrides": [key=value, ...]}``,
every run on the job's ranks; each builds ``mimo_train.training.trainer.Trainer`` and trains to
``train.steps``, saving checkpoints when the overrides name a ``checkpoint.dir``. ``OUT.json``
(rank 0) gets, per run: its step ``losses`` and ``records``; ``start``, rank 0's parameters'
digests per module (SHA-256 of their values as fp32, read right after set-up: what the run
started from); ``step_cpu_s[rank][step]``, every rank's CPU seconds of its main thread in each
train step (``Trainer.train_step``: the work a rank did, whatever else shared the machine's
cores); with ``"count_flops": true``, ``step_flops[rank][step]``, the floating-point operations
of the matrix products and attention every rank ran in each train step (torch's own formulas,
``torch.utils.flop_counter``: a count, the same on a busy machine as on an idle one);
``wall_s``. One process group for all of them: megatron-core and the models load once.
"""

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from mimo_train.config import TrainConfig
from mimo_train.plan import resolve
from mimo_train.model.parts import unwrap
from mimo_train.training.trainer import Trainer


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's values as contiguous fp32 (tests/test_dtypes.py too)."""
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()


class FlopCount(TorchDispatchMode):
    """The FLOPs of the operators run in this thread meanwhile that torch has a formula for
    (matrix products, attention: ``FlopCounterMode``'s, without its per-module tracking)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def main(runs_path: str, out_path: str) -> None:
    with open(runs_path) as f:
        runs = json.load(f)
    results = {}
    for run in runs:
        trainer = Trainer(resolve(TrainConfig.load(run.get("config"), run["overrides"])))
        start = {name: {key: digest(p) for key, p in unwrap(module).named_parameters()}
                 for name, module in trainer.modules.items()}
        steps: list[float] = []
        flops: list[int] = []
        step, count = trainer.train_step, bool(run.get("count_flops"))

        def timed(iterator, step=step, steps=steps, flops=flops, count=count):
            counter = FlopCount() if count else None
            started = time.thread_time()
            try:
                if counter is None:
                    return step(iterator)
                with counter:
                    return step(iterator)
            finally:
                steps.append(time.thread_time() - started)
                if counter is not None:
                    flops.append(counter.flops)
        trainer.train_step = timed
        wall = time.perf_counter()
        records = [r for r in trainer.run() if "loss" in r]
        wall = time.perf_counter() - wall
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (steps, flops))
        results[run["name"]] = {"losses": [r["loss"] for r in records], "records": records,
                                "start": start, "step_cpu_s": [g[0] for g in gathered],
                                "wall_s": wall,
                                **({"step_flops": [g[1] for g in gathered]}
                                   if run.get("count_flops") else {})}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
