"""One training step's loss and gradients under a given layout, for tests/test_train_parity.py.

    python tests/jobs/train_parity.py OUT [--save-init DIR] [--host-reads] [--save-batches] k=v ...
    torchrun --nproc-per-node N tests/jobs/train_parity.py OUT key=value ...

Builds ``mimo_train.training.trainer.Trainer`` from the overrides (``model.init_from`` gives every
layout the same weights), runs one global batch forward and backward through the real schedule and
gradient finalization, and writes ``OUT/rank_R.pt``: the world's loss sum and trained-token count
(and the global batch's load-balancing loss on the language ranks, with ``moe_aux_loss``),
the world's gradient norm as the update clips by it (``mcore.optimizer_step.world_grad_norm``),
each local module's gradients (``main_grad``, TP shards gathered) keyed by global parameter names
(an expert's by its global number under expert parallelism),
and the dtypes of each module's parameters and buffers and the names of the parameters it does not
train. ``--save-init DIR`` first saves the freshly initialized model as a checkpoint in DIR.
``--save-batches`` adds the micro-batches the step trained on (as the loader gave them) to
``rank_R.pt``. Also recorded: each module's forward calls by submodule (``calls``: a
recomputed layer runs twice), its optimizer's share of the weights (``sharded``) and where
its gradient reductions started (``reductions``: after or during the backward pass; with
``optimizer.overlap_grad_reduce`` the step runs once before, see ``warm_up``); under the
distributed optimizer the reduced gradients' shards are all-gathered before they are read.
``--host-reads`` then runs two whole training steps and records every place that read a
tensor's value on the host during the second (which settles the first: ``Trainer.settle``)
(``host_reads``: ``path:line function`` -> count), and the steps the learning-rate schedules
had taken as each of the two updates started (``schedule_steps``).
"""

import itertools
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from mimo_train.config import TrainConfig
from mimo_train.mcore.optimizer_step import world_grad_norm
from mimo_train.plan import resolve
from mimo_train.model.parts import global_key, unwrap
from mimo_train.training import trainer as trainer_module
from mimo_train.training.trainer import Trainer

# what reads a tensor's value on the host, or needs its data to size a result
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
          torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
          torch.unique, torch.Tensor.unique}
_SIZED_BY_DATA = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host, by the first caller outside
    torch and mimo's CPU shim (on a GPU each one waits for the device's queued work)."""

    def __init__(self):
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func in _SIZED_BY_DATA and len(args) > 1 and isinstance(
                args[1], torch.Tensor) and kwargs.get("output_size") is None) or (
                func is torch.Tensor.__getitem__ and _bool_index(args[1])):
            frame = sys._getframe(1)
            while frame is not None and (f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
                                         or frame.f_code.co_filename.endswith("cpu_compat.py")):
                frame = frame.f_back
            if frame is not None:
                path = frame.f_code.co_filename
                for root in ("mimo_train", "megatron", "transformers"):
                    marker = f"{os.sep}{root}{os.sep}"
                    if marker in path:
                        path = root + os.sep + path.split(marker, 1)[1]
                self.sites[f"{path}:{frame.f_lineno} {frame.f_code.co_qualname}"] += 1
        return func(*args, **kwargs)


def _bool_index(index) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def whole(key: str, param, tp, gated: bool, sections: list[int] | None = None
          ) -> torch.Tensor:
    """The parameter's gradient as one TP1 rank holds it: TP shards gathered along their
    partition dimension (``gated``: SwiGLU's ``linear_fc1`` shards, and those of its LoRA B,
    hold [gate_r; up_r], regrouped; ``sections``: the rows of each section a rank holds, a
    gated delta-net's ``in_proj`` [q_r; k_r; v_r; z_r; b_r; a_r] and ``conv1d``, regrouped
    section by section)."""
    grad = param.main_grad.detach().cpu().clone()
    if tp is None or tp.size() == 1 or not getattr(param, "tensor_model_parallel", False):
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp.size())]
    dist.all_gather(parts, grad.contiguous(), group=tp)
    if gated and key.endswith(("linear_fc1.weight", "linear_fc1.lora.b.weight")):
        halves = [part.chunk(2) for part in parts]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
    if sections is not None:
        split = [part.split(sections) for part in parts]
        return torch.cat([piece[i] for i in range(len(sections)) for piece in split])
    return torch.cat(parts, dim=param.partition_dim)


def tp_of(param, pgs):
    """The group a parameter is split over: an expert's (megatron-core marks its parameters
    ``allreduce=False``) the expert tensor-parallel group, any other the TP group."""
    return pgs.tp if getattr(param, "allreduce", True) else pgs.expt_tp


def expert_key(key: str, ep, inner) -> str:
    """``key`` with a local expert's number (``local_experts.<i>.``) made the layer's global
    one: expert-parallel rank r holds experts r·E/ep on."""
    head, found, tail = key.partition(".local_experts.")
    if not found or ep is None or ep.size() == 1:
        return key
    local, rest = tail.split(".", 1)
    share = inner.config.num_moe_experts // ep.size()
    return f"{head}.local_experts.{ep.rank() * share + int(local)}.{rest}"


def delta_net_sections(inner, key: str) -> list[int] | None:
    """The per-rank sections of a gated delta-net's fused ``in_proj`` (or its LoRA B) or
    ``conv1d`` at ``key``, None for any other parameter."""
    for fused, count in ((".in_proj.", 6), (".conv1d.", 3)):
        if key.endswith((f"{fused}weight", f"{fused}lora.b.weight")):    # not A: its rank rows
            layer = inner.get_submodule(key.split(fused)[0])
            sections = getattr(layer, "in_proj_split_sections", None)
            return list(sections[:count]) if sections is not None else None
    return None


def gather_sharded_grads(module) -> None:
    """Under the distributed optimizer each DP rank holds only its shard of every bucket's
    reduced gradient (reduce-scatter): all-gather the shards, so that ``main_grad`` reads
    the whole reduced gradient as without it."""
    if not module.ddp_config.use_distributed_optimizer:
        return
    for group in module.bucket_groups:
        dp = group.intra_distributed_optimizer_instance_group
        for bucket in group.buckets:
            shard = bucket.grad_data.numel() // dp.size()
            mine = bucket.grad_data[dp.rank() * shard:(dp.rank() + 1) * shard].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=dp)


def count_calls(modules: dict) -> tuple[dict, list]:
    """name -> {submodule path: [forward calls, the first input's first dimension]}, filled
    while the hooks (returned) stay registered: a recomputed layer runs its forward twice
    per micro-batch, a sequence-parallel layer norm sees 1 / TP of the sequence."""
    calls: dict = {}
    hooks = []
    for name, module in modules.items():
        calls[name] = {}
        for path, sub in unwrap(module).named_modules():
            def hook(sub, args, path=path, seen=calls[name]):
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                entry = seen.setdefault(path, [0, None if first is None or first.dim() == 0
                                               else first.shape[0]])
                entry[0] += 1
            hooks.append(sub.register_forward_pre_hook(hook))
    return calls, hooks


def watch_reductions(modules: dict) -> dict:
    """name -> [gradient reductions started after the backward pass, during it]: megatron-core
    DDP's bucket groups start theirs from the backward hooks under ``overlap_grad_reduce``,
    else all at once when the schedule finishes the gradients."""
    started: dict = {}
    for name, module in modules.items():
        seen = started[name] = [0, 0]
        for group in module.bucket_groups:
            def start(*args, original=group.start_grad_sync, seen=seen, **kwargs):
                seen[torch._C._current_graph_task_id() != -1] += 1
                return original(*args, **kwargs)
            group.start_grad_sync = start
    return started


def optimizer_shares(trainer) -> dict:
    """module -> (its optimizer's class names, the fp32 main weights this rank's optimizer
    holds, the module's trained weights on this rank): under the distributed optimizer a
    DP rank holds its share only."""
    shares = {}
    for name, module in trainer.modules.items():
        optimizer = trainer.optimizer.module_infos[name].optimizer
        inner = getattr(optimizer, "chained_optimizers", [optimizer])
        groups = optimizer.param_groups if optimizer is not None else []
        shares[name] = ("+".join(sorted({type(o).__name__ for o in inner})),
                        sum(p.numel() for group in groups for p in group["params"]),
                        sum(p.numel() for p in module.parameters() if p.requires_grad))
    return shares


def warm_up(trainer, iterator):
    """Under ``overlap_grad_reduce`` megatron-core's DDP learns which gradients fill each
    bucket in the first step and starts reductions from the backward pass from the second one
    on: the step's micro-batches go through once first (their gradients dropped), and the
    iterator given back replays them (the step's FLOPs, counted as the loader gives the
    micro-batches, are the first pass's). Without it, ``iterator`` unchanged."""
    if not any(m.ddp_config.overlap_grad_reduce for m in trainer.modules.values()):
        return iterator, None
    first = None if iterator is None else list(itertools.islice(iterator,
                                                                trainer.micro_batches))
    trainer.forward_backward(None if first is None else iter(first), forward_only=False)
    for module in trainer.modules.values():
        module.zero_grad_buffer()
    return (None if first is None else itertools.chain(first, iterator)), trainer.step_flops


def _recorded(iterator, into: list):
    """``iterator``, each micro-batch it gives also appended to ``into``."""
    for batch in iterator:
        into.append(batch)
        yield batch


def main(argv) -> None:
    out, rest = argv[0], argv[1:]
    save_init = None
    if rest and rest[0] == "--save-init":
        save_init, rest = rest[1], rest[2:]
        rest = [*rest, f"checkpoint.dir={save_init}"]
    host_reads, save_batches = "--host-reads" in rest, "--save-batches" in rest
    rest = [arg for arg in rest if arg not in ("--host-reads", "--save-batches")]
    trainer = Trainer(resolve(TrainConfig.load(None, rest)))
    if save_init:
        trainer.save()
    iterator, warm_flops = warm_up(trainer, trainer.batches(trainer.loader))
    batches: list = []
    if save_batches and iterator is not None:
        iterator = _recorded(iterator, batches)
    calls, hooks = count_calls(trainer.modules)
    reductions = watch_reductions(trainer.modules)
    loss_sum, tokens = trainer.forward_backward(iterator, forward_only=False).tolist()
    # the step's micro-batches and reductions, not the host-read steps' after it
    batches, reductions = list(batches), {name: list(seen) for name, seen in reductions.items()}
    # the global batch's load-balancing loss (model.language.moe_aux_loss), where counted
    balance = float(trainer.balance.value) if trainer.balance is not None else None
    if warm_flops is not None:
        trainer.step_flops = warm_flops
    # the step's model FLOPs per module, as the trainer's records get them
    flops = dict(zip([m.name for m in trainer.layout.modules], trainer.step_flops.tolist()))
    for hook in hooks:
        hook.remove()
    # the step's gradient norm as the trainer's update takes it (and clips by): world-wide
    trainer.optimizer.prepare_grads()
    grad_norm = float(world_grad_norm(trainer.optimizer)[1])
    grads, dtypes, fixed = {}, {}, {}
    for name, module in trainer.modules.items():
        gather_sharded_grads(module)
        offset = trainer.layer_offset(name)
        inner = unwrap(module)
        pgs = trainer.infra.modules[name].pgs
        gated = getattr(getattr(inner, "config", None), "gated_linear_unit", False)
        grads[name] = {global_key(expert_key(key, pgs.ep, inner), offset): whole(
                           key, param, tp_of(param, pgs), gated, delta_net_sections(inner, key))
                       for key, param in inner.named_parameters() if param.requires_grad}
        dtypes[name] = {key: str(t.dtype) for key, t in [*inner.named_parameters(),
                                                          *inner.named_buffers()]}
        fixed[name] = sorted(key for key, param in inner.named_parameters()
                             if not param.requires_grad)
    reads, schedule_steps = None, []
    if host_reads:
        assert trainer.cfg.train.steps > 2          # neither step is the last
        update = trainer_module.step_on_device

        def counted(optimizer):
            """The steps each schedule has taken when an update starts."""
            schedule_steps.append(sorted({s.num_steps for s in trainer.schedulers.values()}))
            return update(optimizer)
        trainer_module.step_on_device = counted
        trainer.train_step(iterator)
        with HostReads() as counter:
            trainer.train_step(iterator)
        reads = dict(counter.sites)
    os.makedirs(out, exist_ok=True)
    torch.save({"loss_sum": loss_sum, "tokens": tokens, "flops": flops, "grads": grads,
                "grad_norm": grad_norm,
                "moe_aux_loss": balance,
                "dtypes": dtypes,
                "fixed": fixed, "host_reads": reads, "schedule_steps": schedule_steps,
                "batches": batches, "calls": calls,
                "sharded": optimizer_shares(trainer), "reductions": reductions},
               os.path.join(out, f"rank_{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
