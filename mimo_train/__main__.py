"""``python -m mimo_train`` (under torchrun: ``torchrun --nproc-per-node N -m mimo_train``)."""

from mimo_train.cli import run

run()
