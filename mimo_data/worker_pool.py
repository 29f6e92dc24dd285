"""``ordered_map``: ``func`` over items in worker processes, in order, a bounded window in flight.

``Pool.imap`` reads its whole input at once and keeps every result until it is consumed: when
the consumer is slower than the workers (a writer), results pile up without bound. Here the
input is read lazily and at most ``window`` items are submitted ahead of the one consumed.

The workers come from a ``concurrent.futures`` pool, not a ``multiprocessing.Pool``: a worker
that dies (the out-of-memory killer, a crash in a decoder) breaks the pool and raises
``WorkerDied`` here, where a ``Pool`` lost the item and waited for it forever. They are forked
from the forkserver, a process that has imported ``func``'s module and nothing else ran in,
not from the caller: forking a process whose other threads (tqdm's monitor, Arrow's and
torch's pools, fsspec's event loop) hold locks or memory mid-change crashed a child in garbage
collection. As with any pool not made by ``fork``, a script that calls this at its top level
needs Python's ``if __name__ == "__main__":`` guard (each worker imports the script).
"""

from __future__ import annotations

import faulthandler
import itertools
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver, resource_tracker
from typing import Any

from mimo_data import forkserver_hook

_NAMED = 4          # items in flight a WorkerDied message names (first ones and the last)


class WorkerDied(Exception):
    """A worker process ended without a result (killed, or crashed)."""


def _exit_with_parent() -> None:
    """End this worker when the process that made the pool is gone (killed by the OOM killer
    or SIGKILL): its queue's other end is held by the workers themselves, so they would wait
    for work forever."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def _start(environ: dict[str, str], initializer: Callable | None, initargs: tuple) -> None:
    """A worker's start: the caller's environment at the pool's start (a fork's would be; the
    forkserver's is that of its own start; multiprocessing passes the working directory and
    ``sys.path``), Ctrl-C left to the caller (which stops the pool), a crash's Python stack on
    stderr, an end with the caller; then ``initializer``."""
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # (blocked in the forkserver, ``_start_forkserver``: ignored here, not held, nor in
    # what a worker starts)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    faulthandler.enable()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if initializer is not None:
        initializer(*initargs)


def _start_forkserver() -> None:
    """Start the forkserver (once a process) with SIGINT blocked, which it keeps: a signal
    mask is inherited through exec, and the forkserver's own start sets SIGINT ignored once
    its preload is imported, which discards one held meanwhile. Ctrl-C at a terminal reaches
    the whole process group, and a forkserver still importing its preload printed a
    KeyboardInterrupt traceback under the caller's one line. Blocked in this thread only,
    not ignored: a Ctrl-C meanwhile goes to another thread, or waits for the unblocking, and
    interrupts the caller (ignored, it was lost: the build went on to its end). Its
    environment names this process (``forkserver_hook``)."""
    earlier_caller = os.environ.get(forkserver_hook.CALLER_VARIABLE)
    os.environ[forkserver_hook.CALLER_VARIABLE] = str(os.getpid())
    # the resource tracker first: its start (the forkserver's first step) unblocks SIGINT
    resource_tracker.ensure_running()
    blocked = signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        forkserver.ensure_running()
    finally:
        if earlier_caller is None:
            del os.environ[forkserver_hook.CALLER_VARIABLE]
        else:
            os.environ[forkserver_hook.CALLER_VARIABLE] = earlier_caller
        if blocked:     # last: a Ctrl-C held meanwhile is raised here
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _stop(pool: ProcessPoolExecutor) -> None:
    """The pool's workers killed, not awaited: the caller stopped early (an error, a --strict
    stop, Ctrl-C) and a worker may be blocked on a read (a hung mount, a FIFO). The workers
    only compute results, so nothing is lost. Python 3.12 has no public way to reach them
    (3.14's ``terminate_workers``): the executor's own process table is read. A second
    Ctrl-C or SIGTERM meanwhile (``timeout`` passes its signal on; an impatient user) is
    ignored: it broke the stop off with a traceback, workers left running."""
    main = threading.current_thread() is threading.main_thread()
    earlier = {number: signal.signal(number, signal.SIG_IGN)
               for number in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        processes = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join()
    finally:
        for number, handler in earlier.items():
            signal.signal(number, handler)


def _death(pool: ProcessPoolExecutor, broken: BaseException | None, lost: list[str],
           advice: str, idle: bool = False) -> WorkerDied:
    """The error for a broken pool: how its workers ended and the items a dead one may have
    held (or, ``idle``: the first of those it never ran). ``broken``: the pool's error, whose
    cause holds a worker's own traceback where one was sent."""
    processes = list((pool._processes or {}).values())
    # the executor's thread has ended the workers and reads their exit status itself: read
    # once it has (a read beside it took the pipe's status from it: "exit status 255")
    pool.shutdown(wait=True)
    codes = {code for code in (process.exitcode for process in processes) if code}
    # the executor SIGTERMs the workers once one has died or a result was lost: a SIGTERM
    # is told only when nothing else is
    deaths = codes - {-signal.SIGTERM}
    cause = str(broken.__cause__ or "" if broken else "").strip().strip("'").strip()
    if deaths:
        how = ", ".join(sorted(_end(code) for code in deaths))
        if -signal.SIGKILL in deaths:
            how += ": most often the out-of-memory killer"
        elif deaths & {-signal.SIGSEGV, -signal.SIGBUS, -signal.SIGABRT}:
            how += ": a crash in native code, its Python stack above"
    elif cause:
        how = f"its result could not be passed back: {cause.splitlines()[-1]}"
    elif codes:
        how = _end(-signal.SIGTERM)
    else:
        how = "it ended by itself: its start failed, the error is above"
    if idle:
        told = (f"a worker process ended between items ({how}): {lost[0]} and those after it "
                "were not done")
    else:
        named = lost if len(lost) <= _NAMED else [*lost[:_NAMED - 1], "...", lost[-1]]
        told = (f"a worker process ended without a result ({how}) while it had one of "
                f"{len(lost)} item(s) in flight: {', '.join(named)}")
    return WorkerDied(f"{told}; {advice}" if advice else told)


def _end(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def ordered_map(func: Callable, items: Iterable, workers: int, window: int,
                describe: Callable[[Any], str] = str, advice: str = "",
                initializer: Callable | None = None,
                initargs: tuple = ()) -> Generator[Any, None, None]:
    """``func(item)`` for each of ``items``, in order, from ``workers`` processes, at most
    ``window`` items in flight; ``initializer(*initargs)`` runs once in each worker (its
    arguments are pickled). A worker that dies raises ``WorkerDied`` once the results finished
    before are yielded, naming the items it may have held (``describe(item)``), then
    ``advice`` (what the user does next); an exception
    ``func`` raises comes back as itself. A consumer that stops early kills the workers."""
    context = multiprocessing.get_context("forkserver")
    # read only when the forkserver starts (once a process): later calls' modules import in
    # the workers instead, which the first one's imports mostly covered
    context.set_forkserver_preload([func.__module__, forkserver_hook.__name__])
    _start_forkserver()
    items = iter(items)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                               initargs=(dict(os.environ), initializer, initargs))
    pending: deque[tuple[Any, Future]] = deque()
    refused: list[Any] = []             # the item a broken pool did not take

    def submit(count: int) -> None:
        for item in itertools.islice(items, 0 if refused else count):
            try:
                pending.append((item, pool.submit(func, item)))
            except BrokenProcessPool:     # the finished ones are still yielded first
                refused.append(item)
                return
    finished = False
    try:
        submit(max(window, 1))
        while pending:
            try:        # no local holds the future: its exception's frames would hold it
                done = pending[0][1].result()
            except BrokenProcessPool as exc:
                raise _death(pool, exc, [describe(item) for item, f in pending
                                         if isinstance(f.exception(), BrokenProcessPool)],
                             advice) from exc
            pending.popleft()
            submit(1)
            yield done
        if refused:     # a worker died between items: the rest were never run
            raise _death(pool, None, [describe(refused[0])], advice, idle=True)
        finished = True
    finally:
        # the futures hold the error being raised, whose frames hold them: a cycle that kept
        # the caller's open files to the cyclic collector
        pending.clear()
        if finished:
            pool.shutdown(wait=True)
        else:
            _stop(pool)
