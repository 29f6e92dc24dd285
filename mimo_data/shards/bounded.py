"""``ordered_map``: ``func`` over items in worker processes, in order, a bounded window in flight.

``Pool.imap`` reads its whole input at once and keeps every result until it is consumed: when
the consumer is slower than the workers (a writer), results pile up without bound. Here the
input is read lazily and at most ``window`` items are submitted ahead of the one consumed.

The workers come from a ``concurrent.futures`` pool, not a ``multiprocessing.Pool``: a worker
that dies (the out-of-memory killer, a crash in a decoder) breaks the pool and raises
``WorkerDied`` here, where a ``Pool`` lost the item and waited for it forever. They are forked
from the forkserver, a clean single-threaded process that has imported ``func``'s module once,
not from this one: forking a process whose other threads (tqdm's monitor, Arrow's and torch's
pools, fsspec's event loop) hold locks or memory mid-change crashed a child in garbage
collection.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any


class WorkerDied(Exception):
    """A worker process ended without a result (killed, or crashed)."""


def _start(environ: dict[str, str], initializer: Callable | None, initargs: tuple) -> None:
    """A worker's start: the caller's environment at the pool's start (a fork's would be; the
    forkserver's is that of its own start; multiprocessing passes the working directory and
    ``sys.path``), then ``initializer``."""
    os.environ.clear()
    os.environ.update(environ)
    if initializer is not None:
        initializer(*initargs)


def ordered_map(func: Callable, items: Iterable, workers: int, window: int,
                describe: Callable[[Any], str] = str, initializer: Callable | None = None,
                initargs: tuple = ()) -> Iterator:
    """``func(item)`` for each of ``items``, in order, from ``workers`` processes, at most
    ``window`` items in flight; ``initializer(*initargs)`` runs once in each worker (its
    arguments are pickled). A worker that dies raises ``WorkerDied`` naming the items in flight
    (``describe(item)``); an exception ``func`` raises comes back as itself."""
    context = multiprocessing.get_context("forkserver")
    # read only when the forkserver starts (once a process): later calls' modules import in
    # the workers instead, which the first one's imports mostly covered
    context.set_forkserver_preload([func.__module__])
    items = iter(items)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                               initargs=(dict(os.environ), initializer, initargs))
    pending: deque[tuple[object, Future]] = deque()
    try:
        for item in itertools.islice(items, max(window, 1)):
            pending.append((item, pool.submit(func, item)))
        while pending:
            done = pending[0][1].result()
            pending.popleft()
            for item in itertools.islice(items, 1):
                pending.append((item, pool.submit(func, item)))
            yield done
    except BrokenProcessPool:
        raise WorkerDied("a worker process ended without a result (killed, e.g. by the "
                         "out-of-memory killer, or crashed) while it had one of: "
                         + ", ".join(describe(item) for item, _ in pending)) from None
    finally:        # a consumer that stops early waits for the items started, not the rest
        pool.shutdown(wait=True, cancel_futures=True)
