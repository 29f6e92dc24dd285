"""Checkpoints on megatron-core's distributed checkpointing: they load under another layout.

Layout on disk::

    DIR/step_0000040/              a megatron-core distributed checkpoint (torch_dist format:
                                   metadata.json, .metadata, __<rank>_<n>.distcp)
    DIR/step_0000040/meta.json     step, layout, world size, global batch size, config, the
                                   run's consumed samples and tokens (rank 0)
    DIR/step_0000040/integrity.json  SHA-256 of every file above (megatron-core's manifest
                                   format), each data file hashed by the rank that wrote it
                                   (``digests``), written last by rank 0
    DIR/latest                     "step_0000040", replaced atomically after the manifest

A save is megatron-core's asynchronous request (``dist_checkpointing.save(...,
async_sharded_save=True)``), run in place or, with ``checkpoint.async_save``, by a forked writer
process per rank while training goes on (``Saver``); either way the manifest and ``latest``
follow only once every rank's files and digests are complete, so ``latest`` never names a
checkpoint still being written.

What a checkpoint holds (``TrainingState``): every module's weights as *global* tensors
(``MimoModel.sharded_state_dict``: a TP rank's slice and a pipeline stage's layers are parts of
them), the trained modules' optimizer state sharded like their parameters, each trained
module's LR scheduler and the loader position (one object each: the same on every rank that has
it), the step, and each rank's RNG states (the CPU generator's; with CUDA also the device's and
megatron-core's tracked streams: ``rng_state``). So a checkpoint resumes under any
language TP/PP/DP and encoder DP with the same global batch size, continuing the sample stream
(the loader position counts samples, not ranks); the RNG states are restored only under the
same layout (nothing in training draws from them but dropout, 0 in mimo_train).

A checkpoint is used only after its files match the manifest (``checkpoint_fit.check`` then
``load``, two start-up phases so that no rank waits in a collective another rank has left; the
reading ranks share the hashing): a damaged or partial one is refused on every rank with one
message naming the file and the newest earlier checkpoint to use instead.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mimo_data.files import write_atomic
from mimo_data.shards.format import INDEX_FILE, SAMPLES_FILE
from mimo_train.checkpoint_folders import (LATEST, MANIFEST, META, STEP_NAME, complete_steps,
                                           damaged, holds_a_save, is_model_folder, latest,
                                           meta_of, read_meta, resume_point, step_dir)
from mimo_train.components import checkpoint_owner, digests
from mimo_train.components.checkpoint_fit import module_of
from mimo_train.components.optimizer import schedule_changes
from mimo_train.components.optimizer_state import (OPTIMIZER_METADATA, common_as,
                                                   main_weights_from, settings_as)
from mimo_train.errors import CheckpointError, IntegrityError
from mimo_train.model.lora import is_adapter
from mimo_train.runtime import distributed
from mimo_train.runtime.console import PREFIX, say
from mimo_train.mcore import (AsyncCallsQueue, FullyParallelSaveStrategyWrapper,
                              LocalNonpersistentObject, ShardedBase, ShardedObject,
                              StrictHandling, dist_checkpointing,
                              extract_matching_values, get_cuda_rng_tracker,
                              get_default_save_sharded_strategy, get_gpt_layer_local_spec,
                              load_plain_tensors, merge)
from mimo_train.mcore.async_save import (then_in_writer, use_forked_write_results,
                                         writer_failure, writer_left_nothing)
from mimo_train.mcore.gated_delta_net import joined_sections
from mimo_train.mcore.distributed_optimizer import unshare_steps
from mimo_train.mcore.fused_adam import use_fused_adam

# the language model's layers: stacked (``decoder.layers.<param>``) or, where they differ (a
# hybrid decoder's, megatron-core's ``non_homogeneous_layers``), one by one
_LAYERS = re.compile(r"^(decoder\.layers\.)(\d+\.)?(.*)$")
# megatron-core saves a MoE layer's experts (``SequentialMLP``'s ``local_experts.<e>.``) stacked
# along the expert axis under this name
_EXPERTS_SAVED = "mlp.experts.experts."


@dataclass
class TrainingState:
    """What a checkpoint holds for this rank."""
    model: Any                       # MimoModel with this rank's (DDP-wrapped) modules
    optimizers: dict                 # trained module name -> its megatron-core optimizer
    schedulers: dict                 # trained module name -> OptimizerParamScheduler
    loader: Any                      # RankLoader, None on ranks without data


def check_folder(root: str, resume: bool) -> None:
    """Rank 0, before the model is built: ``CheckpointError`` where ``root`` cannot be this
    run's ``checkpoint.dir`` or holds nothing a resume can take (nothing written).
    ``prepare`` asks again as it claims it."""
    _check_kind(root)
    _check_writable(root)
    _check_free(root, resume)
    if resume:
        resume_point(root)


def _check_writable(root: str) -> None:
    """``CheckpointError`` where ``root``, or the folder it would be made in, takes no writes
    (a read-only file system, another user's folder, a file on its path): looked at, nothing
    made (``prepare`` writes there, once the model is built)."""
    where = os.path.abspath(root)
    while not os.path.lexists(where):
        where = os.path.dirname(where)
    if os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK):
        return
    why = f"{where} is a link to {os.readlink(where)}, which is not there" \
        if os.path.islink(where) and not os.path.exists(where) else \
        f"{where} is a file" if not os.path.isdir(where) else \
        f"{where} takes no writes: read-only, or not this user's"
    raise CheckpointError(f"checkpoint.dir {root} cannot be written here ({why}): give a "
                          "writable checkpoint.dir")


def _check_kind(root: str) -> None:
    """``CheckpointError`` where ``root`` is a model folder, one step's checkpoint, a dataset
    or a file: a run would write its steps among what it holds."""
    if holds_a_save(root):
        raise CheckpointError(
            f"checkpoint.dir {root} is one step's checkpoint, not a run's checkpoint.dir (the "
            "folder of its step_NNNNNNN folders): to resume that run give its checkpoint.dir, "
            f"{os.path.dirname(os.path.abspath(root))}; to start a new run from its weights set "
            f"model.init_from={root} and give checkpoint.dir another folder")
    if any(os.path.isfile(os.path.join(root, name)) for name in (INDEX_FILE, SAMPLES_FILE)):
        raise CheckpointError(
            f"checkpoint.dir {root} is a dataset (its {INDEX_FILE}, {SAMPLES_FILE}): give "
            "checkpoint.dir a folder of its own, not among the shards (a rebuild with "
            "--overwrite would delete the checkpoints, a copy of the dataset carry them)")
    if is_model_folder(root):
        raise CheckpointError(
            f"checkpoint.dir {root} is a transformers model folder (config.json and its "
            "weights), not mimo's checkpoints: checkpoint.dir is where the run saves its own "
            f"steps, in a folder of their own. To start from these weights, set "
            f"model.pretrained={root} and give checkpoint.dir another folder")
    if os.path.isfile(root):
        raise CheckpointError(f"checkpoint.dir {root} is a file: give a folder (the run saves "
                              "its steps in it)")


def _check_free(root: str, resume: bool) -> None:
    """``CheckpointError`` where another run writes ``root``, or where this run starts over
    among an earlier run's steps."""
    checkpoint_owner.check(root)            # another run's folder: said before all else
    if not resume and os.path.isdir(root):
        _refuse_earlier_steps(root)


def prepare(root: str, resume: bool) -> str | None:
    """Start-up of a run with ``checkpoint.dir`` ``root``: the folder made and written to (a
    save that cannot write fails here, not at the first checkpoint, hours in), then what it
    resumes (``resume_point``; None without ``resume``). Rank 0 claims the folder for the run
    (``checkpoint_owner``)."""
    _check_kind(root)
    probe = os.path.join(root, f".write-test-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise CheckpointError(f"checkpoint.dir {root} cannot be written here ({error}): give "
                              "a writable checkpoint.dir") from None
    if distributed.rank_and_size()[0] == 0:
        _check_free(root, resume)
    found = resume_point(root) if resume else None
    if distributed.rank_and_size()[0] == 0:     # once nothing else refuses the folder
        checkpoint_owner.claim(root)
        if resume and found is None:
            _say_unfinished(root)
    return found


def _say_unfinished(root: str) -> None:
    """A run resuming from a checkpoint.dir that holds only unfinished saves starts over:
    said, as a resume would be."""
    unfinished = sorted(name for name in os.listdir(root) if re.fullmatch(STEP_NAME, name)
                        and os.path.isdir(os.path.join(root, name)))
    if unfinished:
        say(f"{PREFIX}checkpoint.dir {root} holds {', '.join(unfinished[-3:])} with no "
            f"{MANIFEST} (a save that did not finish): nothing to resume, the run starts at "
            "step 1")


def unclaim(root: str) -> None:
    """Rank 0, once the run that claimed ``root`` has ended (or its start-up failed: a
    damaged checkpoint refused): its claim removed, so that the next run may take the folder
    at once, from any host."""
    if distributed.rank_and_size()[0] == 0:
        checkpoint_owner.release(root)


def _refuse_earlier_steps(root: str) -> None:
    """CheckpointError where ``root`` holds step folders and the run starts over
    (``checkpoint.resume: false``): its saves would replace the steps of the same numbers,
    leave the later ones and move ``latest`` between the two runs."""
    steps = complete_steps(root)
    if steps:
        raise CheckpointError(
            f"checkpoint.dir {root} holds an earlier run's checkpoints ({', '.join(steps[-3:])})"
            " and checkpoint.resume is false: this run's checkpoints would replace some of "
            "them and sit among the others; give a new checkpoint.dir, or remove them "
            f"(`rm -r {os.path.join(root, 'step_*')} {os.path.join(root, LATEST)}`) to start "
            "over there; to continue them, leave checkpoint.resume true")


# ------------------------------------------------------------------------------------- save

class Saver:
    """Writes checkpoints (collective: every rank calls each method at the same step).

    ``asynchronous``: ``save`` returns once the state is handed to a forked writer process per
    rank (a fork is a copy-on-write snapshot: the step loop may change the weights meanwhile);
    ``poll`` after each step finalizes a save every rank has finished writing (manifest, then
    ``latest``). Otherwise ``save`` writes and finalizes before it returns. One save is in
    flight at a time: the next waits for the previous."""

    def __init__(self, root: str, asynchronous: bool, keep_last: int | None = None,
                 resumed: str | None = None):
        """``keep_last``: once a save is complete, older checkpoints beyond the newest
        ``keep_last`` are deleted (``prune``); None: all are kept. ``resumed``: the step
        directory the run resumed: complete checkpoints after it (of a continuation set back
        from) are said, and with those its ``meta.json`` names so (``SET_BACK_FROM``: set back
        from before it), neither counted nor deleted by ``prune`` unless this run writes
        them; each save's ``meta.json`` names them on."""
        use_forked_write_results()
        self.root, self.keep_last = root, keep_last
        self.queue = AsyncCallsQueue() if asynchronous else None
        self.pending: list[str] = []       # directories being written, oldest first
        self.abandoned: set[str] = set()
        if resumed:
            name = os.path.basename(resumed)
            later = [each for each in complete_steps(root) if each > name]
            self.abandoned = set(later) | set((meta_of(resumed) or {}).get(SET_BACK_FROM, []))
            if later:
                say(f"{PREFIX}{root} holds step folders after {name}, which this run "
                    f"resumed: {', '.join(later[:4])}{' ...' if len(later) > 4 else ''} (the "
                    "run that went on from it, set back by latest): this run writes its own "
                    "over those it reaches, and checkpoint.keep_last neither counts nor deletes "
                    "the others")

    def save(self, step: int, state: TrainingState, meta: dict) -> str:
        """Start (or, synchronously, do) the save of ``state`` at ``step``; its directory."""
        self.wait()
        directory = step_dir(self.root, step)
        self.abandoned.discard(os.path.basename(directory))     # this run's own now
        request = _save_request(self.root, directory, step, state,
                                {**meta, SET_BACK_FROM: sorted(self.abandoned)}
                                if self.abandoned else meta, self.keep_last,
                                frozenset(self.abandoned))
        if self.queue is None:
            try:
                request.execute_sync()
            except CheckpointException as error:
                raise _writers_cause(error, directory) from None
            except OSError as error:    # rank 0's at finalization: .metadata, metadata.json
                raise _save_failed(error, directory) from None
            return directory
        self.queue.schedule_async_request(request)
        self.pending.append(directory)
        return directory

    def poll(self) -> list[str]:
        """The directories whose save completed since the last call (non-blocking); after
        each step: rank 0 renews the run's claim on the folder meanwhile."""
        if distributed.rank_and_size()[0] == 0:
            checkpoint_owner.refresh(self.root)
        return self._finalize(blocking=False)

    def release(self) -> None:
        """Once the run has ended and ``wait`` returned: its claim on the folder removed."""
        unclaim(self.root)

    def wait(self) -> list[str]:
        """Block until the save in flight, if any, is complete; its directory."""
        return self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> list[str]:
        if self.queue is None or not self.pending:
            return []
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointException as error:
            raise _writers_cause(error, self.pending[0]) from None
        except OSError as error:        # rank 0's at finalization, as in a synchronous save
            raise _save_failed(error, self.pending[0]) from None
        finished, self.pending = self.pending[:len(done)], self.pending[len(done):]
        return finished


# meta.json's list of the complete checkpoints of continuations the run was set back from
SET_BACK_FROM = "set_back_from"


def prune(root: str, keep_last: int, current: str,
          abandoned: frozenset[str] = frozenset()) -> list[str]:
    """Delete the step directories of ``root`` older than its newest ``keep_last`` complete
    checkpoints up to ``current`` (the one just completed, which ``latest`` names), but the
    ``abandoned`` ones (complete checkpoints of a continuation the run was set back from:
    neither counted nor deleted; interrupted saves are anyone's); never ``current``, the one
    ``latest`` names, nor one after ``current`` (being written, or a run's that resumed an
    earlier one). Rank 0, once ``latest`` is written; the deleted directories."""
    names = sorted(name for name in os.listdir(root) if re.fullmatch(STEP_NAME, name))

    done = set(complete_steps(root))
    upto = [name for name in names if name <= os.path.basename(current) and (
        name not in abandoned or name not in done)]
    complete_ones = [name for name in upto if name in done]
    kept = set(complete_ones[-keep_last:]) | {os.path.basename(current)}
    named = latest(root)
    if named:
        kept.add(os.path.basename(named))
    oldest = min(kept)
    deleted = [os.path.join(root, name) for name in upto if name < oldest]
    for directory in deleted:
        shutil.rmtree(directory, ignore_errors=True)
    return deleted


def _writers_cause(error: CheckpointException, directory: str) -> Exception:
    """What made a save fail (a full disk's OSError ...; a rank's writer process killed):
    torch's CheckpointException is a BaseException, which the run's handlers (one message, not
    a traceback from every rank) leave alone. A writer's own exception is this rank's
    (``writer_failure``), else the first failing rank's as megatron-core's coordinator has it
    (``_written``)."""
    own = writer_failure()
    died = [rank for rank, (failure, _) in sorted(error.failures.items())
            if str(failure) == _NO_RESULTS]
    if writer_left_nothing():                   # this rank's (only the coordinator is told)
        died = sorted({*died, dist.get_rank()})
    if died:
        return CheckpointError(
            f"writing {directory}: the checkpoint writer process of rank {died[0]} ended "
            "without reporting its part (killed: out of memory? the host's kernel log "
            "says): this checkpoint is incomplete, latest not moved to it (a resume "
            "loads the one before, if any); with checkpoint.async_save each writer holds a "
            "copy of the rank's state in host memory: give the ranks more, or save "
            "synchronously (checkpoint.async_save false)", damaged=True)
    gathered = (_written(failure) for _, (failure, _) in sorted(error.failures.items())
                if isinstance(failure, Exception))
    cause = own or next(gathered, CheckpointError(
        f"writing {directory} failed on another rank ({error.args[0]}; megatron-core tells "
        "only rank 0 which and why): rank 0's line says it"))
    return _save_failed(cause, directory)


# megatron-core's words for a writer's exception (``retrieve_write_results``: a RuntimeError
# raised from it), and an OSError's text in them
_WORKER_FAILURE = "Worker failure: "
_OS_ERROR = re.compile(r"\[Errno (\d+)\] (.*)", re.DOTALL)


def _written(failure: Exception) -> Exception:
    """The writer's exception behind megatron-core's RuntimeError around it: its cause, or,
    where it came from another rank (pickled: the text alone), an OSError of the same errno
    and text (``OSError(errno, text)`` is that errno's subclass: PermissionError ...)."""
    if not isinstance(failure, RuntimeError) or not str(failure).startswith(_WORKER_FAILURE):
        return failure
    if isinstance(failure.__cause__, Exception):
        return failure.__cause__
    text = _OS_ERROR.fullmatch(str(failure)[len(_WORKER_FAILURE):])
    return OSError(int(text[1]), text[2]) if text else failure


# torch's zip writer (torch.save, which megatron-core's writer calls) says a short write, a
# full disk's or a quota's, as a RuntimeError of its C++ check, not an OSError
_SHORT_WRITE = re.compile(r"enforce fail at inline_container\.cc.*unexpected pos", re.DOTALL)


def _no_space(error: Exception, directory: str) -> CheckpointError | None:
    """A full file system's OSError (which names no file), or torch's zip writer's short
    write, as the step folder being written, the space free and what to do; None for any
    other error."""
    enospc = isinstance(error, OSError) and error.errno == errno.ENOSPC
    if not (enospc or isinstance(error, RuntimeError) and _SHORT_WRITE.search(str(error))):
        return None
    try:
        free = f" ({shutil.disk_usage(os.path.dirname(directory)).free / 2**30:.1f} GiB " \
            "free now)"
    except OSError:
        free = ""
    said = "no space left on its file system" if enospc else (
        f"torch's file writer wrote less than it was given ({str(error).strip()}), as on a "
        "full file system or past a quota")
    return CheckpointError(
        f"writing {directory}: {said}{free}: this checkpoint is incomplete, latest not moved "
        "to it (a resume loads the one before, if any, and ignores this one: it may be "
        "deleted); free space there, keep fewer checkpoints (checkpoint.keep_last), or give "
        "checkpoint.dir a larger file system",
        damaged=True)


def _save_failed(error: Exception, directory: str) -> Exception:
    """A save's failure as the user reads it: a full file system's (``_no_space``); any
    other OSError (a read-only or vanished file system, no permission) as the file and what
    was left, the checkpoint incomplete; another error as it is."""
    if (full := _no_space(error, directory)) is not None:
        return full
    if not isinstance(error, OSError):
        return error
    where = f" ({error.filename})" if error.filename else ""
    return CheckpointError(
        f"writing {directory}: {error.strerror or error}{where}: this checkpoint is "
        "incomplete, latest not moved to it (a resume loads the one before, if any, and "
        "ignores this one: it may be deleted); checkpoint.dir must be a folder every rank "
        "can write to", damaged=True)


# megatron-core's words for a write's results that never came (its writer died first)
_NO_RESULTS = "results_queue should not be empty"


def _save_request(root: str, directory: str, step: int, state: TrainingState, meta: dict,
                  keep_last: int | None = None, abandoned: frozenset[str] = frozenset()):
    """megatron-core's request for the save of ``state`` into ``directory`` (collective), its
    write extended by the writer's digests and its finalization by ``meta.json``, the manifest
    and ``latest`` (rank 0), in that order, then (``keep_last``) ``prune``."""
    rank = dist.get_rank()
    refusal: tuple[str, bool] | None = None       # why not, and whether the save failed
    if rank == 0:
        lost = checkpoint_owner.lost(root)
        refusal = (lost, False) if lost else None
    if rank == 0 and refusal is None:     # what an interrupted save at this step left
        shutil.rmtree(directory, ignore_errors=True)
        try:
            os.makedirs(directory)
        except OSError as error:
            refusal = (f"checkpoint {directory} cannot be made ({error.strerror}; rank 0 makes "
                       "it): nothing of it is written, latest not moved (a resume loads the "
                       "one before, if any); checkpoint.dir must be a folder rank 0 can write "
                       "to, with nothing else in a step folder's place", True)
    refusal = distributed.broadcast(refusal, src=0)     # every rank stops, none waits
    if refusal:
        raise CheckpointError(refusal[0], damaged=refusal[1])
    # Fully parallel: each replicated tensor (a data-parallel replica's weights and optimizer
    # state) is written by one of its holders, spread over the world, not all by rank 0.
    request = dist_checkpointing.save(
        _sharded(state, step, is_loading=False, rng=True), directory,
        FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy()),
        async_sharded_save=True, async_strategy="mcore")

    def finalize() -> None:
        problem: str | None = None
        if rank == 0:
            # (an asynchronous save ends steps later: the folder may have been taken since)
            problem = checkpoint_owner.lost(root)
            try:
                if problem is None:
                    write_atomic(os.path.join(directory, META),
                                 json.dumps(meta, indent=1).encode())
                    digests.write_manifest(directory)
                    write_atomic(os.path.join(root, LATEST),
                                 os.path.basename(directory).encode())
            except (IntegrityError, OSError) as error:
                problem = f"{type(error).__name__}: {error}"
        problem = distributed.broadcast(problem, src=0)    # every rank stops, none waits
        if problem:
            raise CheckpointError(f"checkpoint {directory} was not completed ({problem}); "
                                  f"{LATEST} still names the previous one")
        if rank == 0 and keep_last:       # the others go on to the next collective
            try:
                prune(root, keep_last, directory, abandoned)
            except OSError as error:      # the checkpoint is complete: the run goes on
                say(f"{PREFIX}checkpoint.keep_last {keep_last}: old checkpoints in {root} "
                    f"not deleted ({type(error).__name__}: {error})")

    request.add_finalize_fn(finalize)
    # the digests of this rank's files where they were written (in the writer process of an
    # asynchronous save: the step loop does not wait for either)
    return then_in_writer(request, digests.write_part, directory, rank)


def _sharded(state: TrainingState, step: int, is_loading: bool, rng: bool) -> dict:
    """The sharded state dict of ``state`` (collective: the single objects' writers are agreed
    on). ``rng``: include this rank's RNG state (keyed by rank: only under the same layout).

    The optimizers are the trained modules' (``MimoOptimizer.sharded_state_dict`` would also
    ask a frozen module's, which has no state). megatron-core saves what is not sharded
    (``common_state``) from rank 0 alone, so each optimizer's unsharded part (its step, param
    groups), which in a non-colocated layout only the module's ranks have, becomes a single
    object of its own (``load`` merges it back)."""
    model = state.model.sharded_state_dict()
    singles: dict = {f"scheduler.{name}": scheduler.state_dict()
                     for name, scheduler in state.schedulers.items()}
    optimizer = {}
    for name, module_optimizer in state.optimizers.items():
        common, optimizer[name] = extract_matching_values(
            module_optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                metadata=OPTIMIZER_METADATA), _unsharded)
        if common:
            singles[f"optimizer.{name}"] = common
    if state.loader is not None:
        singles["loader"] = state.loader.state_dict()
    writers = _first_holders(sorted(singles))
    sharded: dict = {
        "step": step, "model": model,
        "singles": {key: ShardedObject(key, value, (1,), (0,),
                                       replica_id=0 if writers[key] else 1)
                    for key, value in singles.items()}}
    if optimizer:       # a rank holding only frozen modules has none (an empty dict would be
        sharded["optimizer"] = optimizer    # common state that rank 0 alone holds)
    if rng:
        sharded["rng"] = ShardedObject("rng", rng_state(), (dist.get_world_size(),),
                                       (dist.get_rank(),), replica_id=0)
    return sharded


def rng_state() -> dict:
    """This rank's RNG states: the CPU generator's and, with CUDA, the device generator's and
    megatron-core's tracked CUDA streams (model-parallel, data-parallel, expert)."""
    state: dict = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state) -> None:
    """Restore what ``rng_state`` returned (or the CPU state alone, which earlier versions
    saved); CUDA states only where CUDA runs."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["tracker"])


def _unsharded(value) -> bool:
    return not isinstance(value, (ShardedBase, LocalNonpersistentObject))


def _first_holders(keys: list[str]) -> dict[str, bool]:
    """key -> whether this rank is the lowest rank holding it (it writes the object once)."""
    held = distributed.gather(keys)
    return {key: next(r for r, ks in enumerate(held) if key in ks) == dist.get_rank()
            for key in keys}


# ------------------------------------------------------------------------------------- load

def load(directory: str, state: TrainingState, meta: dict,
         meta_expected: dict) -> tuple[int, dict]:
    """Load ``state`` from the checkpoint ``check`` accepted (collective); returns its step and
    how this rank's LR schedules and Adam betas differ from the checkpoint's (they follow this
    run's config): module -> ``optimizer.schedule_changes`` and ``settings_as``."""
    same_layout = all(meta.get(key) == meta_expected[key] for key in ("layout", "world_size"))
    sharded = _sharded(state, 0, is_loading=True, rng=same_layout)
    own = {name: sharded["singles"][f"optimizer.{name}"].data for name in state.optimizers
           if f"optimizer.{name}" in sharded["singles"]}
    reload = main_weights_from(sharded.get("optimizer", {}),
                                dist_checkpointing.load_tensors_metadata(directory))
    loaded = _load(sharded, directory, "resume")
    singles = loaded["singles"]
    state.model.load_state_dict(loaded["model"])
    betas = {}
    for name, module_optimizer in state.optimizers.items():
        optimizer = loaded["optimizer"][name]
        if f"optimizer.{name}" in singles:
            merge(optimizer, common_as(singles[f"optimizer.{name}"], own[name]))
        betas[name] = settings_as(optimizer, module_optimizer)
        module_optimizer.load_state_dict(optimizer)
        unshare_steps(module_optimizer)
        use_fused_adam(module_optimizer)          # the checkpoint's groups say otherwise
        if name in reload:
            module_optimizer.reload_model_params()
    changes = {}
    for name, scheduler in state.schedulers.items():
        changes[name] = {**schedule_changes(singles[f"scheduler.{name}"], scheduler),
                         **betas.get(name, {})}
        scheduler.load_state_dict(singles[f"scheduler.{name}"])
    if state.loader is not None:
        state.loader.load_state_dict(singles["loader"])
    if same_layout:
        set_rng_state(loaded["rng"])
    return loaded["step"], changes


def load_model(directory: str, model) -> None:
    """``model.init_from``: the weights of this rank's modules from any checkpoint, whatever
    layout saved it (collective; ``check`` first); LoRA adapters it does not hold (a full
    checkpoint starting a LoRA run) keep their init."""
    saved = dist_checkpointing.load_tensors_metadata(directory)
    sharded = model.sharded_state_dict()
    kept = [key for key, value in sharded.items()
            if is_adapter(key) and not _held(getattr(value, "key", None), saved)]
    loaded = _load({"model": {k: v for k, v in sharded.items() if k not in kept}}, directory,
                   "model.init_from")["model"]
    result = model.load_state_dict(loaded, strict=not kept)
    missing = [key for key in result.missing_keys if not is_adapter(key)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"model.init_from: {directory} does not fit this model: missing "
                              f"{missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def _held(key: str | None, saved) -> bool:
    """Whether the checkpoint's tensors ``saved`` hold ``key``, whole or in sections
    (``<key>.<section>``: a gated delta-net's ``in_proj`` and its adapter's B)."""
    return key in saved or any(k.startswith(f"{key}.") for k in saved)


def _load(sharded: dict, directory: str, purpose: str) -> dict:
    """Verify the files against the manifest (the ranks share the hashing and the verdict)
    and load ``sharded``; a tensor this rank asks for that the checkpoint lacks is an error
    raised after the collective load, so no rank is left waiting."""
    try:
        digests.verify(directory)
    except IntegrityError as error:
        raise damaged(directory, str(error), init_from=purpose == "model.init_from") from None
    loaded, _missing, unexpected = dist_checkpointing.load(
        sharded, directory, strict=StrictHandling.RETURN_ALL)
    if unexpected:
        keys = sorted(unexpected)
        raise CheckpointError(
            f"{purpose}: checkpoint {directory} lacks {len(keys)} tensor(s) this model needs, "
            f"e.g. {keys[:3]}: it was saved for another model (modules, frozen modules or "
            "sizes differ)")
    return loaded


def load_weights(directory: str) -> dict:
    """module name -> {its unwrapped state-dict key, global layer numbers -> whole tensor}, read
    in one process from a checkpoint of any layout (mimo-export)."""
    read_meta(directory)
    try:
        with distributed.alone():
            digests.verify(directory)
            tensors = load_plain_tensors(directory)
    except IntegrityError as error:
        raise damaged(directory, str(error)) from None
    except CheckpointException as error:    # torch's reader wraps a Ctrl-C: one again
        if any(isinstance(failure, KeyboardInterrupt) for failure, _ in error.failures.values()):
            raise KeyboardInterrupt from None
        raise
    weights: dict = {}
    for key, tensor in tensors.items():
        found = module_of(key)
        if found is not None:
            weights.setdefault(found[0], {}).update(_unstacked(found[1], tensor))
    return {module: joined_sections(state) for module, state in weights.items()}


def _unstacked(key: str, tensor: torch.Tensor) -> dict:
    """The language model's layers as saved, stacked (``decoder.layers.<param>``, the layer
    index as the first axis of the global tensor) or one by one (``decoder.layers.<i>.<param>``)
    under the names megatron-core's layer spec maps them to (``sharded_state_dict_keys_map``:
    the local spec's ``input_layernorm.`` is saved as TransformerEngine's
    ``self_attention.linear_qkv.layer_norm_``; a MoE layer's experts stacked once more,
    ``_EXPERTS_SAVED``): one entry per layer (and expert) as in the module's state dict
    (``decoder.layers.<i>.<param>``); other keys as they are."""
    match = _LAYERS.match(key)
    if match is None:
        return {key: tensor}
    param = match[3]
    for local, saved in get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.items():
        if param.startswith(saved):
            param = local + param[len(saved):]
    layers = [(int(match[2][:-1]), tensor)] if match[2] else enumerate(tensor.unbind(0))
    if param.startswith(_EXPERTS_SAVED):   # a MoE layer's experts: stacked once more
        name = param[len(_EXPERTS_SAVED):]
        return {f"{match[1]}{index}.mlp.experts.local_experts.{e}.{name}": weight.clone()
                for index, layer in layers for e, weight in enumerate(layer.unbind(0))}
    return {f"{match[1]}{index}.{param}": layer.clone() for index, layer in layers}
