"""One training step's loss and gradients under a given layout, for tests/test_train_parity.py.

    python tests/train_parity_run.py OUT [--save-init DIR] key=value ...          # 1 process
    torchrun --nproc-per-node N tests/train_parity_run.py OUT key=value ...

Builds ``mimo_train.trainer.Trainer`` from the overrides (``model.init_from`` gives every layout
the same weights), runs one global batch forward and backward through the real schedule and
gradient finalization, and writes ``OUT/rank_R.pt``: the world's loss sum and trained-token
count, and each local module's gradients (``main_grad``) keyed by global parameter names.
``--save-init DIR`` first saves the freshly initialized model as a checkpoint in DIR.
"""

import os
import sys

import torch
import torch.distributed as dist

from mimo_train.config import TrainConfig
from mimo_train.model import global_key, unwrap
from mimo_train.trainer import Trainer


def main(argv) -> None:
    out, rest = argv[0], argv[1:]
    save_init = None
    if rest and rest[0] == "--save-init":
        save_init, rest = rest[1], rest[2:]
        rest = [*rest, f"checkpoint.dir={save_init}"]
    trainer = Trainer(TrainConfig.load(None, rest))
    if save_init:
        trainer.save()
    loss_sum, tokens = trainer.forward_backward(trainer.batches(trainer.loader),
                                                forward_only=False)
    grads = {}
    for name, module in trainer.modules.items():
        offset = trainer.layer_offset(name)
        grads[name] = {global_key(key, offset): param.main_grad.detach().cpu().clone()
                       for key, param in unwrap(module).named_parameters()
                       if param.requires_grad}
    os.makedirs(out, exist_ok=True)
    torch.save({"loss_sum": loss_sum, "tokens": tokens, "grads": grads},
               os.path.join(out, f"rank_{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
