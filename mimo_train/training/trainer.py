"""Set-up and training loop: ``train(cfg)`` on every rank of a ``torchrun`` job.

Set-up runs in phases (``console.phase``: device, config, process groups, model, optimizer,
init_from check and init_from, data, checkpoint check and resume); each ends with every rank
agreeing on success, so a bad config, missing shards, a vocab smaller than the tokenizer or a
damaged checkpoint stops every rank with one gathered message instead of leaving the healthy ranks
waiting in a collective. Rank 0 prints one line per phase with its seconds.

The loop (``Trainer.run``): megatron-core's multimodule 1F1B schedule
(``forward_backward_pipelining_without_interleaving`` with ``MultiModulePipelineCommunicator``,
its bridges routing variable per-sample token counts: ``bridge_routing``) for non-colocated
layouts, ``forward_backward_no_pipelining`` for colocated ones (one process per
rank holds every module); ``MimoOptimizer``'s clipping and update on the device
(``mcore.optimizer_step``); per-module warmup + cosine LR (``OptimizerParamScheduler``),
stepped when the step is settled: its outcome read on the host while the next step's passes
are queued behind it (``Trainer.settle``), or at once before an evaluation, a checkpoint or a
stop; records through ``metrics.Metrics``; evaluation; distributed
checkpoints (``checkpoint.TrainingState``: model, trained optimizers, schedulers, loader); a
stop with a checkpoint on ``train.exit_signals`` (``preemption``); non-finite steps skipped and
loss spikes recorded with their samples (``anomalies``).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo_data.loading.layout import LANGUAGE, LayoutError
from mimo_data.loading.loader import DataSource, build_loader, check_dropped, check_even_split
from mimo_data.loading.sample_order import OrderError
from mimo_data.loading.token_table import Partition
from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.shards.cache import CACHE_DIR_ENV, environment_cache
from mimo_train import checkpoint_folders
from mimo_train.components import checkpoint, checkpoint_fit
from mimo_train.components.anomalies import Watch, reports_samples, step_samples
from mimo_train.components.digests import weights_digest
from mimo_train.components.metrics import (FlopsCounter, Metrics, PeakMemory, Readings,
                                           StepValues, Timer, check_outputs, eval_record)
from mimo_train.components.optimizer import (build_optimizer, build_schedulers,
                                             schedule_notes, trained_optimizers)
from mimo_train.errors import TrainConfigError
from mimo_train.families.preprocessing_fit import check_preprocessing, check_template
from mimo_train.mcore import (MultiModuleProcessGroupCollection, ensure_global_memory_buffer,
                              get_forward_backward_func, model_parallel_cuda_manual_seed)
from mimo_train.mcore.attention import available, choose
from mimo_train.mcore.balance import GlobalBalance
from mimo_train.mcore.bridge_routing import SizedPipelineCommunicator
from mimo_train.mcore.grids import Infra, build_infra
from mimo_train.mcore.optimizer_step import step_on_device
from mimo_train.model.build import build_model, shared_placeholders
from mimo_train.model.lora import bases
from mimo_train.model.parts import layer_offset, local_modules, unwrap
from mimo_train.plan import RunPlan
from mimo_train.plan.encoders import check_processors
from mimo_train.planning.dims import from_plan
from mimo_train.planning.flops import peak_tflops, training_passes
from mimo_train.planning.memory_remedies import advisor_command, memory_remedies
from mimo_train.precision import run_dtype
from mimo_train.runtime import devices, distributed
from mimo_train.runtime.console import (PREFIX, agree, memory_cause, out_of_gpu_memory, phase,
                                        run_failure, say)
from mimo_train.runtime.preemption import PAST_DEADLINE, ExitSignals, deadline, signal_number
from mimo_train.runtime.profile import Profile, mark_phase
from mimo_train.training import start_checks
from mimo_train.training.step import ForwardStep, GradientFinalizer, global_sum, no_sync


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


class Trainer:
    """Everything one rank holds for training; ``run()`` trains to ``train.steps``."""

    def __init__(self, plan: RunPlan, records: str | None = None,
                 started: float | None = None):
        """``records``: the JSON-lines file every record goes to as it is read (``--records``;
        appended to when the run resumes a checkpoint); ``started``: the ``time.monotonic()``
        ``train.exit_duration_minutes`` counts from (``mimo-train``: its process's start, so
        imports and start-up count, as against the job's limit; None: now)."""
        self.plan, self.cfg = plan, plan.config
        cfg = self.cfg
        start = time.perf_counter()
        self.deadline = deadline(cfg.train.exit_duration_minutes, started)
        self.device, problem = devices.select(cfg.train.device, devices.probe())
        timeout = timedelta(minutes=cfg.train.collective_timeout_minutes)
        kinds = distributed.init(self.device, timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        phase("device", f"{self.world} rank(s) joined, device {self.device.type}",
              lambda: _raise(problem or devices.mixed(kinds)), start)
        self.preprocess, self.layout = plan.preprocess, plan.layout
        differing = start_checks.differing_settings(plan)   # collective: before any rank fails
        self.text, self.vocabulary = phase(
            "config", "config, tokenizer and shards checked",
            lambda: self._read_config(records, differing))
        self.infra: Infra = phase("process groups", "process groups ready", lambda: build_infra(
            self.layout, "nccl" if self.device.type == "cuda" else "gloo", timeout))
        # the data before the model: what the data refuses (too few samples kept, too many
        # dropped) is said before a pretrained model's minutes of loading
        self.loader, self.valid_loader = phase(
            "data", lambda loaders: "data loaders ready" + (
                f": {loaders[0].summary()}" if loaders[0] is not None else ""), self._loaders)
        # two phases: a rank's model can fail alone (a LoRA target its module lacks), and the
        # optimizer's and schedule's set-up holds collectives of the whole world
        self.peak_memory = PeakMemory(self.device)      # the records' memory_mib from here
        phase("model", lambda _: f"model built ({self.attention.describe()}; memory: "
              f"{plan.memory_summary()})",
              lambda: self._sized(self._build_model, self.text))
        phase("optimizer", "optimizer and schedule ready", lambda: self._sized(
            self._build_optimizer, self.text))
        if cfg.model.init_from:
            self._init_from(cfg.model.init_from)
        self.eval_steps = self._eval_steps() if cfg.data.valid else 0
        self.step = 0
        self.consumed: dict[str, int] | None = None     # a resumed run's totals (_resume)
        self.lora_bases: list[dict] | None = None  # a LoRA run's fixed weights: path, digest
        self.doing = "step 1"                   # what run() is doing: named if it fails
        self.stopped_by = 0                     # the exit signal that stopped the run
        self.failure: str | None = None         # why the run stopped early, failing
        # the current step's samples, where this rank's stand for its language DP part's
        self.step_samples: list[dict] = []
        self.samples: dict[int, list[dict]] = {}  # those of the steps not yet logged
        self.unsettled: StepValues | None = None    # the last step, its outcome not yet read
        run = cfg.train
        self.watch = Watch(run.max_skipped_steps, run.spike_factor, run.spike_window)
        resume = agree("checkpoint check", lambda: checkpoint.prepare(
            cfg.checkpoint.dir, cfg.checkpoint.resume)) if cfg.checkpoint.dir else None
        if resume:
            try:
                self._resume(resume)
            except BaseException:
                if cfg.checkpoint.dir:
                    checkpoint.unclaim(cfg.checkpoint.dir)
                raise
        self.saver = checkpoint.Saver(cfg.checkpoint.dir, cfg.checkpoint.async_save,
                                      cfg.checkpoint.keep_last, resume) \
            if cfg.checkpoint.dir else None
        if note := cfg.checkpoint.note():
            say(PREFIX + note)
        self.metrics = Metrics(cfg.train.tensorboard_dir, cfg.train.log_interval,
                               cfg.train.steps, self.layout, self.infra.local, cfg.train.wandb,
                               cfg.to_dict(), memory=self.peak_memory,
                               records=records, resumed=self.step,
                               checkpoint_dir=cfg.checkpoint.dir, consumed=self.consumed)
        self.metrics.peak_tflops = self.flops.peak_tflops
        self.profile = Profile(run.profile, self.rank, self.device)

    # ------------------------------------------------------------------------------ set-up

    def _read_config(self, records: str | None, differing: TrainConfigError | None):
        """The text encoder and the vocabulary, once the config, its inputs and outputs and
        the data pass their checks (``differing``: the ranks' settings do not agree)."""
        _raise(differing)
        self.cfg.check_inputs()
        if self.rank == 0:                  # what rank 0 writes (the records, TensorBoard's)
            check_outputs(records, self.cfg.train.tensorboard_dir)
            if self.cfg.checkpoint.dir:     # another run's folder: said in seconds
                checkpoint.check_folder(self.cfg.checkpoint.dir, self.cfg.checkpoint.resume)
        start_checks.check_data(self.cfg, self.preprocess, self.layout)
        text = TextEncoder(self.preprocess)
        vocabulary = self.plan.language.vocabulary(text.vocab_size)
        if self.plan.vlm is not None:
            check_preprocessing(self.plan.vlm, self.preprocess, text.tokenizer,
                                self.plan.vlm_tower_serves)
        else:
            check_template(self.preprocess, text.renderer)
        check_processors(self.plan.encoders)
        return text, vocabulary

    def _build_model(self, text) -> None:
        """This rank's modules of the model (no collective spanning modules)."""
        cfg = self.cfg
        self.attention = choose(cfg.model.attention, run_dtype(cfg.train.precision),
                                available(self.device))
        ensure_global_memory_buffer()
        language = next((p for p in self.infra.role.modules if p.name == LANGUAGE), None)
        torch.manual_seed(cfg.train.seed)
        model_parallel_cuda_manual_seed(cfg.train.seed, tp_rank=language.tp_rank if language
                                        else 0, ep_rank=language.ep_rank if language else 0,
                                        etp_rank=language.etp_rank if language else 0)
        self.model = build_model(self.plan, self.infra, self.vocabulary,
                                 text.modality_token_ids, self.device, self.attention)
        self.modules = local_modules(self.model, self.infra)
        self.flops = self._flops_counter(text)

    def _flops_counter(self, text) -> FlopsCounter:
        """The step's model FLOPs (``planning``): the dims read from the config (every
        module's, whichever this rank holds), counted on the ranks ``FlopsCounter`` says."""
        cfg, plan = self.cfg, self.plan
        dims = from_plan(plan, text.vocab_size)
        language = next((p for p in self.infra.role.modules if p.name == LANGUAGE), None)
        counts = language is not None and language.last_stage and language.tp_rank == 0 \
            and language.cp_rank == 0
        peak = cfg.train.peak_tflops
        if peak is None and self.device.type == "cuda":
            peak = peak_tflops(self._gpu_name(), cfg.train.precision)
        return FlopsCounter(dims, [m.name for m in self.layout.modules],
                            training_passes(dims, plan.frozen,
                                            [a.part for a in plan.adapted]),
                            counts, peak)

    def _build_optimizer(self, text) -> None:
        """Optimizer, LR schedulers, the schedule's wiring."""
        cfg = self.cfg
        self.optimizer = build_optimizer(cfg.optimizer, self.plan.modules, cfg.train.precision,
                                         self.model)
        self.trained = trained_optimizers(
            self.optimizer, [p.module for p in self.plan.frozen if p.part is None])
        self.schedulers = build_schedulers(self.plan.modules, cfg.train.steps, self.trained)
        say(f"{PREFIX}trains: {self.plan.training_summary()}")
        for note in self.plan.warmup_notes():
            say(PREFIX + note)
        self.placeholders = shared_placeholders(self.plan, text.modality_token_ids)
        self.balance = self._balance()
        self.forward = ForwardStep(
            self.infra, self.device, self.placeholders, self.balance,
            unwrap(self.modules[LANGUAGE]).host_labels if LANGUAGE in self.modules else None)
        self._wire_schedule()

    def _balance(self) -> GlobalBalance | None:
        """The global-batch load-balancing loss on this rank's routers
        (``model.language.moe_aux_loss``; None: off, or no language model here)."""
        coefficient = self.plan.language.moe_aux_loss
        if not coefficient or LANGUAGE not in self.modules:
            return None
        return GlobalBalance(unwrap(self.modules[LANGUAGE]), coefficient,
                             self.infra.modules[LANGUAGE].pgs,
                             self.plan.language.sequence_parallel)

    def _init_from(self, given: str) -> None:
        """This rank's weights from a checkpoint of any layout, a step's folder or a
        checkpoint.dir's latest (two phases: the checks need no collective, the load is
        one)."""
        directory = checkpoint_folders.step_of(given)

        def checked() -> None:
            meta = checkpoint_fit.check(directory, self.model, None, (),
                                    self.cfg.to_dict()["model"])
            checkpoint_fit.check_lora_scale(directory, meta, self.cfg.model.lora, resume=False)
        phase("init_from check", f"model.init_from {directory}: its tensor index fits this "
              "model (its data is checked as it loads)", checked)

        def load():
            checkpoint.load_model(directory, self.model)
            self.optimizer.reload_model_params()        # bf16: the fp32 main weights
        phase("init_from", f"weights loaded from {directory}", load)

    def _resume(self, directory: str) -> None:
        def checked() -> dict:
            meta = checkpoint_fit.check(directory, self.model, self.cfg.train.global_batch_size,
                                    self.cfg.model.freeze, self.cfg.to_dict()["model"],
                                    self.cfg.train.precision)
            checkpoint_fit.check_lora_scale(directory, meta, self.cfg.model.lora)
            return meta
        meta = phase("checkpoint check", f"checkpoint {directory}: its tensor index fits this "
                     "run (its data is checked as it loads)", checked)
        if self.cfg.model.lora and meta.get("lora_base"):
            # the fixed weights come from the checkpoint: its base stays the one recorded,
            # whatever model.pretrained holds now
            self.lora_bases = meta["lora_base"]
        changed = self.preprocess.changes_from(meta["preprocess"]) if meta.get("preprocess") \
            else []
        if changed:         # said before the load, whose loader refuses other kept samples
            say(f"{PREFIX}resuming {directory} with another preprocessing than the run's so "
                f"far ({self.cfg.data.preprocess}): {'; '.join(changed)}: the samples are made "
                "so from here on (where it keeps other samples than the run's, the loader "
                "refuses the resume)")
        self.step, changes = phase(
            "resume", lambda loaded: f"resumed from {directory} at step {loaded[0]}",
            lambda: checkpoint.load(directory, self.training_state(), meta, self._meta()))
        # the run's totals at the checkpoint (Metrics.consumed): its samples alone where it
        # holds none (saved before they were kept)
        self.consumed = meta.get("consumed") or {
            "samples": self.step * self.cfg.train.global_batch_size}
        saved = (meta.get("layout"), meta.get("world_size"))
        if None not in saved and saved != (str(self.layout), self.world):   # both recorded
            say(f"{PREFIX}the checkpoint was saved under layout {saved[0]} on {saved[1]} "
                f"rank(s), this run's is {self.layout} on {self.world}: its weights and "
                "optimizer state are resharded (the same values), the sample stream goes on "
                f"after its {self.step * self.cfg.train.global_batch_size:,} samples as an "
                "uninterrupted run's (the same global batch), its random-number state "
                "starts anew (dropout draws differ from an uninterrupted run's)")
        # the LR schedules follow this run's config; gathered once every rank has loaded (no
        # note when nothing is left to train: _train says so)
        notes = schedule_notes(self.step, distributed.gather(changes))
        for note in notes if self.step < self.cfg.train.steps else ():
            say(PREFIX + note)
        if self.cfg.model.init_from:        # loaded first, replaced now: said, not silent
            say(f"{PREFIX}model.init_from {self.cfg.model.init_from} is replaced by the "
                f"checkpoint resumed from ({directory}): its weights continue the run; to "
                "start over from init_from, give another checkpoint.dir")
        for note in checkpoint_fit.resume_notes(meta, self.cfg.to_dict()["model"],
                                                self.cfg.model.freeze):
            say(f"{PREFIX}resuming {directory}: {note}")

    def layer_offset(self, name: str) -> int:
        """Global index of this rank's first layer of module ``name``."""
        return layer_offset(self.infra, name, self.plan.language.num_layers)

    def _loaders(self):
        cfg = self.cfg
        # Every rank opens the datasets, all of them before any loader: missing token tables
        # are computed split over the job, in collectives no rank may skip. Parts travel over a
        # gloo group (CPU memory, whatever the training backend).
        partition = Partition(self.rank, self.world, distributed.gather,
                              writes=int(os.environ.get("LOCAL_RANK", 0)) == 0)
        overriding = environment_cache()
        if cfg.data.cache_dir and overriding and self.rank == 0 and \
                os.path.abspath(overriding) != os.path.abspath(cfg.data.cache_dir):
            say(f"{PREFIX}data.cache_dir {cfg.data.cache_dir} is not used: the environment's "
                f"{CACHE_DIR_ENV}={overriding} wins (unset it to use data.cache_dir)")

        def source(datasets, weights) -> DataSource:
            return DataSource(datasets, self.preprocess, weights, cfg.data.num_workers,
                              progress=self.rank == 0, cache_dir=cfg.data.cache_dir,
                              partition=partition,
                              storage_options=cfg.data.storage_options, text=self.text)

        def loader(opened: DataSource, key: str):
            try:
                return _loader(opened)
            except OrderError as error:         # which of the run's sets it is
                raise type(error)(f"{key} ({', '.join(opened.directories)}): {error}") from None

        def _loader(opened: DataSource):
            return build_loader(opened, self.preprocess, self.layout, self.rank, self.world,
                                cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                cfg.train.seed, num_workers=cfg.data.num_workers,
                                weights=opened.weights, balance=cfg.data.balance,
                                packing=cfg.data.packing, split_media=cfg.data.split_media,
                                parent_signals=tuple(signal_number(name)
                                                     for name in cfg.train.exit_signals),
                                # page-locked batches: copies to the GPU that do not block
                                pin_memory=self.device.type == "cuda")

        train_source = source(cfg.data.datasets, cfg.data.weights)
        valid_source = source(cfg.data.valid, None) if cfg.data.valid else None
        if cfg.data.max_dropped_fraction is not None:
            check_dropped(train_source, cfg.data.max_dropped_fraction)
            if valid_source is not None:
                check_dropped(valid_source, cfg.data.max_dropped_fraction, "data.valid")
        for key, opened in (("data.datasets", train_source), ("data.valid", valid_source)):
            try:                # the validation set's batches go through the same bridge
                if opened is not None:
                    check_even_split(opened, self.layout)
            except LayoutError as error:
                raise type(error)(f"{key} ({', '.join(opened.directories)}): {error}") from None
        return loader(train_source, "data.datasets"), \
            valid_source and loader(valid_source, "data.valid")

    def _eval_steps(self) -> int:
        """Global batches per evaluation: ``train.eval_steps``, at most one epoch of
        ``data.valid`` so each validation sample counts once (collective: a rank that reads
        the set tells every rank its size). Rank 0 says the set's size, and the clamp."""
        valid, run = self.valid_loader, self.cfg.train
        mine = (valid.summary(), valid.steps_per_epoch, valid.order.remainder_samples) \
            if valid is not None else None
        summary, per_epoch, left_out = next(v for v in distributed.gather(mine)
                                            if v is not None)
        steps = min(run.eval_steps, per_epoch)
        if steps < run.eval_steps:
            every = "every validation sample once" + (
                f" but the {left_out} the remainder leaves out (a global batch that divides "
                "the kept samples evaluates them all)" if left_out else "")
            say(f"{PREFIX}train.eval_steps {run.eval_steps} is more than the validation set's "
                f"{per_epoch} global batch(es) an epoch: each evaluation runs {steps}, {every}")
        part = f" ({steps} of the epoch's {per_epoch} batches: train.seed and the global " \
            "batch size pick which)" if steps < per_epoch else ""
        say(f"{PREFIX}validation set: {summary}; {steps} step(s) of {run.global_batch_size} "
            f"samples per evaluation, the same each time{part}")
        return steps

    def _wire_schedule(self) -> None:
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
        self.communicator = SizedPipelineCommunicator(
            self.infra.grids, self.infra.topology, config, dim_mapping={"s": 0, "b": 1, "h": 2},
            module_output_ndim={m.name: 2 for m in self.layout.encoders})
        local = {name: m.pgs for name, m in self.infra.local.items()}
        self.pg_collection = MultiModuleProcessGroupCollection(
            module_pgs=local, language_model_module_name=LANGUAGE if LANGUAGE in local else None)
        self.schedule = get_forward_backward_func(schedule_pg_collection=self.pg_collection)

    # -------------------------------------------------------------------------------- loop

    def run(self) -> list[dict]:
        """Train to ``train.steps``; returns the records (every rank has them). A failure on the
        way is raised as ``RunError`` naming this rank, the step and the cause. The loaders'
        workers are stopped on the way out, whatever the way: they ignore the run's exit
        signals, so the interpreter's exit, which ends them with SIGTERM, would wait for them."""
        try:
            return self._train()
        except Exception as error:
            self._say_unfinished()
            where = ", ".join(f"{m.name} dp{m.dp_rank} tp{m.tp_rank} pp{m.pp_rank}"
                              for m in self.infra.role.modules)
            remedies = self._memory_remedies() if out_of_gpu_memory(error) else ()
            raise run_failure(error, self.rank, self.doing, where or "no module",
                              remedies) from error
        finally:
            for loader in (self.loader, self.valid_loader):
                if loader is not None:
                    loader.close()

    def _say_unfinished(self) -> None:
        """The step done before a failure, whose line waited for the next step's settling
        (``settle``), said as far as this rank can without the others; a failure reading it
        (a device that failed) leaves it unsaid."""
        values, self.unsettled = self.unsettled, None
        # only a failure in the next step's work: one after the step (its save, the signals'
        # agreement) is that step's own, whose values may wait on a collective left undone
        if values is not None and self.doing == f"step {values.step + 1}":
            try:
                self.metrics.unfinished(values)
            except Exception:       # the failure being raised says what went wrong
                pass

    def _sized(self, build, *args):
        """``build(*args)``; out of GPU memory there (torch's allocator, or NCCL's buffers as
        the first collectives make them), the weights, gradients or optimizer state do not
        fit this layout: the error names the layout advisor's command."""
        try:
            return build(*args)
        except Exception as error:
            if not out_of_gpu_memory(error):
                raise
            raise torch.OutOfMemoryError(
                f"{memory_cause(error)}; the layout advisor says which layouts and settings "
                f"fit: {advisor_command(self.plan, self._gpu_name())}") from None

    def _gpu_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    def _memory_remedies(self) -> list[str]:
        """What would lower this rank's memory (``planning.memory_remedies``); a failure to
        say is named in their place, not raised over the out-of-memory error."""
        try:
            return memory_remedies(self.plan, self.infra.role.modules, self._gpu_name())
        except Exception as error:
            return [f"(none found: {type(error).__name__}: {error})"]

    def _train(self) -> list[dict]:
        run, every = self.cfg.train, self.cfg.checkpoint.interval
        if self.step >= run.steps:          # a resumed checkpoint already there
            say(f"{PREFIX}the checkpoint at step {self.step} is at or past train.steps="
                f"{run.steps}: nothing to train")
            if self.saver:                  # the folder is free for the next run at once
                self.saver.release()
            self.metrics.close()
            return self.metrics.records
        say(f"{PREFIX}layout {self.layout} on {self.world} rank(s), device "
            f"{self.device.type}, {self.micro_batches} micro-batch(es) of "
            f"{run.micro_batch_size} per language DP rank per step")
        opt, saved = self.cfg.optimizer, self.cfg.checkpoint
        own = [name for name, module in opt.modules.items()     # a schedule of its own
               if (module.lr, module.min_lr, module.warmup_steps) != (None, None, None)]
        say(f"{PREFIX}steps {self.step + 1} to {run.steps} of global batch "
            f"{run.global_batch_size}, precision {run.precision}, lr {opt.lr:g} (warmup "
            f"{self.cfg.warmup_steps()[0]}, cosine to {opt.min_lr:g}"
            f"{'; ' + ', '.join(own) + ' their own' if own else ''}); " + (
                "no checkpoint (no checkpoint.dir)" if not saved.dir else
                f"checkpoints to {saved.dir} every {every} steps and at the last" if every
                else f"a checkpoint to {saved.dir} at the last step") + (
                f", the newest {saved.keep_last} kept" if saved.dir and saved.keep_last
                else ""))
        iterator = self.batches(self.loader, self.cfg.data.datasets)
        with ExitSignals(run.exit_signals, self.deadline) as signals, self.profile:
            while self.step < run.steps:
                self.doing = f"step {self.step + 1}"
                self.profile.before(self.step + 1)
                values, anomalies, read = self.train_step(iterator)
                if values is None:         # the steps skipped before it are past the limit
                    self.failure = self._anomalies(anomalies, read)
                    say(f"{PREFIX}{self.failure}")
                    break
                self.profile.after(self.step)
                self.samples[self.step], self.step_samples = self.step_samples, []
                # the step before's record and its anomalies before this step's (within the
                # limit: train_step looked)
                self._anomalies(anomalies, read)
                self._saved(self.saver.poll() if self.saver else [])
                self.stopped_by = signals.agreed()
                late = self.stopped_by == PAST_DEADLINE
                if late:                             # a planned stop: exit status 0
                    self.stopped_by = 0
                stop = bool(self.stopped_by) or late or (
                    bool(run.exit_interval) and self.step % run.exit_interval == 0)
                last = self.step == run.steps
                # at the multiples of the interval and at the last step: the weights a run
                # ends with (those exported) are evaluated, as Megatron-LM's are
                evaluating = bool(run.eval_interval) and (
                    last or self.step % run.eval_interval == 0)
                saving = self.saver is not None and (
                    last or stop or bool(every and self.step % every == 0))
                # what follows needs this step's outcome (its learning rates, its record, its
                # skip counted): settled now, the device's queue drained
                anomalies, read = self.settle() if last or stop or evaluating or saving \
                    else ([], [])
                self.failure = self._anomalies(anomalies, read)
                if self.failure:
                    say(f"{PREFIX}{self.failure}")
                    break
                if evaluating:
                    self.doing = f"the evaluation at step {self.step}"
                    self._anomalies([], self.metrics.log(self.evaluate()))
                if stop:                    # its step's line before the checkpoint and why
                    self._anomalies([], self.metrics.flush(show=True))
                if saving and self.saver:
                    self.doing = f"the checkpoint of step {self.step}"
                    self.save()
                    if not (last or stop):
                        # a signal come (or the time limit passed) while it saved stops on
                        # this checkpoint, rather than after another step and another save (a
                        # grace time spent twice); an asynchronous save has only begun here
                        during = signals.agreed()
                        if during:
                            late = during == PAST_DEADLINE
                            self.stopped_by, stop = 0 if late else during, True
                            self._anomalies([], self.metrics.flush(show=True))
                    if last or stop:
                        self._saved(self.saver.wait())
                if self.stopped_by:
                    say(f"{PREFIX}{signal.Signals(self.stopped_by).name} received: stopped "
                        f"after step {self.step}" + ("" if self.cfg.checkpoint.dir else
                                                     " (no checkpoint.dir: nothing saved)"))
                    break
                if late and not last:
                    say(f"{PREFIX}train.exit_duration_minutes {run.exit_duration_minutes:g} "
                        f"passed: stopping after step {self.step}" + (
                            "" if self.cfg.checkpoint.dir else
                            " (no checkpoint.dir: nothing saved)"))
                    break
                if stop and not last:
                    say(f"{PREFIX}train.exit_interval {run.exit_interval}: stopping at step "
                        f"{self.step}" + ("" if self.cfg.checkpoint.dir else
                                          " (no checkpoint.dir: nothing saved)"))
                    break
            anomalies, read = self.settle()         # (every way out of the loop settled)
            self._anomalies(anomalies, read + self.metrics.flush())     # steps not logged yet
        if self.saver:                                       # a stop for too many skipped steps
            self._saved(self.saver.wait())
            self.saver.release()
        self.metrics.close()
        return self.metrics.records

    def _anomalies(self, skipped: list[dict], read: list[dict]) -> str | None:
        """Log the skipped steps' records and the spikes among the train records ``read``
        (and those a skipped step's record reads first); returns why the run must stop (too
        many skipped steps), or None."""
        if skipped:              # the steps before it, read now, are checked for spikes too
            read = read + self.metrics.flush()
        try:
            for anomaly in [*self.watch.spikes(read, self.samples), *skipped]:  # in step order
                self.metrics.log_anomaly(anomaly)
        finally:                 # their scalars, and the steps', in step order
            self.metrics.publish()
        if read:                 # their samples, and those of the steps before, are not needed
            last = max(record["step"] for record in read)
            for step in [step for step in self.samples if step <= last]:
                del self.samples[step]
        return self.watch.over_limit()

    def batches(self, loader, datasets: list[str] | None = None):
        """Micro-batches on ranks with data (across epochs), None elsewhere; with ``datasets``
        (the loader's directories, training only) their samples go to ``step_samples``."""
        if loader is None:
            return None

        def stream():
            while True:
                for batch, metadata in loader:
                    if datasets is not None and reports_samples(self.infra.role):
                        self.step_samples += step_samples(metadata, datasets)
                    self.flops.add(metadata)
                    yield batch
        return stream()

    def forward_backward(self, iterator, forward_only: bool) -> torch.Tensor:
        """One global batch through the schedule (gradients finalized unless
        ``forward_only``); returns the world's [loss sum over trained tokens, their count] as a
        device tensor (not read on the host). With ``model.language.moe_aux_loss`` a training
        pass is preceded by the step's counting pass (``mcore.balance``)."""
        if forward_only or not self.plan.language.moe_aux_loss:
            return self._through_schedule(iterator, forward_only)
        started = time.perf_counter()
        with mark_phase("data"):
            batches = list(itertools.islice(iterator, self.micro_batches)) \
                if iterator is not None else None
        waited = time.perf_counter() - started
        timers, waits = len(self.forward.timers), len(self.forward.waits)
        counting = self.balance.counting(self.device) if self.balance else nullcontext()
        with counting:
            reports = self._reports(iter(batches) if batches is not None else None, True)
        del self.forward.timers[timers:]                     # the count pass is not timed
        # the step's wait for its micro-batches is here: the passes take them from a list
        del self.forward.waits[waits:]
        if batches is not None:
            self.forward.waits.append(waited)
        trained = global_sum(reports[:2], self.infra, self.device)[1]
        applying = self.balance.applying(trained) if self.balance else nullcontext()
        with applying:
            return self._through_schedule(iter(batches) if batches is not None else None,
                                          False)

    def _reports(self, iterator, forward_only: bool) -> torch.Tensor:
        """This rank's [loss sum, trained tokens] of one pass through the schedule."""
        kwargs = dict(forward_step_func=self.forward, data_iterator=iterator, model=[self.model],
                      num_microbatches=self.micro_batches,
                      seq_length=self.preprocess.seq_length,
                      micro_batch_size=self.cfg.train.micro_batch_size,
                      forward_only=forward_only, pg_collection=self.pg_collection)
        if self.communicator is not None:
            kwargs["p2p_communicator"] = self.communicator
        # a training pass's schedule: its backward passes (its forward passes mark their own)
        with mark_phase("backward") if not forward_only else nullcontext():
            reports = [report["lm loss"] for report in self.schedule(**kwargs) or ()]
        if self.communicator is not None:
            self.communicator.finish(forward_only)
        # (no reports: on the device too, where a host tensor's copy would wait for its queue)
        return torch.stack(reports).double().sum(0) if reports else \
            torch.zeros(2, dtype=torch.float64, device=self.device)

    def _through_schedule(self, iterator, forward_only: bool) -> torch.Tensor:
        """``forward_backward``'s pass: the world's [loss sum, trained tokens], and the step's
        FLOPs per module (``step_flops``)."""
        local = self._reports(iterator, forward_only)
        # the micro-batches' FLOPs ride on the same sum (no collective of their own)
        local = torch.cat([local.to(self.device, torch.float64),
                           self.flops.take(self.device, tokens=True)])
        sums = global_sum(local, self.infra, self.device)
        # the world's FLOPs per module, then its samples' tokens, on the device
        self.step_flops = sums[2:]
        return sums[:2]

    def train_step(self, iterator) -> tuple[StepValues | None, list[dict], list[dict]]:
        """One step: its passes; then, before its update, the step before settled
        (``settle``: by then the device has run it, this step's passes are queued behind it);
        then its clipping and update, queued with nothing read (``mcore.optimizer_step``).
        Returns its values (None where the steps skipped before it are past
        ``train.max_skipped_steps``: it updates nothing), and the skipped steps' anomaly
        records and the train records the settling gave."""
        for module in self.modules.values():
            module.zero_grad_buffer()
        self.optimizer.zero_grad()
        # this step's forward passes and waits for micro-batches, no others
        self.forward.timers, self.forward.waits = [], []
        self.step_samples = []
        timer = Timer(self.device)
        sums = self.forward_backward(iterator, forward_only=False)
        with mark_phase("optimizer"):
            anomalies, read = self.settle()
            if self.watch.over_limit():
                return None, anomalies, read
            outcome = step_on_device(self.optimizer)
        self.step += 1
        # the step keeps its timers and waits; an evaluation before the next step adds to
        # new lists
        forward, self.forward.timers = self.forward.timers, []
        waits, self.forward.waits = self.forward.waits, []
        readings = {"sums": sums, "outcome": outcome, "flops": self.step_flops}
        if self.balance is not None and self.balance.value is not None:
            readings["balance"] = self.balance.value
        self.unsettled = StepValues(self.step, Readings(readings), timer.stop(), forward,
                                    self.cfg.train.global_batch_size, sum(waits),
                                    self.peak_memory.mib())
        return self.unsettled, anomalies, read

    def settle(self) -> tuple[list[dict], list[dict]]:
        """The last step's outcome read (a wait for the device to have run that step): its
        learning rates stepped unless its gradient norm (or loss) was not finite (then it
        updated nothing: counted as skipped, as megatron-core's training loop does), then its
        values logged. Returns its skip's anomaly record (if so) and the train records the
        metrics read; nothing when no step waits."""
        values, self.unsettled = self.unsettled, None
        if values is None:
            return [], []
        flag, norm = values.readings.read()["outcome"]
        anomalies = []
        if flag:
            anomalies.append(self.watch.skip(
                values.step, "non-finite gradient norm (or loss): update skipped", norm,
                self.samples.get(values.step, [])))
        else:
            for scheduler in self.schedulers.values():
                scheduler.step(1)
        values.grad_norm, values.skipped = norm, bool(flag)
        values.lrs = {name: o.param_groups[0]["lr"] for name, o in self.trained.items()
                      if o.param_groups}
        return anomalies, self.metrics.log(values)

    def evaluate(self) -> dict:
        """Mean per-token loss on the first ``eval_steps`` global batches of ``data.valid``
        (at most its epoch: ``_eval_steps``), the same batches at every evaluation."""
        state = self.valid_loader.state_dict() if self.valid_loader is not None else None
        iterator = self.batches(self.valid_loader)
        for module in self.modules.values():
            module.eval()
        sums = []
        with torch.no_grad():
            for _ in range(self.eval_steps):
                sums.append(self.forward_backward(iterator, forward_only=True))
        total, tokens = torch.stack(sums).sum(0).tolist()
        for module in self.modules.values():
            module.train()
        if self.valid_loader is not None:
            self.valid_loader.load_state_dict(state)        # same batches at every evaluation
        return eval_record(self.step, total, tokens,
                           self.eval_steps * self.cfg.train.global_batch_size)

    # -------------------------------------------------------------------------- checkpoints

    def training_state(self) -> checkpoint.TrainingState:
        """What a checkpoint holds for this rank (see ``checkpoint``)."""
        return checkpoint.TrainingState(self.model, self.trained, self.schedulers, self.loader)

    def _meta(self) -> dict:
        meta = {"step": self.step, "layout": str(self.layout), "world_size": self.world,
                "global_batch_size": self.cfg.train.global_batch_size,
                "config": self.cfg.to_dict(),
                # as trained: an export reads this, not the YAML, which may change after
                "preprocess": self.preprocess.to_dict()}
        if self.cfg.model.lora and self.rank == 0:       # rank 0 writes meta.json
            if self.lora_bases is None:                  # hashed once, at the first save
                self.lora_bases = [{"key": key, "path": path, "sha256": weights_digest(path)}
                                   for key, path in bases(self.cfg)]
            meta["lora_base"] = self.lora_bases
        return meta

    def save(self) -> str:
        """Save at this step (with ``checkpoint.async_save``, started: ``saver.wait()`` ends
        it); the checkpoint's directory."""
        assert self.saver                              # run() saves only with a directory
        assert self.unsettled is None, "the schedules are saved after the step is settled"
        directory = self.saver.save(self.step, self.training_state(),
                                    self._meta() | {"consumed": self.metrics.totals()})
        if self.saver.queue:
            say(f"{PREFIX}checkpoint {directory}: being written in the background")
        else:
            self._saved([directory])
        return directory

    def _saved(self, directories: list[str]) -> None:
        background = self.saver is not None and self.saver.queue is not None
        for directory in directories:
            say(f"{PREFIX}checkpoint {directory}" + (" complete" if background else ""))


def train(plan: RunPlan, records: str | None = None, started: float | None = None) -> Trainer:
    """Build the trainer on this rank and train (``records``, ``started``: ``Trainer``'s);
    returns it (its ``metrics.records``, and ``stopped_by`` / ``failure`` when the run
    stopped early)."""
    cfg = plan.config
    trainer = Trainer(plan, records, started)
    trainer.run()
    if cfg.checkpoint.dir:
        latest = checkpoint_folders.latest(cfg.checkpoint.dir)
        say(f"{PREFIX}checkpoint dir {os.path.abspath(cfg.checkpoint.dir)} " +
            (f"(latest: {latest})" if latest else "(no checkpoint in it)"))
    return trainer
