"""Start-up failure cases one after another in one ``torchrun`` job, for
tests/test_train_startup.py.

    torchrun --nproc-per-node 3 tests/jobs/startup_cases.py CASES.json OUT

``CASES.json`` lists argument lists of ``mimo-train``; every rank runs ``mimo_train.cli.main``
on each in turn (``{rank}`` in an argument: the rank's number), as the command line would,
and writes ``OUT/<case>/rank_<R>.stderr`` (what the rank printed to stderr during that case:
warnings included, each shown every time) and ``OUT/<case>/rank_<R>.code`` (its exit
status). The ranks stay in the job between cases
(``distributed.destroy`` does nothing until the end): joining it again would meet the last
case's addresses in torchrun's store. One job for all cases: torch and megatron-core load once.
"""

import contextlib
import json
import os
import sys
import warnings

from mimo_train.runtime import distributed
from mimo_train.cli import main as mimo_train


def main(cases_path: str, out: str) -> None:
    with open(cases_path) as f:
        cases = json.load(f)
    rank = os.environ["RANK"]
    warnings.simplefilter("always")     # a warning seen in one case is shown in the next too
    leave, distributed.destroy = distributed.destroy, lambda: None
    for index, argv in enumerate(cases):
        folder = os.path.join(out, str(index))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{rank}.stderr"), "w") as err, \
                open(os.devnull, "w") as out_, contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(out_):
            code = mimo_train([arg.replace("{rank}", rank) for arg in argv])
        with open(os.path.join(folder, f"rank_{rank}.code"), "w") as f:
            f.write(str(code))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
