"""What every mimo CLI does when the reader of its standard output goes away
(``mimo-shard info DIR | head -1``): it stops quietly, without a traceback."""

from __future__ import annotations

import functools
import os
import select
import sys
from collections.abc import Callable


def quiet_when_stdout_closes[**P](main: Callable[P, int]) -> Callable[P, int]:
    """``main``, returning 1 without a traceback when standard output's reader has gone: the
    rest of its output goes to /dev/null, so that the interpreter's last flush does not fail
    too (Python's documented handling of SIGPIPE). A broken pipe elsewhere (a worker, a
    socket) still raises."""
    @functools.wraps(main)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            if not _stdout_closed():
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    return wrapped


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (poll's POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):      # no descriptor (captured), no poll
        return False
