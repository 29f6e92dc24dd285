"""megatron-core's asynchronous checkpoint save, as ``components.checkpoint`` extends it.

- ``then_in_writer``: a save request (megatron-core's ``AsyncRequest``, an immutable named
  tuple) whose write is followed by another function in the same process, the writer forked by
  ``AsyncCallsQueue`` or the caller of ``execute_sync``;
- ``use_forked_write_results``: the writer's results queue (a file), set before megatron-core
  makes its own (a ``Manager`` of the "spawn" context).
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import pickle
import queue
import tempfile
from collections.abc import Callable

from mimo_train.mcore import AsyncRequest, filesystem_async


def then_in_writer(request: AsyncRequest, after: Callable, *args) -> AsyncRequest:
    """``request`` whose write (its ``async_fn``) is followed by ``after(*args)`` where the
    write runs; its finalization is unchanged."""
    return request._replace(async_fn=functools.partial(_write_then, request.async_fn, after,
                                                       args))


def _write_then(write: Callable, after: Callable, args: tuple, *write_args, **write_kwargs):
    write(*write_args, **write_kwargs)
    after(*args)


class _ResultsQueue:
    """The write results' hand-over, one item at a time, through a file: ``put`` writes it
    whole (a temporary name, then renamed) before it returns, ``get_nowait`` reads and removes
    it, or raises ``queue.Empty`` where none is there (megatron-core: "results_queue should not
    be empty"). megatron-core puts a write's results where the write ran (this process in
    ``execute_sync``, or a writer it forked and joins before it reads them) and reads them once
    the write has returned. Hand-written: a pipe-backed ``multiprocessing`` queue keeps a forked
    writer from exiting until its item is read, which megatron-core does only after joining
    it (results past the pipe's 64 KiB, any real model's: a hang); its ``Manager`` queue starts
    a server interpreter (seconds a rank at the first save). A writer killed first leaves no
    file: the error follows at once."""

    def __init__(self):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(folder, f"mimo-write-results-{os.getpid()}-{id(self)}.pkl")
        self.owner = os.getpid()
        self.found_none = False     # a read found no results: this rank's writer died first
        atexit.register(self._remove)

    def put(self, obj) -> None:
        partial = f"{self.path}.{os.getpid()}"
        with open(partial, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, self.path)

    def get_nowait(self):
        try:
            with open(self.path, "rb") as f:
                item = pickle.load(f)
        except FileNotFoundError:
            self.found_none = True
            raise queue.Empty from None
        os.remove(self.path)
        return item

    def _remove(self) -> None:
        """At exit, what is left: an item never read, a killed writer's partial one."""
        if os.getpid() == self.owner:
            for path in glob.glob(glob.escape(self.path) + "*"):
                os.remove(path)


def writer_left_nothing() -> bool:
    """Whether this rank's last read of a write's results found none (its writer ended
    before it put them: killed); megatron-core tells only its coordinator which rank failed.
    The flag is cleared."""
    found = filesystem_async._results_queue
    if not isinstance(found, _ResultsQueue) or not found.found_none:
        return False
    found.found_none = False
    return True


def use_forked_write_results() -> None:
    """Give megatron-core's checkpoint writer a results queue (``_ResultsQueue``; once a
    process, before its first save). It makes one on first use from
    a ``multiprocessing.Manager`` of the "spawn" context: a server process starting a fresh
    interpreter, seconds per rank at the first save. Its writers run in this process
    (``execute_sync``) or in one forked by ``AsyncCallsQueue``, which inherits the queue. Not
    at import: a process forked from one that imported this module must not share its
    queue."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = _ResultsQueue()
