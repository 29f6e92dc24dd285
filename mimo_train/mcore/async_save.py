"""megatron-core's asynchronous checkpoint save, as ``components.checkpoint`` extends it.

- ``then_in_writer``: a save request (megatron-core's ``AsyncRequest``, an immutable named
  tuple) whose write is followed by another function in the same process, the writer forked by
  ``AsyncCallsQueue`` or the caller of ``execute_sync``; a failure of either is the write's
  results, the exception itself (``writer_failure``);
- ``use_forked_write_results``: the writer's results queue (a file), set before megatron-core
  makes its own (a ``Manager`` of the "spawn" context).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import logging
import os
import pickle
import queue
import tempfile
from collections.abc import Callable

from mimo_train.mcore import AsyncRequest, filesystem_async


def then_in_writer(request: AsyncRequest, after: Callable, *args) -> AsyncRequest:
    """``request`` whose write (its ``async_fn``) is followed by ``after(*args)`` where the
    write runs, unless the write failed; its finalization is unchanged. The first exception of
    either (a write thread's own, such as a full disk's OSError) is put as the write's results,
    which megatron-core's finalization raises on every rank as a ``CheckpointException``."""
    return request._replace(async_fn=functools.partial(_write_then, request.async_fn, after,
                                                       args))


def _write_then(write: Callable, after: Callable, args: tuple, *write_args, **write_kwargs):
    failures: list[Exception] = []
    try:
        with _worker_failures(failures):
            write(*write_args, **write_kwargs)
        if not failures:
            after(*args)
    except Exception as error:      # escaping a forked writer: a traceback and no results
        failures.append(error)
    results = filesystem_async._results_queue
    if failures and isinstance(results, _ResultsQueue):
        results.put(failures[0])    # in place of what megatron-core put, if anything
    elif failures:
        raise failures[0]


@contextlib.contextmanager
def _worker_failures(failures: list[Exception]):
    """Record in ``failures`` the exceptions of megatron-core's write threads meanwhile. Its
    ``write_preloaded_data`` returns a thread's exception, which its caller logs and then
    loses: it asserts the result is a list, then puts as the results a RuntimeError naming
    only the class (``<class 'OSError'>``), or, with threads of its own, leaves the writer by
    that AssertionError before it puts any. Its log lines of the failure are dropped: the
    failure itself is raised where the save is finalized."""
    writer = filesystem_async.FileSystemWriterAsync
    original = writer.__dict__["write_preloaded_data"]
    function = original.__func__

    @functools.wraps(function)      # its signature, which megatron-core reads (use_msc)
    def recorded(*args, **kwargs):
        if kwargs.get("results_queue") is not None:
            # a write thread: its exception noted as it puts it, before it tells the main
            # thread it is done (which then fails on megatron-core's assert at once)
            kwargs["results_queue"] = _Noting(kwargs["results_queue"], failures)
            return function(*args, **kwargs)
        output = function(*args, **kwargs)
        if isinstance(output, tuple) and isinstance(output[1], Exception):
            failures.append(output[1])
        return output
    quiet = _DropErrors()
    filesystem_async.logger.addFilter(quiet)
    writer.write_preloaded_data = staticmethod(recorded)
    try:
        yield
    finally:
        writer.write_preloaded_data = original
        filesystem_async.logger.removeFilter(quiet)


class _Noting:
    """A write thread's results queue that notes an exception put in it in ``failures``."""

    def __init__(self, results: queue.Queue, failures: list[Exception]):
        self.results, self.failures = results, failures

    def put(self, output) -> None:
        if isinstance(output, tuple) and isinstance(output[1], Exception):
            self.failures.append(output[1])
        self.results.put(output)

    def __getattr__(self, name: str):       # the queue's other methods, as they are
        return getattr(self.results, name)


class _DropErrors(logging.Filter):
    """A logger's errors dropped, its other records kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


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
        self.failure: Exception | None = None   # the exception a read found instead
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
        if isinstance(item, Exception):
            self.failure = item
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


def writer_failure() -> Exception | None:
    """The exception this rank's writer put as its last write's results (``then_in_writer``),
    whole: megatron-core raises it only on its coordinator, as a RuntimeError ("Worker
    failure: <its text>") that crosses from the other ranks pickled, without it. None where
    there was none. Cleared."""
    found = filesystem_async._results_queue
    if not isinstance(found, _ResultsQueue):
        return None
    failure, found.failure = found.failure, None
    return failure


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
