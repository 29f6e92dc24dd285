"""The logits of a model built by ``mimo_train`` on its first micro-batch, for the VLM tests
(``vlm_runs.logits``: one forked rank of tests/launch.py; tests/test_vlm.py,
tests/test_vlm_families.py, tests/test_vlm_video.py).

    python tests/vlm_logits_run.py OUT key=value ...      # one process, a colocated layout

Builds ``mimo_train.training.trainer.Trainer`` from the overrides, runs ``MimoModel`` forward (no
labels: logits) on the loader's first micro-batch and writes ``OUT/logits.pt``: the logits
(``[rows, tokens, vocab]``), the batch as the loader gave it and its samples' keys.
"""

import os
import sys

import torch
import torch.distributed as dist

from mimo_train.config import TrainConfig
from mimo_train.families.registry import resolve
from mimo_train.training.step import model_inputs
from mimo_train.training.trainer import Trainer


def main(argv) -> None:
    out, overrides = argv[0], argv[1:]
    trainer = Trainer(resolve(TrainConfig.load(None, overrides)))
    batch, metadata = next(iter(trainer.loader))
    inputs = model_inputs(batch, trainer.infra, torch.device("cpu"), trainer.placeholders)
    inputs["labels"] = None
    with torch.no_grad():
        logits, _ = trainer.model(**inputs)
    os.makedirs(out, exist_ok=True)
    torch.save({"logits": logits, "batch": batch, "keys": metadata["keys"]},
               os.path.join(out, "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
