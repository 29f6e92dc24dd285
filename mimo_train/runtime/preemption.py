"""Stopping on a signal: what a preempted job receives before it is killed.

Slurm and Kubernetes send SIGTERM (Slurm also a chosen signal ahead of time, e.g.
``--signal=USR1@120``) and kill the job after a grace period. ``train.exit_signals`` names the
signals that ask the run to stop: the first one a rank receives only sets a flag; after every
step the ranks agree over the control group (one small CPU all-reduce) on whether any rank got
one, so a signal delivered to one rank stops them all after the same step. They then save one
checkpoint together (with ``checkpoint.dir``), print where, and exit with
``128 + the signal's number`` (143 for SIGTERM, 138 for SIGUSR1): the status a killed job would
have, which requeue wrappers already read, but with the checkpoint written. A second signal
before the ranks agreed ends the process at once (the default action); one within
``REPEAT_SECONDS`` of the first counts as the same delivery (Slurm signals every process of the
job, and torchrun forwards its own copy to the workers). Once they agreed, the run's exit
signals are ignored until the rank exits: torchrun sends a SIGTERM to the ranks still there as
soon as the first exits 128 + N, which would kill them during their save or before they
release the folder's claim; a stuck save is ended by SIGKILL (torchrun's, 30 s later; Slurm's
after its KillWait). A rank that died leaves
the others in the agreement's all-reduce only until ``train.collective_timeout_minutes``.

A time limit of the run's own, ``train.exit_duration_minutes`` (megatron-LM's
``--exit-duration-in-mins``), rides on the same agreement: once it has passed on any rank, all
stop after the same step, save, and exit 0. Under ``mimo-train`` it counts from the rank's
process start (``deadline``, ``launcher.started``): its imports count, as they do against the
job's limit.

Under ``torchrun``, a signal to the agent (SIGTERM, SIGINT, SIGHUP, SIGQUIT) reaches every
worker as the same signal; torchrun kills them 30 s later, so the step in progress and the save
must fit in that time there (a signal sent to the workers themselves, as Slurm's ``--signal``
does, has no such limit).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from mimo_train.runtime import distributed

REPEAT_SECONDS = 2.0
# seconds a rank blocked in a collective or the rendezvous during start-up (where Python runs
# no signal handler) has after a start-up signal before it ends without its clean-ups
STARTUP_GRACE_S = 5.0
# what ``ExitSignals.agreed`` returns when no rank got a signal but the deadline passed (no
# signal has this number)
PAST_DEADLINE = 1024

class StartupSignal(BaseException):
    """One of ``train.exit_signals`` received before the training steps began (a token table
    or a checkpoint load can take minutes): raised, so the rank's clean-ups run (a table's
    temporary file removed, the run's claim of its checkpoint.dir released) and it says so, rather
    than the default action ending it without a word. A BaseException: no ``except
    Exception`` on the way takes it for a failure."""

    def __init__(self, number: int):
        super().__init__(number)
        self.number = number


_training = False       # the steps began (``ExitSignals`` entered): a signal is theirs now


@contextmanager
def before_training(names: list[str]) -> Iterator[None]:
    """The run's exit signals raise ``StartupSignal`` until the training steps begin; once
    they have (``ExitSignals``' handlers, then what follows them), the default action. A copy
    of the same delivery (within ``REPEAT_SECONDS``) lets the clean-ups finish; a later one
    ends the rank at once. A rank blocked in a collective or the rendezvous, whose handler
    cannot run, ends ``STARTUP_GRACE_S`` after the signal, saying so (``_watch``). On the way
    out the handlers before come back, but not over the ignoring ``ExitSignals`` leaves once
    the ranks agreed to stop (torchrun's SIGTERM would kill a rank still saving)."""
    global _training
    _training = False                   # (a process may run several: the tests' jobs)
    numbers = frozenset(map(signal_number, names))
    raised: list[float] = []            # when the first one was raised

    def stop(number: int, frame: FrameType | None) -> None:
        if _training or (raised and time.monotonic() - raised[0] > REPEAT_SECONDS):
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        if raised:                      # torchrun's copy of the same: the clean-ups go on
            return
        raised.append(time.monotonic())
        raise StartupSignal(number)
    previous = {number: signal.signal(number, stop) for number in numbers}
    reading, writing = os.pipe()
    os.set_blocking(writing, False)
    woken = signal.set_wakeup_fd(writing, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(reading, numbers, raised), daemon=True,
                     name="mimo-startup-signals").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(woken)
        os.close(writing)               # the watch reads the end, and ends
        for number, handler in previous.items():
            if signal.getsignal(number) is stop:
                signal.signal(number, handler)


def _watch(reading: int, numbers: frozenset[int], raised: list[float]) -> None:
    """Each signal's number as the interpreter's C handler writes it (``set_wakeup_fd``), at
    once, while the main thread may be blocked in a collective or the rendezvous, where its
    Python handler does not run: where that has not run ``STARTUP_GRACE_S`` later, the rank
    ends with the default action's status (128 + N), saying so from rank 0."""
    try:
        while data := os.read(reading, 64):
            for number in data:
                if number not in numbers or _training or raised:
                    continue
                time.sleep(STARTUP_GRACE_S)
                if not (raised or _training):
                    if os.environ.get("RANK", "0") == "0":
                        os.write(2, f"mimo-train: {signal.Signals(number).name} during "
                                 "start-up, in a collective: stopped before training, nothing "
                                 "saved\n".encode())
                    os._exit(128 + number)      # the default action's status, at once
    finally:
        os.close(reading)


def deadline(minutes: float, started: float | None = None) -> float | None:
    """The ``time.monotonic()`` at which ``train.exit_duration_minutes`` ``minutes`` (0: none)
    have passed since ``started`` (a ``time.monotonic()``: ``mimo-train``'s process start,
    ``launcher.started``; None: now); None for none."""
    if not minutes:
        return None
    return (time.monotonic() if started is None else started) + 60 * minutes


def signal_number(name: str) -> int:
    """``SIGTERM`` (or ``TERM``) -> its number; AttributeError for an unknown name."""
    name = name.upper()
    return int(getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name))


class ExitSignals:
    """The handlers of ``train.exit_signals`` on this rank, installed while the object is
    open (``with``); with ``deadline`` (a ``time.monotonic()`` value), also whether it passed."""

    def __init__(self, names: list[str], deadline: float | None = None):
        self.numbers = [signal_number(name) for name in names]
        self.deadline = deadline
        self.received = 0
        self.stopping = False       # the ranks agreed to stop on a signal
        self._since = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> ExitSignals:
        global _training
        _training = True
        for number in self.numbers:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        """The handlers before; once the ranks agreed to stop on a signal, the run's exit
        signals ignored: every rank ends in moments (its save, its claim released, its records
        closed), and torchrun sends the ranks still there a SIGTERM once the first exits
        128 + N, which would kill them before that (it kills them outright 30 s later)."""
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_IGN if self.stopping else previous)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.stopping:           # torchrun's, once a rank that stopped first has exited
            return
        if not self.received:
            self.received, self._since = number, time.monotonic()
        elif time.monotonic() - self._since > REPEAT_SECONDS:    # a second one: die now
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

    def agreed(self) -> int:
        """The signal some rank received (the largest number if several), else ``PAST_DEADLINE``
        if the deadline passed on some rank, else 0 (collective over the control group)."""
        late = self.deadline is not None and time.monotonic() >= self.deadline
        # one all-reduce for both: a signal's number, or PAST_DEADLINE, which is larger
        agreed = distributed.maximum(PAST_DEADLINE + self.received if self.received else
                                     PAST_DEADLINE if late else 0)
        self.stopping = agreed > PAST_DEADLINE
        return agreed - PAST_DEADLINE if agreed > PAST_DEADLINE else agreed
