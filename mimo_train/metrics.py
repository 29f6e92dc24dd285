"""Step and evaluation records, their stdout lines (rank 0) and TensorBoard scalars.

A train record: ``step, loss, tokens, grad_norm, lr, skipped, seconds, tokens_per_s,
samples_per_s, forward_s`` (forward seconds per module, max over its ranks); an evaluation
record: ``step, eval_loss, eval_tokens``. Every rank builds the same records (the values are
reduced over the world); only rank 0 prints and writes TensorBoard.
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

from mimo_train.console import PREFIX


def world_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the world."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def forward_seconds(layout, local_modules, seconds: float, device: torch.device) -> dict:
    """Forward compute seconds of a step per module (max over the module's ranks); one entry
    ``a+b+...`` for colocated layouts, where every rank runs every module."""
    names = [m.name for m in layout.modules]
    values = world_max([seconds if name in local_modules else 0.0 for name in names], device)
    if layout.colocated:
        return {"+".join(names): max(values)}
    return dict(zip(names, values))


def train_record(step: int, loss_sum: float, tokens: float, grad_norm, lr: float,
                 skipped: bool, seconds: float, global_batch_size: int, forward_s: dict) -> dict:
    return {"step": step, "loss": loss_sum / max(tokens, 1), "tokens": int(tokens),
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(lr), "skipped": skipped, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "samples_per_s": global_batch_size / seconds,
            "forward_s": forward_s}


def eval_record(step: int, loss_sum: float, tokens: float) -> dict:
    return {"step": step, "eval_loss": loss_sum / max(tokens, 1), "eval_tokens": int(tokens)}


def line(record: dict) -> str:
    """The stdout line of a record."""
    if "eval_loss" in record:
        return (f"eval step {record['step']}: loss {record['eval_loss']:.4f} over "
                f"{record['eval_tokens']} tokens")
    forward = " ".join(f"{k} {v * 1000:.0f}ms" for k, v in record["forward_s"].items())
    skipped = "  (skipped: non-finite gradients)" if record["skipped"] else ""
    return (f"step {record['step']:>4}: loss {record['loss']:.4f}  grad_norm "
            f"{record['grad_norm']:.3f}  lr {record['lr']:.2e}  tokens {record['tokens']}  "
            f"{record['tokens_per_s']:.0f} tok/s  {record['samples_per_s']:.1f} samples/s  "
            f"step {record['seconds']:.2f}s  forward: {forward}{skipped}")


def summary(records: list[dict]) -> str | None:
    """The run's loss, first steps against last steps; None without train records."""
    losses = [r["loss"] for r in records if "loss" in r]
    if not losses:
        return None
    k = max(1, min(3, len(losses) // 2))
    return (f"{PREFIX}loss over this run's {len(losses)} steps: {sum(losses[:k]) / k:.4f} "
            f"(mean of the first {k}) -> {sum(losses[-k:]) / k:.4f} (mean of the last {k})")


class Metrics:
    """Keeps the run's records; ``log`` prints a record (rank 0) and writes its scalars."""

    def __init__(self, tensorboard_dir: str | None, log_interval: int, last_step: int):
        self.rank0 = dist.get_rank() == 0
        self.log_interval, self.last_step = log_interval, last_step
        self.records: list[dict] = []
        self.writer = None
        if tensorboard_dir and self.rank0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(tensorboard_dir)

    def log(self, record: dict) -> None:
        self.records.append(record)
        step = record["step"]
        if "loss" in record and step % self.log_interval and step != self.last_step:
            return
        if not self.rank0:
            return
        print(line(record), flush=True)
        if self.writer is None:
            return
        for key, value in record.items():
            if key == "forward_s":
                for module, seconds in value.items():
                    self.writer.add_scalar(f"forward_s/{module}", seconds, step)
            elif key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key if "eval" in key else f"train/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        text = summary(self.records)
        if text and self.rank0:
            print(text, flush=True)


def dump(records: list[dict], path: str) -> None:
    """Write the records as JSON lines (rank 0)."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
