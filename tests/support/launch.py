"""The suite's one launcher of multi-rank (and one-process) jobs. Tests import it; no test module
imports another.

- ``Ranks`` (the session fixture ``ranks`` in conftest.py): a pre-imported parent that forks
  ranks. One process imports torch, transformers and megatron-core once for the whole session
  (``serve``); each job forks ``nproc`` children from it with torchrun's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a store kept by a forked
  keeper, as torchrun's agent keeps its own) and runs a script or module as ``python`` would
  (``__main__``, ``sys.argv``). A rank's start-up costs a fork instead of several seconds of
  imports. Each rank's stdout and stderr go to files of the job's folder. For every run where
  torchrun itself is not what is tested.
- ``torchrun(...)``: real ``torchrun --standalone`` for what must go through its agent: signals
  and preemption, several nodes, the CLI's start-up and failure reports as users see them.
- ``python(...)``: a fresh interpreter, for what must not share the parent's imports.

Each returns a ``Job``: exit statuses and output.

Nothing any of them starts outlives the suite (tests/README.md, "Processes and temporary
files"): the parent ends every process a job left behind before it answers (it is their
reaper: ``PR_SET_CHILD_SUBREAPER``), it ends with its job when its creator dies or closes its
pipe (``PR_SET_PDEATHSIG``, end of file) or on SIGINT / SIGTERM / SIGHUP, and a torchrun or
python run still going when the test leaves it (a timeout, a failure, Ctrl-C) is killed with
everything in its session.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# what a job's processes need whatever the test: the repository and tests/ importable, one
# intra-op thread per rank (2 cores for all ranks)
BASE_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1"}
# imported once by the parent of forked ranks: what every job's ranks would import again
PRELOAD = ("torch", "torch.distributed", "transformers", "mimo_train.mcore",
           "mimo_train.training.trainer", "mimo_train.families.registry", "mimo_train.cli",
           "mimo_train.hf.export", "mimo_train.hf.generate", "mimo_data.loading.loader",
           "tensorboard", "transformers.models.qwen2_vl.modeling_qwen2_vl",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
           "transformers.models.llava.modeling_llava", "transformers.models.siglip",
           "transformers.models.whisper.modeling_whisper", "transformers.models.llama",
           "transformers.models.qwen2", "transformers.models.qwen3")
# loaded once by the parent of forked ranks (the preprocessing's shared tokenizers), which a
# job's every rank would load again (0.2-0.7 s each): the tokenizer folders set-up made, and
# the shipped preprocessing configs' (their modality tokens added)
TOKENIZERS = (*sorted(str(file.parent) for file in (REPO / "assets").glob("**/tokenizer.json")),
              *sorted(str(file) for file in (REPO / "configs").glob("preprocess*.yaml")))
# the parent's creator (the test process that started it), whose death ends the parent; and
# what it imports when not PRELOAD (comma-separated: tests/test_launch.py's parents import
# only torch.distributed, for the job's store), and which tokenizers it loads (a JSON list)
CREATOR_ENV, PRELOAD_ENV = "MIMO_TESTS_RANKS_CREATOR", "MIMO_TESTS_RANKS_PRELOAD"
TOKENIZERS_ENV = "MIMO_TESTS_RANKS_TOKENIZERS"
# Linux prctl(2) options
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


@dataclass
class Job:
    """A finished job: ``codes[r]`` is rank r's exit status (torchrun, python: one code, the
    process's), ``stdout`` / ``stderr`` what it printed (forked ranks: rank 0's), ``ranks``
    each rank's stderr (forked ranks; torchrun with ``log_dir``)."""
    codes: list[int]
    stdout: str = ""
    stderr: str = ""
    ranks: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def explain(self) -> str:
        """What to show when the job failed: exit codes and the end of each output."""
        parts = [f"exit codes {self.codes}", self.stdout[-3000:], self.stderr[-5000:]]
        parts += [f"--- rank {r} stderr ---\n{text[-3000:]}" for r, text in self.ranks.items()]
        return "\n".join(parts)

    def check(self) -> Job:
        """This job, asserted to have succeeded on every rank."""
        assert self.ok, self.explain()
        return self


class Ranks:
    """The pre-imported parent of forked ranks (``serve`` runs in it); one job at a time.
    ``preload``: the modules it imports (PRELOAD unless told); ``tokenizers``: the folders
    and preprocessing YAMLs whose tokenizers it loads (TOKENIZERS unless told). It
    dies with the thread that made it (``PR_SET_PDEATHSIG``: make it in the main thread, as a
    session fixture is)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD,
                 tokenizers: tuple[str, ...] = TOKENIZERS):
        env = {**os.environ, **BASE_ENV, CREATOR_ENV: str(os.getpid()),
               PRELOAD_ENV: ",".join(preload), TOKENIZERS_ENV: json.dumps(tokenizers)}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--serve"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            self._expect("ready", timeout=600)
        except BaseException:
            self.close()
            raise

    def run(self, nproc: int, argv: list, logs: Path, env: dict | None = None,
            timeout: float = 600) -> Job:
        """Run ``python ARGV`` (a script and its arguments, or ``-m MODULE ...``) as ranks
        0..nproc-1 of one job, each rank's output in ``logs/rank_R.out|err``. A job still
        running after ``timeout`` seconds is killed (its codes then read -9)."""
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        request = {"nproc": nproc, "argv": [str(a) for a in argv], "logs": str(logs),
                   "env": {k: str(v) for k, v in (env or {}).items()}}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pids = self._expect("pids", timeout=60)["pids"]
        try:
            codes = self._expect("codes", timeout=timeout)["codes"]
        except TimeoutError:
            for pid in pids:
                _kill_group(pid)
            codes = self._expect("codes", timeout=60)["codes"]
        read = {r: (logs / f"rank_{r}.err").read_text(errors="replace") for r in range(nproc)}
        return Job(codes, (logs / "rank_0.out").read_text(errors="replace"), read[0], read)

    def _expect(self, key: str, timeout: float) -> dict:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the rank parent gave no {key!r} in {timeout} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank parent exited ({self.process.wait()}) before {key!r}")
        message = json.loads(line)
        assert key in message, message
        return message

    def close(self) -> None:
        """End the parent: the end of its input (it then ends a job still running); SIGTERM
        (the same) if it has not exited a minute later, SIGKILL a minute after that."""
        if self.process.stdin:
            self.process.stdin.close()
        for stop in (None, self.process.terminate, self.process.kill):
            if stop:
                stop()
            try:
                self.process.wait(timeout=60)
                break
            except subprocess.TimeoutExpired:
                continue
        if self.process.stdout:
            self.process.stdout.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _kill_group(pid: int) -> None:
    """SIGKILL to the process group ``pid`` leads (a rank and what it forked)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ----------------------------------------------------------------- processes and their ends

def prctl(option: int, value: int) -> bool:
    """prctl(2) on Linux (False elsewhere, or when it failed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def adopt_orphans() -> None:
    """Make this process its descendants' reaper: a process whose parent ends before it is
    re-parented here instead of to init, where ``end_children`` finds it."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Get ``sig`` when the parent ends; exit now if ``parent`` has ended already."""
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os._exit(1)


def children(pid: int | None = None) -> dict[int, str]:
    """``{pid: state}`` of the processes whose parent is ``pid`` (this one unless told), from
    /proc; state ``Z``: ended, not yet reaped."""
    pid = os.getpid() if pid is None else pid
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):            # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found[int(stat.parent.name)] = fields[0]
    return found


def describe(pid: int) -> str:
    """A process's command line (for reports), or ``?`` once it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()[:300] or "?"
    except OSError:
        return "?"


def end_children(spare: tuple[int, ...] = ()) -> dict[int, str]:
    """SIGKILL every live child of this process but ``spare`` (with its process group when it
    leads one of its own), reap them, and again for the processes of theirs that come here
    (``adopt_orphans``) until none is left; ended children are only reaped. Returns
    ``{pid: command line}`` of those that were alive."""
    ended: dict[int, str] = {}
    while True:
        found = {pid: state for pid, state in children().items() if pid not in spare}
        live = [pid for pid, state in found.items() if state != "Z"]
        for pid in live:
            ended.setdefault(pid, describe(pid))
            try:
                leads = os.getpgid(pid) == pid != os.getpgrp()
            except ProcessLookupError:
                leads = False
            (_kill_group if leads else _kill)(pid)
        for pid in found:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:                     # reaped meanwhile
                pass
        if not live:
            return ended


@contextmanager
def session(command: list, **popen) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(command, **popen)`` in a session of its own, SIGKILLed with every
    process of that session when the block is left however (a failed assertion, a timeout,
    Ctrl-C), and reaped: a torchrun agent the test signals itself, say."""
    process = subprocess.Popen([str(c) for c in command], start_new_session=True, **popen)
    try:
        yield process
    finally:
        _kill_group(process.pid)
        process.wait()


def torchrun(nproc: int, argv: list, env: dict | None = None, timeout: float = 600,
             log_dir: Path | None = None) -> Job:
    """``torchrun --standalone --nproc-per-node NPROC ARGV``; ``log_dir``: torchrun's own
    per-rank log files (``--log-dir --redirects 3``), read into ``Job.ranks``."""
    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir is not None else []
    job = _process(torchrun_command(nproc, [*logs, *argv]), env, timeout)
    if log_dir is not None:
        job.ranks = {int(p.parent.name): p.read_text(errors="replace")
                     for p in Path(log_dir).glob("*/attempt_0/*/stderr.log")}
    return job


def torchrun_command(nproc: int, argv: list, rendezvous: list | None = None) -> list[str]:
    """The command line of ``torchrun --standalone --nproc-per-node NPROC ARGV`` (for tests
    that start it themselves: signals, several agents), ``rendezvous`` arguments instead of
    ``--standalone`` if given (``--nnodes 2 --node-rank R --rdzv-backend c10d ...``)."""
    return [sys.executable, "-m", "torch.distributed.run", *(rendezvous or ["--standalone"]),
            "--nproc-per-node", str(nproc), *map(str, argv)]


def python(argv: list, env: dict | None = None, timeout: float = 600) -> Job:
    """``python ARGV`` in a fresh process."""
    return _process([sys.executable, *map(str, argv)], env, timeout)


def _process(command: list[str], env: dict | None, timeout: float) -> Job:
    """Run ``command`` in its own session; one still running after ``timeout`` seconds is
    killed with everything it started (a hang fails the test instead of the suite), as it is
    when the test is interrupted."""
    with session(command, cwd=REPO, env={**os.environ, **BASE_ENV, **(env or {})},
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{' '.join(command[:6])} ... did not exit within {timeout} s"
                                 f"\n{stdout[-3000:]}\n{stderr[-5000:]}") from None
    return Job([process.returncode], stdout, stderr)


# --------------------------------------------------------------------------- the parent

def _as_forked(parent: int) -> None:
    """In a child just forked from the parent: the signal handlers a process starts with (not
    the parent's), and death with the parent (whose end would leave it running)."""
    for sig in _ENDS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    die_with_parent(parent)


def _rank(request: dict, rank: int, port: int, parent: int) -> None:
    """In a forked child: become rank ``rank`` of the job and run it; never returns."""
    import runpy
    import traceback
    nproc, logs = request["nproc"], Path(request["logs"])
    code = 1
    try:
        _as_forked(parent)
        os.setpgid(0, 0)               # a job's ranks can be signalled without the parent
        for fd, name in ((1, f"rank_{rank}.out"), (2, f"rank_{rank}.err")):
            target = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(os.devnull)
        sys.stdout = sys.__stdout__           # the parent's protocol stream: now this rank's file
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                           **request["env"]})
        if "torch" in sys.modules:                  # preloaded (tests/test_launch.py's are not)
            sys.modules["torch"].set_num_threads(1)
        argv = request["argv"]
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:                                    # noqa: B036 (a rank reports all)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _store(parent: int) -> tuple[int, int]:
    """Fork the job's store keeper: the ``TCPStore`` every rank joins, outliving the ranks as
    torchrun's agent store does (so a rank can record a failure after rank 0 has left); its
    (pid, port). It binds a port of its own choosing and reports it through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _as_forked(parent)
            os.close(read)
            import torch.distributed as dist
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            os.write(write, str(store.port).encode())
            os.close(write)
            signal.pause()                                  # until the parent ends the job
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reply:
        port = reply.read()
    if not port:
        raise RuntimeError("the job's store keeper did not start")
    return pid, int(port)


def _wait(pids: list[int], grace: float = 30.0) -> list[int]:
    """Each child's exit status; once one fails, the rest get ``grace`` seconds to exit before
    they are killed (as torchrun stops a job one of whose ranks failed). The end of the input
    meanwhile (the creator closed it or died) ends the job and this process (``_abandon``)."""
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in pids:
                    if other not in codes:
                        _kill_group(other)
                deadline = None
            if select.select([sys.stdin], [], [], 0.05)[0]:   # no request comes during a job
                _abandon()
            continue
        if pid in pids:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and deadline is None:
                deadline = time.monotonic() + grace
    return [codes[pid] for pid in pids]


# what ends the parent besides the end of its input: its creator's death (PR_SET_PDEATHSIG),
# Ctrl-C at a terminal (the whole foreground group gets SIGINT), a hangup, ``Ranks.close``
_ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _abandon(*_) -> None:
    """End the job in progress, if any (every rank with its process group, the store keeper,
    whatever they left) and this process."""
    end_children()
    os._exit(1)


def serve() -> None:
    """The parent: import once, then for each request line on stdin fork its ranks and answer
    ``{"pids": [...]}`` then ``{"codes": [...]}`` on stdout, once every process of the job
    (the ranks, the store keeper, whatever they started) has ended."""
    import importlib
    import warnings
    for sig in _ENDS:
        signal.signal(sig, _abandon)
    die_with_parent(int(os.environ.pop(CREATOR_ENV, os.getppid())), signal.SIGTERM)
    adopt_orphans()                  # what a rank leaves (a DataLoader worker...) comes here
    parent = os.getpid()
    for name in os.environ.pop(PRELOAD_ENV, ",".join(PRELOAD)).split(","):
        if name:
            importlib.import_module(name)
    tokenizers = json.loads(os.environ.pop(TOKENIZERS_ENV, json.dumps(TOKENIZERS)))
    if tokenizers:
        from mimo_data.preprocess.config import PreprocessConfig
        from mimo_data.preprocess.tokenizer_loading import load_tokenizer, shared_tokenizer
        for source in tokenizers:
            try:
                if source.endswith(".yaml"):
                    load_tokenizer(PreprocessConfig.from_yaml(source))
                else:
                    shared_tokenizer(source)
            except Exception:           # a speed-up only: a rank that loads it says why
                continue
    # The only other thread here is pyarrow's idle jemalloc background thread, whose allocator
    # takes fork in its stride (pthread_atfork); the loader's DataLoader workers fork after the
    # same import. Python warns at every fork of a process with any other thread.
    warnings.filterwarnings("ignore", "This process .* is multi-threaded, use of fork",
                            DeprecationWarning)
    reply = sys.stdout
    sys.stdout = sys.stderr                   # anything else printed stays off the protocol
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        keeper, port = _store(parent)
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, port, parent)
            pids.append(pid)
        print(json.dumps({"pids": pids}), file=reply, flush=True)
        codes = _wait(pids)
        # A rank ends with os._exit: whatever it started and left (a DataLoader worker, whose
        # exit waits for a pipe no one reads any more) is this process's child now; it ends
        # here, with the store keeper, before the job is reported done.
        end_children()
        print(json.dumps({"codes": codes}), file=reply, flush=True)
    end_children()
    os._exit(0)                       # no exit-time collection over every module imported


if __name__ == "__main__":
    assert sys.argv[1:] == ["--serve"], \
        "tests/support/launch.py --serve (started by tests/conftest.py)"
    serve()
