"""The worker pool's forkserver: its children quiet where their caller has ended.

``worker_pool.ordered_map`` preloads this module in the forkserver, whose import sets its
``sys.excepthook`` (imported anywhere else it sets nothing). A worker is forked on a request
the caller sends, then reads its process object from the caller's pipe. A caller stopped in
between (Ctrl-C or SIGTERM in the first seconds of a build, while the forkserver still
imported the workers' modules or a worker was being started) has removed its semaphores by the
time the worker reads them: multiprocessing then printed the worker's ``FileNotFoundError``
traceback under the caller's one line. A worker whose start fails otherwise, or while its
caller lives, still prints its error (the pool breaks and ``worker_pool`` says "the error is
above").
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from multiprocessing import forkserver, spawn, synchronize
from types import CodeType, ModuleType, TracebackType

_WAIT_S = 2.0           # how long a worker that found no semaphores waits for its caller's end


def _in_forkserver() -> bool:
    """Whether this import is the forkserver's preload (``forkserver.main`` on the stack; in
    its forked children too)."""
    frame = inspect.currentframe()
    while frame is not None:
        if _is(frame.f_code, forkserver, "main"):
            return True
        frame = frame.f_back
    return False


def _is(code: CodeType, module: ModuleType, name: str) -> bool:
    return code.co_name == name and code.co_filename == module.__file__


def _semaphores_gone(kind: type[BaseException], trace: TracebackType | None) -> bool:
    """Whether a worker failed to find its caller's semaphores while it read its process
    object (multiprocessing's ``spawn._main``, before it ran any of it): the caller removes
    them when it ends, or once its pool is dropped, so nothing waits for this worker."""
    codes = []
    while trace is not None:
        codes.append(trace.tb_frame.f_code)
        trace = trace.tb_next
    return issubclass(kind, FileNotFoundError) and bool(codes) and \
        any(_is(code, spawn, "_main") for code in codes) and \
        _is(codes[-1], synchronize, "__setstate__")


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:                 # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _caller_ended(caller: int) -> bool:
    """Whether the caller has ended, waited for a while: it removes its semaphores on its way
    out, a moment before it is gone. One that lives on (its semaphores removed by another
    hand, /dev/shm cleared) hears of the failure: its pool says "the error is above"."""
    deadline = time.monotonic() + _WAIT_S
    while not _ended(caller):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _quiet_when_caller_ended(caller: int, earlier):
    def hook(kind: type[BaseException], error: BaseException,
             trace: TracebackType | None) -> None:
        if not (_semaphores_gone(kind, trace) and _caller_ended(caller)):
            earlier(kind, error, trace)
    return hook


# the process that started the forkserver, named in its environment (its parent may have
# ended before this preload ran: the forkserver is then another's child)
CALLER_VARIABLE = "MIMO_POOL_CALLER"

if _in_forkserver() and os.environ.get(CALLER_VARIABLE, "").isdigit():
    sys.excepthook = _quiet_when_caller_ended(int(os.environ[CALLER_VARIABLE]), sys.excepthook)
