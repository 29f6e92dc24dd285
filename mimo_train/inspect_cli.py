"""The ``mimo-inspect`` command: ``mimo_data.inspect.cli`` with mimo_train's layout advisor.

mimo_data never imports mimo_train (tests/test_architecture.py): the data tools run without
torch or megatron-core, and the model's dims and the memory and FLOPs formulas belong to the
trainer. So the advisor is injected from this side: ``mimo_data.inspect.cli.main`` takes an
``advisor`` callable, which ``plan --model M --gpus N`` calls with its request
(``mimo_data.inspect.advice``) and the dataset's per-step work
(``mimo_data.inspect.workload``); without one (``python -m mimo_data.inspect.cli``) those
options say they need mimo_train. The console script points here; the advisor (and torch,
through the families) is imported only when a plan asks for it, so ``--help`` and the other
subcommands start as fast as before.
"""

from __future__ import annotations

import sys


def advisor(request, config, workload: dict) -> int:
    from mimo_train.planning.advisor import advise
    return advise(request, config, workload)


def layout_refusal(request, config) -> tuple[str | None, bool | None]:
    from mimo_train.planning.advisor.advise import layout_refusal as refusal
    return refusal(request, config)


def main(argv: list[str] | None = None) -> int:
    from mimo_data.inspect.cli import main as inspect_main
    return inspect_main(argv, advisor=advisor, layout_refusal=layout_refusal)


if __name__ == "__main__":
    sys.exit(main())
