"""``python -m mimo_train`` with a gate before the second step, for tests/test_train_run.py's
signal and kill tests under real torchrun::

    torchrun --standalone --nproc-per-node 3 tests/jobs/gated_train.py GATE --config ... k=v

Each rank waits before its second train step until the file GATE exists or it has received
one of ``train.exit_signals`` itself. The test signals or kills a rank once step 1 is logged
and only then creates GATE (or, when torchrun forwards the signal to every rank, never): the
run cannot get past step 2 before the signal has arrived, however late a loaded machine lets
the test send it. Without the gate, the five steps left after step 1 (a few seconds) could
all run first. Everything else is ``mimo-train`` as a user runs it.
"""

import sys
import time
from pathlib import Path

from mimo_train import cli
from mimo_train.runtime import preemption
from mimo_train.training.trainer import Trainer

GATE = Path(sys.argv.pop(1))
received: list[int] = []


def _handle(self, number, frame, handle=preemption.ExitSignals._handle):
    received.append(number)
    handle(self, number, frame)


def _train_step(self, iterator, step=Trainer.train_step):
    if self.step == 1:                                  # step 1 done (and logged by rank 0)
        while not received and not GATE.exists():
            time.sleep(0.05)
    return step(self, iterator)


preemption.ExitSignals._handle = _handle
Trainer.train_step = _train_step

if __name__ == "__main__":
    cli.run()
