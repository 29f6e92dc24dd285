"""Scripts that each need a process without cpu_compat's patches, for
tests/test_train_cpu_compat.py: one fresh interpreter (no mimo_train.mcore imported, so no patch
applied) imports torch and megatron-core once, without probing CUDA, then forks one child per
script.

    python tests/jobs/cpu_compat.py OUT.json SCRIPT...

Each child runs its script as ``__main__`` (the patches it applies die with it), its stdout and
stderr in files beside the script. ``OUT.json``: ``{script: {"code", "stdout", "stderr"}}``.
"""

import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def _child(script: Path) -> None:
    """In the forked child: run ``script``; never returns."""
    code = 1
    try:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            target = os.open(script.with_suffix(suffix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                             0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = [str(script)]
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:                                    # noqa: B036 (a child reports all)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_is_clean() -> bool:
    """Whether a child forked now may still initialize CUDA (torch marks every child of a
    process that probed CUDA "in a bad fork": CUDA calls there fail with "Cannot re-initialize
    CUDA in forked subprocess", not with the reason a fresh process gives)."""
    import torch
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _import_shared() -> None:
    """torch and megatron-core, unpatched, without probing CUDA: megatron-core's import asks
    ``torch.cuda.is_available()`` / ``device_count()``, which would spoil every fork; here
    (run only where CUDA is absent: the tests skip otherwise) they give their CPU answers
    without the probe. Each child then probes CUDA for real, as a fresh process does."""
    import torch
    import torch.distributed  # noqa: F401
    probes = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: False), (lambda: 0)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.cuda.is_available, torch.cuda.device_count = probes
    assert "mimo_train.mcore" not in sys.modules        # its import applies every patch
    assert _fork_is_clean(), "an import probed CUDA: forked children cannot show its failures"
    torch.set_num_threads(1)


def main(out: str, scripts: list[str]) -> None:
    _import_shared()
    results = {}
    for script in map(Path, scripts):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script)
        _, status = os.waitpid(pid, 0)
        results[str(script)] = {"code": os.waitstatus_to_exitcode(status),
                                "stdout": script.with_suffix(".out").read_text(errors="replace"),
                                "stderr": script.with_suffix(".err").read_text(errors="replace")}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
