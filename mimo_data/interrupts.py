"""SIGTERM unwound as Ctrl-C is, for the commands that write outputs: their cleanup (a
staging folder removed, a claim given back) runs for either, and each says it in one line."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, as Ctrl-C's KeyboardInterrupt is."""


def _terminate(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within it, SIGTERM raises ``Terminated``; the handler before it is put back after."""
    earlier = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, earlier)
