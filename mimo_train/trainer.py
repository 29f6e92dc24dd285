"""Set-up and training loop: ``train(cfg)`` on every rank of a ``torchrun`` job (issue 5, item 5).

Set-up runs in phases; each phase ends with every rank agreeing on success (``_agree``), so a
bad config, missing shards or a vocab smaller than the tokenizer stops every rank with the same
message instead of leaving the healthy ranks waiting in a collective.

The loop: megatron-core's multimodule 1F1B schedule (``forward_backward_pipelining_without_
interleaving`` with ``MultiModulePipelineCommunicator``) for non-colocated layouts, and
``forward_backward_no_pipelining`` for colocated ones (one process per rank holds every module);
``MimoOptimizer`` step; per-module warmup + cosine LR (``OptimizerParamScheduler``); logging to
stdout and TensorBoard; evaluation; checkpoints with the loader state.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist

from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_data.loading.loader import build_loader, check_even_split, variable_token_modalities
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.shards.format import INDEX_FILE
from mimo_train import checkpoint
from mimo_train.config import TrainConfig, TrainConfigError
from mimo_train.infra import Infra, build_infra
from mimo_train.model import (build_model, build_optimizer, layer_offset, load_module_state,
                              local_modules, module_state, vocab_size)
from mimo_train.step import ForwardStep, GradientFinalizer, global_sum, no_sync, synchronize


class StartupError(RuntimeError):
    """Set-up failed on at least one rank; the message gathers every rank's reason."""


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _agree(phase: str, function):
    """Run ``function`` on every rank; if it fails anywhere, raise on every rank."""
    try:
        result, error = function(), None
    except (TrainConfigError, ValueError, OSError, RuntimeError, KeyError) as exc:
        result, error = None, f"{type(exc).__name__}: {exc}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {}
    for rank, message in enumerate(errors):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        lines = [f"  rank(s) {ranks}: {message}" for message, ranks in failed.items()]
        raise StartupError(f"mimo_train start-up failed ({phase}):\n" + "\n".join(lines))
    return result


def _device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainConfigError("train.device is cuda but no CUDA device is visible: use "
                                   "train.device=cpu or auto")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if torch.cuda.is_available():
        # cpu_compat (megatron-core on CPU) switches on only without CUDA (DESIGN.md)
        raise TrainConfigError("train.device is cpu but CUDA devices are visible: hide them "
                               "(CUDA_VISIBLE_DEVICES= torchrun ...) to train on the CPU")
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    """Join the ``torchrun`` job (env://), or start a one-process group without torchrun."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # With NCCL, binding the group to this rank's GPU tells barrier() (checkpoint saves) which
    # device to use instead of guessing (torch warns at every barrier otherwise).
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, **kwargs)


def _check_data(cfg: TrainConfig, preprocess: PreprocessConfig, layout: Layout) -> None:
    for directory in [*cfg.data.datasets, *cfg.data.valid]:
        if not os.path.isfile(os.path.join(directory, INDEX_FILE)):
            raise TrainConfigError(f"no shards at {directory}: {INDEX_FILE} is missing; build "
                                   f"them with mimo-shard build ... --output {directory}")
    layout.validate(dist.get_world_size(), cfg.train.global_batch_size,
                    cfg.train.micro_batch_size, variable_token_modalities(preprocess),
                    modalities=list(preprocess.modalities))


class Trainer:
    """Everything one rank holds for training; ``run()`` trains to ``train.steps``."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.device = _device(cfg.train.device)
        init_distributed(self.device)
        if self.device.type == "cpu":
            from mimo_train import cpu_compat
            cpu_compat.activate()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.preprocess, self.layout, text = _agree("config", self._read_config)
        self.infra: Infra = _agree("process groups", lambda: build_infra(
            self.layout, "nccl" if self.device.type == "cuda" else "gloo"))
        self.model = _agree("model", lambda: self._build_model(text))
        self.modules = local_modules(self.model, self.infra)
        self.optimizer = build_optimizer(cfg, self.model)
        self.schedulers = self._schedulers()
        self.loader, self.valid_loader = _agree("data", self._loaders)
        self.step = 0
        self.forward = ForwardStep(self.infra, self.device)
        self._wire_schedule()
        resume = checkpoint.latest(cfg.checkpoint.dir) if cfg.checkpoint.resume else None
        if resume:
            _agree("resume", lambda: self._resume(resume))
            _log(f"resumed from {resume} at step {self.step}")
        self.writer = self._tensorboard()

    # ------------------------------------------------------------------------------ set-up

    def _read_config(self):
        from mimo_data.preprocess.chat_tokens import TextEncoder

        preprocess = PreprocessConfig.from_yaml(self.cfg.data.preprocess)
        layout = Layout.parse(self.cfg.layout)
        _check_data(self.cfg, preprocess, layout)
        text = TextEncoder(preprocess)
        vocab_size(self.cfg, text.vocab_size)
        return preprocess, layout, text

    def _build_model(self, text):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state._set_global_memory_buffer()     # initialize_model_parallel is not used
        language = next((p for p in self.infra.role.modules if p.name == LANGUAGE), None)
        tp_rank = language.tp_rank if language else 0
        torch.manual_seed(self.cfg.train.seed)
        model_parallel_cuda_manual_seed(self.cfg.train.seed, tp_rank=tp_rank, ep_rank=0,
                                        etp_rank=0)
        model = build_model(self.cfg, self.infra, self.preprocess, text.vocab_size,
                            text.modality_token_ids, self.device)
        if self.cfg.model.init_from:
            weights = checkpoint.load_weights(self.cfg.model.init_from)
            self._load_weights(model, weights, self.cfg.model.init_from)
        return model

    def _load_weights(self, model, weights: dict, where: str) -> None:
        for name, module in local_modules(model, self.infra).items():
            if name not in weights:
                raise TrainConfigError(f"{where} has no weights for module {name!r} (it has "
                                       f"{sorted(weights)})")
            load_module_state(module, weights[name], self.layer_offset(name), f"{where} ({name})")

    def layer_offset(self, name: str) -> int:
        """Global index of this rank's first layer of module ``name``."""
        return layer_offset(self.infra, name, self.cfg.model.language.num_layers)

    def _schedulers(self) -> dict:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        opt, steps = self.cfg.optimizer, self.cfg.train.steps
        return {name: OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps, lr_decay_steps=steps, lr_decay_style="cosine",
            start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=steps,
            wd_incr_style="constant")
            for name, optimizer in self._trained_optimizers().items()}

    def _trained_optimizers(self) -> dict:
        """This rank's module optimizers, frozen modules left out (they have no state)."""
        return {name: info.optimizer for name, info in self.optimizer.module_infos.items()
                if info.is_active and info.optimizer is not None
                and name not in self.cfg.model.freeze}

    def _loaders(self):
        cfg = self.cfg

        def loader(datasets, seed):
            return build_loader(datasets, self.preprocess, self.layout, self.rank, self.world,
                                cfg.train.global_batch_size, cfg.train.micro_batch_size, seed,
                                num_workers=cfg.data.num_workers,
                                weights=cfg.data.weights if datasets == cfg.data.datasets
                                else None)

        train = loader(cfg.data.datasets, cfg.train.seed)
        if train is not None:      # every rank has one: encoders run whole (pp1) on stage 0
            check_even_split(train.source, self.layout)
        valid = loader(cfg.data.valid, cfg.train.seed) if cfg.data.valid else None
        return train, valid

    def _wire_schedule(self) -> None:
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

        config = self.model.config
        self.finalizer = GradientFinalizer(self.infra, self.modules, self.device)
        config.finalize_model_grads_func = self.finalizer
        config.no_sync_func = lambda: no_sync(self.modules)
        config.grad_scale_func = self.optimizer.scale_loss
        self.micro_batches = self.cfg.train.global_batch_size // \
            self.layout.global_micro_batch_size(self.cfg.train.micro_batch_size)
        if self.layout.colocated:
            self.pg_collection = self.infra.modules[LANGUAGE].pgs
            self.communicator = None
            self.schedule = get_forward_backward_func(pp_size=1, vp_size=None)
            return
        from megatron.core.pipeline_parallel.multimodule_communicator import (
            MultiModulePipelineCommunicator)
        self.communicator = MultiModulePipelineCommunicator(
            self.infra.grids, self.infra.topology, config, dim_mapping={"s": 0, "b": 1, "h": 2},
            module_output_ndim={m.name: 2 for m in self.layout.encoders})
        local = {name: m.pgs for name, m in self.infra.local.items()}
        self.pg_collection = MultiModuleProcessGroupCollection(
            module_pgs=local, language_model_module_name=LANGUAGE if LANGUAGE in local else None)
        self.schedule = get_forward_backward_func(schedule_pg_collection=self.pg_collection)

    def _tensorboard(self):
        directory = self.cfg.train.tensorboard_dir
        if not directory or self.rank != 0:
            return None
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(directory)

    # -------------------------------------------------------------------------------- loop

    def batches(self, loader):
        """Micro-batches on ranks with data (across epochs), None elsewhere."""
        if loader is None:
            return None

        def stream():
            while True:
                for batch, _metadata in loader:
                    yield batch
        return stream()

    def forward_backward(self, iterator, forward_only: bool) -> tuple[float, float]:
        """One global batch through the schedule (gradients finalized unless
        ``forward_only``); returns the world's (loss sum over trained tokens, their count)."""
        kwargs = dict(forward_step_func=self.forward, data_iterator=iterator, model=[self.model],
                      num_microbatches=self.micro_batches,
                      seq_length=self.preprocess.seq_length,
                      micro_batch_size=self.cfg.train.micro_batch_size,
                      forward_only=forward_only, pg_collection=self.pg_collection)
        if self.communicator is not None:
            kwargs["p2p_communicator"] = self.communicator
        reports = self.schedule(**kwargs)
        local = [0.0, 0.0]
        for report in reports or ():
            total, tokens = report["lm loss"].tolist()
            local[0] += total
            local[1] += tokens
        loss_sum, tokens = global_sum(local, self.infra, self.device)
        return loss_sum, tokens

    def train_step(self, iterator) -> dict:
        for module in self.modules.values():
            module.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.forward.forward_seconds = 0.0
        synchronize(self.device)
        start = time.perf_counter()
        loss_sum, tokens = self.forward_backward(iterator, forward_only=False)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            for scheduler in self.schedulers.values():
                scheduler.step(1)
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.step += 1
        trained = [o.param_groups[0]["lr"] for o in self._trained_optimizers().values()
                   if o.param_groups]
        lr = trained[0] if trained else 0.0
        return {"step": self.step, "loss": loss_sum / max(tokens, 1), "tokens": int(tokens),
                "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                "lr": float(_world_max(lr, self.device)), "skipped": not success,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "samples_per_s": self.cfg.train.global_batch_size / seconds,
                "forward_s": self._forward_seconds_by_module()}

    def _forward_seconds_by_module(self) -> dict:
        """Forward compute seconds of the step, per module (max over the module's ranks)."""
        names = [m.name for m in self.layout.modules]
        values = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for name in self.infra.local:
            values[names.index(name)] = self.forward.forward_seconds
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        if self.layout.colocated:
            return {"+".join(names): float(values.max())}
        return dict(zip(names, values.tolist()))

    def evaluate(self) -> dict:
        """Mean per-token loss on the first ``eval_steps`` global batches of ``data.valid``."""
        state = self.valid_loader.state_dict() if self.valid_loader is not None else None
        iterator = self.batches(self.valid_loader)
        for module in self.modules.values():
            module.eval()
        total = tokens = 0.0
        with torch.no_grad():
            for _ in range(self.cfg.train.eval_steps):
                loss_sum, count = self.forward_backward(iterator, forward_only=True)
                total, tokens = total + loss_sum, tokens + count
        for module in self.modules.values():
            module.train()
        if self.valid_loader is not None:
            self.valid_loader.load_state_dict(state)        # same batches at every evaluation
        return {"step": self.step, "eval_loss": total / max(tokens, 1), "eval_tokens": int(tokens)}

    def run(self) -> list[dict]:
        """Train to ``train.steps``; returns the logged records (every rank has them)."""
        cfg = self.cfg
        _log(f"mimo_train: layout {self.layout} on {self.world} rank(s), device "
             f"{self.device.type}, {self.micro_batches} micro-batch(es) of "
             f"{cfg.train.micro_batch_size} per language DP rank per step")
        iterator = self.batches(self.loader)
        records = []
        while self.step < cfg.train.steps:
            record = self.train_step(iterator)
            records.append(record)
            if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps:
                self._report(record)
            if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
                result = self.evaluate()
                records.append(result)
                self._report(result)
            stop = bool(cfg.train.exit_interval) and self.step % cfg.train.exit_interval == 0
            if cfg.checkpoint.dir and (self.step == cfg.train.steps or stop or (
                    cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0)):
                where = self.save()
                _log(f"checkpoint: {where}")
            if stop and self.step < cfg.train.steps:
                _log(f"exit_interval {cfg.train.exit_interval}: stopping at step {self.step}")
                break
        if self.writer is not None:
            self.writer.close()
        losses = [r["loss"] for r in records if "loss" in r]
        if losses:
            k = max(1, min(3, len(losses) // 2))
            _log(f"loss over this run's {len(losses)} steps: {sum(losses[:k]) / k:.4f} (mean of "
                 f"the first {k}) -> {sum(losses[-k:]) / k:.4f} (mean of the last {k})")
        return records

    def _report(self, record: dict) -> None:
        if self.rank != 0:
            return
        if "eval_loss" in record:
            print(f"eval step {record['step']}: loss {record['eval_loss']:.4f} over "
                  f"{record['eval_tokens']} tokens", flush=True)
        else:
            forward = " ".join(f"{k} {v * 1000:.0f}ms" for k, v in record["forward_s"].items())
            print(f"step {record['step']:>4}: loss {record['loss']:.4f}  grad_norm "
                  f"{record['grad_norm']:.3f}  lr {record['lr']:.2e}  tokens {record['tokens']}"
                  f"  {record['tokens_per_s']:.0f} tok/s  {record['samples_per_s']:.1f} "
                  f"samples/s  step {record['seconds']:.2f}s  forward: {forward}"
                  f"{'  (skipped: non-finite gradients)' if record['skipped'] else ''}",
                  flush=True)
        if self.writer is not None:
            for key, value in record.items():
                if key == "forward_s":
                    for module, seconds in value.items():
                        self.writer.add_scalar(f"forward_s/{module}", seconds, record["step"])
                elif key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}" if "eval" not in key else key, value,
                                           record["step"])

    # -------------------------------------------------------------------------- checkpoints

    def _meta(self) -> dict:
        return {"step": self.step, "layout": str(self.layout), "world_size": self.world,
                "global_batch_size": self.cfg.train.global_batch_size,
                "config": self.cfg.to_dict()}

    def save(self) -> str:
        state = {"step": self.step,
                 "model": {name: module_state(module, self.layer_offset(name))
                           for name, module in self.modules.items()},
                 "optimizer": {n: o.state_dict() for n, o in self._trained_optimizers().items()},
                 "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
                 "loader": self.loader.state_dict() if self.loader is not None else None,
                 "rng": torch.get_rng_state()}
        return checkpoint.save(self.cfg.checkpoint.dir, self.step, state, self._meta())

    def _resume(self, directory: str) -> None:
        state = checkpoint.load_rank(directory, self._meta())
        self._load_weights(self.model, state["model"], directory)
        self.optimizer.load_state_dict(state["optimizer"])
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][name])
        if self.loader is not None:
            self.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        self.step = state["step"]


def _world_max(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def train(cfg: TrainConfig) -> list[dict]:
    """Build the trainer on this rank and train; returns the logged records."""
    trainer = Trainer(cfg)
    records = trainer.run()
    if cfg.checkpoint.dir:
        _log(f"checkpoint dir: {os.path.abspath(cfg.checkpoint.dir)} "
             f"(latest: {checkpoint.latest(cfg.checkpoint.dir)})")
    return records


def dump_records(records: list[dict], path: str) -> None:
    """Write the logged records as JSON lines (rank 0)."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
