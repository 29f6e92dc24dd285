"""megatron-core's asynchronous checkpoint save, as ``components.checkpoint`` extends it.

- ``then_in_writer``: a save request (megatron-core's ``AsyncRequest``, an immutable named
  tuple) whose write is followed by another function in the same process, the writer forked by
  ``AsyncCallsQueue`` or the caller of ``execute_sync``;
- ``use_forked_write_results``: the writer's results queue, of the "fork" context and read
  only once its item arrived, set before megatron-core makes its own (a ``Manager`` of the
  "spawn" context).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import multiprocessing.queues
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


class _ResultsQueue(multiprocessing.queues.Queue):
    """A queue of the "fork" context whose ``get_nowait`` waits for an item on its way.
    megatron-core reads a write's results with ``get_nowait`` once the write has returned, so
    the item has been put; but a queue's ``put`` hands it to a feeder thread of the putting
    process: in the process that wrote (``execute_sync``) it may not be readable yet ("results_
    queue should not be empty"). A forked writer has ended, its feeder flushed, by then
    (megatron-core joined it): where this process put nothing, an item not there at once never
    comes (the writer was killed), and megatron-core's error follows without the long wait."""

    def __init__(self):
        super().__init__(ctx=multiprocessing.get_context("fork"))
        self.putter: int | None = None      # the process that put here (a fork's own copy)

    def put(self, obj, block=True, timeout=None):
        self.putter = os.getpid()
        super().put(obj, block, timeout)

    def get_nowait(self):
        return self.get(timeout=_ON_ITS_WAY_S if self.putter == os.getpid() else _JOINED_S)


_ON_ITS_WAY_S = 60.0          # a writer that died before putting its results: then an error
_JOINED_S = 1.0               # a joined writer's item is in the pipe already


def use_forked_write_results() -> None:
    """Give megatron-core's checkpoint writer a results queue of the "fork" context
    (``_ResultsQueue``; once a process, before its first save). It makes one on first use from
    a ``multiprocessing.Manager`` of the "spawn" context: a server process starting a fresh
    interpreter, seconds per rank at the first save. Its writers run in this process
    (``execute_sync``) or in one forked by ``AsyncCallsQueue``, which inherits the queue. Not
    at import: a process forked from one that imported this module must not share its
    queue."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = _ResultsQueue()
