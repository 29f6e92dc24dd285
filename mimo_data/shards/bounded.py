"""``ordered_imap``: a process pool's ``imap`` with a bounded number of items in flight.

``Pool.imap`` reads its whole input at once and keeps every result until it is consumed: when
the consumer is slower than the workers (a writer), results pile up without bound. Here the
input is read lazily and at most ``window`` items are submitted ahead of the one consumed.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator


def ordered_imap(pool, func: Callable, items: Iterable, window: int) -> Iterator:
    """``func(item)`` for each of ``items``, in order, at most ``window`` items in flight."""
    items = iter(items)
    pending = deque(pool.apply_async(func, (item,))
                    for item in itertools.islice(items, max(window, 1)))
    while pending:
        done = pending.popleft().get()
        for item in itertools.islice(items, 1):
            pending.append(pool.apply_async(func, (item,)))
        yield done
