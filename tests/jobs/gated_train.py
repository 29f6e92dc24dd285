"""``python -m mimo_train`` with a gate once step 1 is logged, for tests/test_train_run.py's
signal and kill tests under real torchrun::

    torchrun --standalone --nproc-per-node 3 tests/jobs/gated_train.py GATE --config ... k=v

Each rank waits once it has settled step 1 (``Trainer.settle``: step 1's record read and
logged, inside step 2 after its passes, before its update) until the file GATE exists or it
has received one of ``train.exit_signals`` itself. The test signals or kills a rank once step
1 is logged and only then creates GATE (or, when torchrun forwards the signal to every rank,
never): the run cannot get past step 2 before the signal has arrived, however late a loaded
machine lets the test send it. Without the gate, the five steps left after step 1 (a few
seconds) could all run first. Everything else is ``mimo-train`` as a user runs it.
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


def _settle(self, settle=Trainer.settle):
    first = self.unsettled is not None and self.unsettled.step == 1
    settled = settle(self)
    if first:                                           # step 1 logged (by rank 0)
        while not received and not GATE.exists():
            time.sleep(0.05)
    return settled


preemption.ExitSignals._handle = _handle
Trainer.settle = _settle

if __name__ == "__main__":
    cli.run()
