"""``python -m mimo_train`` (under torchrun: ``torchrun --nproc-per-node N -m mimo_train``)."""

import sys

from mimo_train.cli import main

sys.exit(main())
