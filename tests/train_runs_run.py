"""Several short training runs one after another in one process, for tests/test_dtypes.py.

    python tests/train_runs_run.py RUNS.json OUT.json        # the tests: one forked rank

``RUNS.json`` lists ``{"name": ..., "overrides": [key=value, ...]}``; each run builds
``mimo_train.training.trainer.Trainer`` (one rank, so every module is on it) and trains to
``train.steps``, saving checkpoints when the overrides name a ``checkpoint.dir``. ``OUT.json``
gets, per run, its step losses and, per module, each parameter's digest (SHA-256 of its values
as fp32, read right after set-up: what the run started from).
One process for all of them: megatron-core and the models load once.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from mimo_train.config import TrainConfig
from mimo_train.families.registry import resolve
from mimo_train.model.parts import unwrap
from mimo_train.training.trainer import Trainer


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's values as contiguous fp32 (tests/test_dtypes.py too)."""
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()


def main(runs_path: str, out_path: str) -> None:
    with open(runs_path) as f:
        runs = json.load(f)
    results = {}
    for run in runs:
        trainer = Trainer(resolve(TrainConfig.load(None, run["overrides"])))
        start = {name: {key: digest(p) for key, p in unwrap(module).named_parameters()}
                 for name, module in trainer.modules.items()}
        records = trainer.run()
        results[run["name"]] = {"losses": [r["loss"] for r in records if "loss" in r],
                                "start": start}
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
