"""Checkpoints: model, optimizer, LR schedulers, loader position and RNG, per rank.

Layout on disk::

    DIR/step_0000040/rank_00000.pt ...   one file per rank, written by that rank
    DIR/step_0000040/meta.json           step, layout, world size, config (rank 0, last)
    DIR/latest                           "step_0000040", replaced atomically once every rank
                                         has written its file

A rank file holds ``model`` (this rank's modules, weights with *global* layer numbers, see
``model.module_state``), ``optimizer`` (``MimoOptimizer.state_dict()``), ``schedulers``,
``loader`` (``RankLoader.state_dict()``, None on ranks without data), ``step`` and the RNG state.
``save`` and ``load`` take those parts as objects with ``state_dict()`` / ``load_state_dict()``
(``Parts`` groups several into one, ``TorchRNG`` is the generator's).
Resuming needs the same layout (optimizer state is per rank); ``model.init_from`` loads only the
weights of any checkpoint into any layout, since the ``model`` entries of all rank files together
hold every module whole. Plain ``torch.save`` per rank rather than megatron-core's distributed
checkpointing: the MIMO modules here are not tensor-parallel sharded (encoders run whole, TP is
left to the language model's own groups) and this keeps a checkpoint readable with torch alone.
"""

from __future__ import annotations

import glob
import json
import os

import torch
import torch.distributed as dist

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here; the message says why and what to do."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def latest(root: str | None) -> str | None:
    """The newest complete checkpoint directory under ``root``, or None."""
    if not root:
        return None
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(root, name)


class Parts(dict):
    """Named parts with ``state_dict()`` / ``load_state_dict()`` that are one part together
    (e.g. the per-module LR schedulers)."""

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, part in self.items():
            part.load_state_dict(state[name])


class TorchRNG:
    """torch's CPU generator as a checkpoint part."""

    def state_dict(self) -> torch.Tensor:
        return torch.get_rng_state()

    def load_state_dict(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


def save(root: str, step: int, parts: dict, meta: dict) -> str:
    """Write this rank's file: ``step`` and each part's ``state_dict()`` (None for a part that
    is None on this rank, e.g. the loader of a rank without data); rank 0 writes ``meta.json``
    and moves ``latest`` once all ranks are done (collective: every rank calls it)."""
    rank_state = {"step": step, **{name: part.state_dict() if part is not None else None
                                   for name, part in parts.items()}}
    directory = step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank()
    path = os.path.join(directory, f"rank_{rank:05d}.pt")
    torch.save(rank_state, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        _write_atomic(os.path.join(directory, "meta.json"), json.dumps(meta, indent=1))
        _write_atomic(os.path.join(root, LATEST), os.path.basename(directory))
    dist.barrier()
    return directory


def load(directory: str, parts: dict, meta_expected: dict) -> int:
    """Load this rank's file from ``directory`` into ``parts`` (in their order), after checking
    it was saved for this layout; returns the checkpoint's step."""
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    for key in ("layout", "world_size", "global_batch_size"):
        if meta.get(key) != meta_expected[key]:
            raise CheckpointError(
                f"checkpoint {directory} was saved with {key} {meta.get(key)!r}, this run has "
                f"{meta_expected[key]!r}: resuming (optimizer and loader state) needs the same "
                f"{key}; to start a new run from its weights under another layout use "
                f"model.init_from={directory} and a new checkpoint.dir")
    path = os.path.join(directory, f"rank_{dist.get_rank():05d}.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    for name, part in parts.items():
        if part is not None:
            part.load_state_dict(state[name])
    return state["step"]


def load_weights(directory: str) -> dict:
    """module name -> whole-module weights, merged from every rank file of a checkpoint."""
    files = sorted(glob.glob(os.path.join(directory, "rank_*.pt")))
    if not files:
        raise CheckpointError(f"model.init_from {directory} holds no rank_*.pt file: point it "
                              "at a step_* directory written by mimo_train")
    weights: dict = {}
    for path in files:
        rank_state = torch.load(path, map_location="cpu", weights_only=False)
        for name, state in rank_state["model"].items():
            weights.setdefault(name, {}).update(state)
    return weights


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
