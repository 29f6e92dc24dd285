"""The logits of a model built by ``mimo_train`` on its first micro-batch, for the VLM tests
(``vlm_runs.logits`` and ``vlm_runs.colocated``: one forked rank of tests/support/launch.py;
tests/test_vlm.py, tests/test_vlm_families.py, tests/test_vlm_video.py).

    python tests/jobs/vlm_logits.py OUT [--save-init DIR] [--step] key=value ...   # one process

Builds ``mimo_train.training.trainer.Trainer`` from the overrides, runs ``MimoModel`` forward (no
labels: logits) on the loader's first micro-batch and writes ``OUT/logits.pt``: the logits
(``[rows, tokens, vocab]``), the batch as the loader gave it and its samples' keys.

``--save-init DIR`` first saves the imported model as a checkpoint in DIR (``step_0000000``).
``--step`` then runs one global batch, that micro-batch first, forward and backward through the
real schedule and gradient finalization (no optimizer step), as tests/jobs/train_parity.py does
on one rank, and writes its ``OUT/rank_0.pt``: the loss sum, the trained tokens, the step's
model FLOPs per module and every module's gradients by global parameter name (``runs.merged``
reads it). One process for the logits and the colocated reference step: the Trainer
(tokenizer, model, loader) is built once.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

from mimo_train.config import TrainConfig
from mimo_train.plan import resolve
from mimo_train.model.parts import global_key, unwrap
from mimo_train.training.step import model_inputs
from mimo_train.training.trainer import Trainer


def main(argv) -> None:
    out, rest = argv[0], argv[1:]
    save_init = None
    if rest[:1] == ["--save-init"]:
        save_init, rest = rest[1], rest[2:]
        rest = [*rest, f"checkpoint.dir={save_init}"]
    step = "--step" in rest
    rest = [arg for arg in rest if arg != "--step"]
    trainer = Trainer(resolve(TrainConfig.load(None, rest)))
    if save_init:
        trainer.save()
    stream = iter(trainer.loader)
    batch, metadata = next(stream)
    untouched = copy.deepcopy(batch) if step else None
    if step:
        trainer.flops.add(metadata)             # the step's model FLOPs, as in the trainer
    inputs = model_inputs(batch, trainer.infra, torch.device("cpu"), trainer.placeholders)
    inputs["labels"] = None
    with torch.no_grad():
        logits, _ = trainer.model(**inputs)
    os.makedirs(out, exist_ok=True)
    torch.save({"logits": logits, "batch": batch, "keys": metadata["keys"]},
               os.path.join(out, "logits.pt"))
    if step:
        _step(trainer, untouched, stream, out)
    dist.destroy_process_group()


def _step(trainer: Trainer, first: dict, stream, out: str) -> None:
    """The global batch whose first micro-batch is ``first`` (the loader's stream goes on
    after it), forward and backward; its ``rank_0.pt`` as tests/jobs/train_parity.py writes it
    on one rank (no TP: each gradient is the parameter's ``main_grad`` as it is)."""
    assert dist.get_world_size() == 1, "the colocated reference runs on one rank"

    def micro_batches():
        yield first
        for batch, metadata in stream:
            trainer.flops.add(metadata)
            yield batch
    loss_sum, tokens = trainer.forward_backward(micro_batches(), forward_only=False).tolist()
    flops = dict(zip([m.name for m in trainer.layout.modules], trainer.step_flops.tolist()))
    grads = {}
    for name, module in trainer.modules.items():
        offset = trainer.layer_offset(name)
        grads[name] = {global_key(key, offset): param.main_grad.detach().cpu().clone()
                       for key, param in unwrap(module).named_parameters()
                       if param.requires_grad}
    torch.save({"loss_sum": loss_sum, "tokens": tokens, "flops": flops, "grads": grads},
               os.path.join(out, "rank_0.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
