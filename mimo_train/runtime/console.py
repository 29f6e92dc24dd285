"""What training prints besides the step lines: start-up phases, failures, third-party noise.

- ``quiet_third_party()``: the one place where known, harmless warnings of megatron-core, torch
  and transformers are filtered, each by its exact message (and category or logger), so any
  other warning still shows. Called on every rank first thing (``cli``, ``mcore``), and by
  ``mimo-generate``.
- ``phase(name, done, function)``: one start-up phase on every rank; all ranks agree on success
  (over the gloo control group: ``distributed``), rank 0 prints
  ``mimo-train: <done> (<seconds> s)``. A failure anywhere raises ``StartupError``
  on every rank with every rank's reason; ``report_failure`` prints it once (rank 0).
- ``run_failure(error, ...)`` / ``report_run_failure``: a failure in the middle of the run
  (a damaged sample, storage, a checkpoint save, the GPU's memory running out, torch's or
  NCCL's, with what would lower it: ``out_of_gpu_memory``, a peer rank that died, a bug) as
  one message naming the rank, the step and the cause, printed once in the job (the first
  rank to record its failure in torchrun's store: ``distributed.claim_failure``), also as the
  root cause of torchrun's own report; ranks that only lost their peers print nothing after
  it.

Nothing here imports torch at module level: the CLI uses it before parsing arguments.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Sequence

from mimo_train.errors import RunError, StartupError

PREFIX = "mimo-train: "
# where a rank that left without a message is named: its node's torchrun reports it, unless
# the node went with its agent (a machine lost), which leaves no report
LOST_NAMED = ("the torchrun report on its node names it (none where the whole node was lost: "
              "look for the node whose log stops first)")

# (category, message regex, module regex) for warnings.filterwarnings: each one is printed by
# every rank of every run and says nothing a user can act on.
_WARNINGS = (
    # megatron-core without TransformerEngine / Apex (CPU runs, plain GPU installs)
    (UserWarning, r"Transformer Engine and Apex are not installed\. Falling back to ",
     r"megatron\."),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm", r"megatron\."),
    # MimoModel and its parts are marked experimental (the warning points at the caller)
    (UserWarning, r"(MimoModel|MimoModelConfig|ModalitySubmodules|MimoOptimizer) is "
     r"experimental and still under active development\.", r""),
    # megatron-core's own default of TransformerConfig.cuda_graph_scope
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules", r"megatron\."),
    # the pipeline communicator's broadcast inside autograd (megatron-core, gloo and NCCL)
    (UserWarning, r"c10d::broadcast_: an autograd kernel was not registered to the Autograd "
     r"key\(s\)", r"torch\.autograd"),
    # a frozen module's optimizer has no parameters (model.freeze)
    (UserWarning, r"WARNING: there is no optimizer on RANK \d+\. This may be expected if you "
     r"have frozen sub-models", r"megatron\."),
    # torch.distributed.checkpoint under megatron-core's checkpoint loading: single-process
    # reads (rank 0's common state, the tensor index), its own argument order and the
    # ShardedTensor type megatron-core's torch_dist format still uses
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
     r"intent is to load in a single process", r"torch\.distributed\.checkpoint"),
    (UserWarning, r"The argument order of load has been changed\.",
     r"torch\.distributed\.checkpoint"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor\.",
     r"torch\.distributed\.checkpoint"),
    # torch and megatron-core deprecations that only their next versions act on
    (FutureWarning, r"`torch\.cuda\.amp\.custom_(fwd|bwd)\(args\.\.\.\)` is deprecated",
     r"megatron\."),
    (FutureWarning, r"`torch\.distributed\._(all_gather_base|reduce_scatter_base)` is a private "
     r"function and will be deprecated", r"megatron\."),
    (DeprecationWarning, r"`torch\.jit\.script(_method)?` is deprecated", r""),
    (DeprecationWarning, r"The following imports from `dynamic_context\.py` will be removed",
     r"megatron\."),
    # megatron-core's MLP built from the local spec, which passes no ffn_hidden_size
    (DeprecationWarning, r"MLP requires ffn_hidden_size, but it was not provided",
     r"megatron\."),
    # selective recompute's core_attn: about TransformerEngine's fused attention, which mimo's
    # local layer specs do not use
    (UserWarning, r"If you are using transformer_engine as the transformer implementation, "
     r"the core_attn is from transformer_engine", r"megatron\."),
    # the experts' layers under etp1 beside the language model's tp (their linear layers are
    # whole, sequence parallelism is the attention's and the dense layers')
    (UserWarning, r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1\. "
     r"Disabling sequence parallel\.", r"megatron\."),
    # the distributed optimizer's DDP reads each main gradient's .grad (megatron-core; on the
    # CPU through mcore.cpu_compat's mode, which the warning then names)
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being "
     r"accessed", r"megatron\.|mimo_train\.mcore\.cpu_compat"),
)
# only where no CUDA device runs: advice about CUDA streams
_CPU_WARNINGS = (
    (UserWarning, r"When using (sequence parallelism|async grad allreduce) it is recommended "
     r"to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\."),
)

# logger name -> message regexes dropped from it (warnings sent through ``logging``)
_LOG_RECORDS = {
    "torch.utils.cpp_extension": (r"No CUDA runtime is found, using CUDA_HOME=",),
    "megatron.core.utils": (r"is not installed", r"Transformer Engine"),
    "megatron.core.transformer.transformer_config": (r"cuda_graph", r"is not installed"),
    "megatron.core.models.mimo": (r"experimental",),
    # logged whenever a checkpoint is saved, asynchronously or not
    "megatron.core.dist_checkpointing.strategies.torch": (r"MCore's async save is deprecated",),
    # GPTModel is what MimoModel's language model is in megatron-core 0.19
    "megatron.core.models.gpt.gpt_model": (r"^GPTModel IS DEPRECATED\.",),
    # the distributed optimizer's DDP computes its layout itself (MimoOptimizer builds it so)
    "megatron.core.distributed.distributed_data_parallel": (r"full_param_layout not provided",),
}

# only where no CUDA device runs: transformers' advice to install GPU kernels (fla's gated
# delta rule, causal-conv1d's convolution) for a Qwen3.5 model it runs (mimo-generate)
_CPU_LOG_RECORDS = {
    "transformers.integrations.hub_kernels": (
        r"is falling back to its reference PyTorch implementation because",),
}

_quiet = False


class _DropKnown(logging.Filter):
    def __init__(self, patterns):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def quiet_third_party() -> None:
    """Filter the known third-party warnings (idempotent)."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    import torch
    for category, message, module in _WARNINGS + (
            () if torch.cuda.is_available() else _CPU_WARNINGS):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, patterns in _LOG_RECORDS.items():
        logging.getLogger(name).addFilter(_DropKnown(patterns))
    for name, patterns in ({} if torch.cuda.is_available() else _CPU_LOG_RECORDS).items():
        logging.getLogger(name).addFilter(_DropKnown(patterns))


def rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK``, else 0."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def say(message: str) -> None:
    """Print one line on rank 0."""
    if rank() == 0:
        print(message, flush=True)


# Exceptions a start-up phase turns into a gathered message; others are bugs: gathered too (a
# rank that stopped alone would leave the others in a collective), exit status 1, traceback.
EXPECTED = (ValueError, OSError, RuntimeError, KeyError)


# what megatron-core's build_module appends to any error raised in a module it builds: the
# class's name (one of mimo's private ones), which says nothing to a user
_BUILT_BY = re.compile(r"( when instantiating \w+)+$")


def agree(phase: str, function):
    """Run ``function`` on every rank; if it fails anywhere, raise ``StartupError`` everywhere.
    A bug's traceback is printed once, by the first rank it happened on."""
    from mimo_train.runtime import distributed
    details = None
    try:
        result, error = function(), None
    except Exception as exc:
        expected = isinstance(exc, EXPECTED)
        details = None if expected else "".join(traceback.format_exception(exc))
        # an error already gathered over the job's ranks (the token table's
        # ``gathered_failures``: message -> ranks) is said as it names them, not as every
        # rank's copy of it
        result, error = None, (f"{type(exc).__name__}: {_BUILT_BY.sub('', str(exc))}",
                               getattr(exc, "exit_code", None) if expected else 1, not expected,
                               getattr(exc, "gathered_failures", None))
    try:
        errors = distributed.gather(error)
    except Exception as exc:
        raise _lost_in_startup(exc, phase) from None
    failed: dict[str, list[int]] = {}
    codes: set[int | None] = set()
    for index, gathered in enumerate(errors):
        if gathered is not None:
            for message, ranks in (gathered[3] or {gathered[0]: [index]}).items():
                failed[message] = sorted(set(failed.get(message, [])) | set(ranks))
            codes.add(gathered[1])
    bugs = [index for index, gathered in enumerate(errors) if gathered and gathered[2]]
    if bugs:                                     # the traceback before rank 0's message
        if bugs[0] == rank():
            print(details, file=sys.stderr, end="", flush=True)
        distributed.barrier()
    if failed:
        lines = [f"  rank(s) {ranks}: {message}" for message, ranks in failed.items()]
        raise StartupError(f"mimo_train start-up failed ({phase}):\n" + "\n".join(lines), phase,
                           1 if 1 in codes else None)
    return result


def _lost_in_startup(error: Exception, phase: str) -> Exception:
    """A start-up agreement that failed: a peer that left the job (killed, out of memory, a
    signal before the run's handlers are up) as one ``RunError`` to report once, not a
    traceback from each rank; any other failure as it is."""
    if not _peer_lost(error):
        return error
    failure = RunError(f"start-up stopped in its {phase} phase on rank {rank()}: another rank "
                       f"left the job without a message ({str(error).splitlines()[0]}): killed, "
                       f"out of memory, or a signal before training began; {LOST_NAMED}")
    failure.peer_lost = True
    return failure


def phase(name: str, done, function, start: float | None = None):
    """``agree(name, function)``, then rank 0 prints ``done`` (text, or a function of the result)
    with the seconds since ``start`` (``time.perf_counter()``; default: now)."""
    start = time.perf_counter() if start is None else start
    result = agree(name, function)
    text = done(result) if callable(done) else done
    say(f"{PREFIX}{text} ({time.perf_counter() - start:.1f} s)")
    return result


def report_failure(error: StartupError) -> int:
    """Print a start-up failure once (rank 0) and wait for every rank; returns the exit code.

    Ranks exit only after rank 0 has printed: torchrun stops the others as soon as one exits."""
    import torch.distributed as dist

    from mimo_train.runtime import distributed
    if rank() == 0:
        print(f"{PREFIX}{error}", file=sys.stderr, flush=True)
    torchrun_error_file(str(error))            # whichever rank torchrun names its root cause
    if dist.is_initialized():
        distributed.barrier()
    return error.exit_code


def fail_before_setup(phase_name: str, error: Exception) -> int:
    """A failure before the trainer's process group exists (e.g. the config file): under
    torchrun the ranks still join a gloo group to print the gathered message once."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        print(f"{PREFIX}{error}", file=sys.stderr, flush=True)
        return StartupError("", phase_name).exit_code
    import torch

    from mimo_train.runtime import distributed
    distributed.init(torch.device("cpu"), failing=True)

    def fail():
        raise error
    try:
        agree(phase_name, fail)
    except StartupError as startup:
        return report_failure(startup)
    finally:
        distributed.destroy()
    return 2                                         # not reached: fail() always raises


# What a rank whose collective failed because a peer left waits for that peer's own report.
PEER_WAIT_S = 5.0
# A collective that failed because a peer rank left (gloo: the peer's sockets closed; NCCL:
# the watchdog's abort); torch raises these as DistError subclasses or RuntimeError.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|NCCL communicator was "
                        r"aborted|ProcessGroupNCCL.*(timeout|Timeout)|Socket Timeout")
# A collective that waited train.collective_timeout_minutes for a peer that did not come (a
# stalled rank: stuck reading storage, stopped, in a debugger); gloo's and NCCL's words
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation|Watchdog caught "
                        r"collective operation timeout")
# A DataLoader worker process that died without an exception (a signal: the kernel's
# out-of-memory killer's SIGKILL), as torch's DataLoader says it
_WORKER_DIED = re.compile(r"DataLoader worker \(pid(\(s\))? [\d, ]+\) (is killed by signal: "
                          r"(?P<signal>[^.]+)\.|exited unexpectedly)")
# DataLoader re-raises a worker's exception with the worker's traceback in the message
_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
# NCCL out of GPU memory for its own buffers (allocated beside torch's caching allocator, so
# torch's OutOfMemoryError never names it): torch raises a DistBackendError whose first line
# says "unhandled cuda error" and whose "Last error:" lines hold NCCL's, e.g. "Cuda failure 2
# 'out of memory'" (older NCCLs: "Cuda failure 'out of memory'", "Failed to CUDA calloc N bytes")
_NCCL_OUT_OF_MEMORY = re.compile(r"Cuda failure (\d+ )?'out of memory'|Failed to CUDA "
                                 r"(calloc|malloc)", re.IGNORECASE)


def _peer_lost(error: Exception) -> bool:
    """Whether a collective failed because a peer rank left (``_PEER_LOST``)."""
    import torch.distributed as dist
    return isinstance(error, dist.DistError) or bool(_PEER_LOST.search(str(error)))


def out_of_gpu_memory(error: Exception) -> bool:
    """Whether ``error`` is the GPU's memory running out: torch's allocator, or NCCL's."""
    import torch
    import torch.distributed as dist
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, dist.DistError) and bool(_NCCL_OUT_OF_MEMORY.search(str(error))))


def memory_cause(error: Exception) -> str:
    """An ``out_of_gpu_memory`` error's message as one line: NCCL's cause is in its last
    lines, joined to the others with "; "."""
    return "; ".join(line.strip() for line in _message(error).splitlines() if line.strip())


def run_failure(error: Exception, rank_: int, doing: str, where: str,
                memory_remedies: Sequence[str] = ()) -> RunError:
    """``error``, raised on rank ``rank_`` (holding ``where``) while ``doing`` (e.g. "step 4"),
    as the one message the job prints. mimo's own errors and OSError name their cause in
    their message, the GPU's memory running out with ``memory_remedies`` (what would lower
    this rank's); any other error is a bug and keeps its traceback."""
    cause = f"{type(error).__name__}: {_message(error)}"
    if out_of_gpu_memory(error):                         # the run's size, not a bug
        cause = f"{type(error).__name__}: {memory_cause(error)}"
        return RunError(f"training stopped in {doing} on rank {rank_} ({where}): out of GPU "
                        f"memory ({cause}); to fit, from this run's settings: " +
                        "; ".join(memory_remedies))
    if _TIMED_OUT.search(str(error)):
        return RunError(f"training stopped in {doing} on rank {rank_} ({where}): a collective "
                        "waited train.collective_timeout_minutes for another rank, which did "
                        "not come: a rank stalled (stuck reading storage, stopped, in a "
                        f"debugger?) ({cause.splitlines()[0]})")
    died = _WORKER_DIED.search(str(error))
    if died:
        why = ("out of shared memory: give the job a larger /dev/shm (a container's "
               "--shm-size), or lower data.num_workers" if died["signal"] == "Bus error" else
               "the kernel's out-of-memory killer? lower data.num_workers, or give the job "
               "more host memory")
        return RunError(f"training stopped in {doing} on rank {rank_} ({where}): a data loader "
                        f"worker of this rank died: {died.group(0)} ({why})")
    if _peer_lost(error):
        failure = RunError(f"training stopped in {doing} on rank {rank_} ({where}): a collective "
                           f"failed ({cause.splitlines()[0]}): another rank left the job "
                           "without a message (killed, out of memory, or a signal outside "
                           "train.exit_signals, such as a SIGINT to that rank alone?); "
                           f"{LOST_NAMED}")
        failure.peer_lost = True
        return failure
    ours = type(error).__module__.split(".")[0] in ("mimo_data", "mimo_train") or \
        isinstance(error, OSError)
    failure = RunError(f"training stopped in {doing} on rank {rank_} ({where}): {cause}")
    if not ours:
        failure.details = "".join(traceback.format_exception(error))
    return failure


def _message(error: Exception) -> str:
    """The error's own message, without a DataLoader worker's traceback around it."""
    text = str(error)
    if _WORKER_TRACEBACK in text:       # its last line: "[package.module.]Name: message"
        found = list(re.finditer(rf"\n(?:[\w.]+\.)?{re.escape(type(error).__name__)}: ",
                                 text))
        text = text[found[-1].end():] if found else text
    return text.strip()


def report_run_failure(error: RunError) -> int:
    """Print ``error`` unless another rank's failure was recorded first (then this rank exits
    quietly: its own failure follows from that one); returns the exit status. A rank that lost
    its peers first waits a little for the failing peer's record."""
    from mimo_train.runtime import distributed
    # torchrun stops the other ranks once one exits: this rank finishes its report first
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        first = distributed.claim_failure(str(error), PEER_WAIT_S if error.peer_lost else 0.0)
        if first:
            print(f"{PREFIX}{error}", file=sys.stderr, flush=True)
            if error.details:
                print(error.details, file=sys.stderr, end="", flush=True)
            torchrun_error_file(str(error))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return error.exit_code


def torchrun_error_file(message: str) -> None:
    """The failure as torchrun's root cause: its error file in torchelastic's JSON format
    (torchrun names the file in ``TORCHELASTIC_ERROR_FILE`` and prints the message in its
    report instead of "<N/A>")."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"message": {"message": f"{PREFIX}{message}", "extraInfo": {
            "py_callstack": f"{PREFIX}{message}", "timestamp": str(int(time.time()))}}}, f)
