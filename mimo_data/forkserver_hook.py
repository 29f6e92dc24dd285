"""The worker pool's forkserver: its children quiet where their caller has let them go.

``worker_pool.ordered_map`` preloads this module in the forkserver, whose import sets its
``sys.excepthook`` (imported anywhere else it sets nothing). A worker is forked on a request
the caller sends, then reads its process object from the caller's pipe. A caller stopped in
between (Ctrl-C or SIGTERM in the first seconds of a build, while the forkserver still
imported the workers' modules or a worker was being started) has removed its semaphores by the
time the worker reads them: multiprocessing then printed the worker's ``FileNotFoundError``
traceback under the caller's one line. A worker whose start fails otherwise still prints its
error (the pool breaks and ``worker_pool`` says "the error is above").
"""

from __future__ import annotations

import inspect
import sys
from multiprocessing import forkserver, spawn, synchronize
from types import CodeType, ModuleType, TracebackType


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


def _quiet_when_semaphores_gone(earlier):
    def hook(kind: type[BaseException], error: BaseException,
             trace: TracebackType | None) -> None:
        if not _semaphores_gone(kind, trace):
            earlier(kind, error, trace)
    return hook


if _in_forkserver():
    sys.excepthook = _quiet_when_semaphores_gone(sys.excepthook)
