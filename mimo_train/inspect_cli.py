"""The ``mimo-inspect`` command: ``mimo_data.inspect.cli`` with mimo_train's layout advisor.

mimo_data never imports mimo_train (tests/test_architecture.py): the data tools run without
torch or megatron-core, and the model's dims and the memory and FLOPs formulas belong to the
trainer. So the advisor is injected from this side: ``mimo_data.inspect.cli.main`` takes an
``advisor`` callable, which ``plan --model M --gpus N`` calls with its request
(``mimo_data.inspect.advice``) and the dataset's per-step work
(``mimo_data.inspect.workload``); without one (``python -m mimo_data.inspect.cli``) those
options say they need mimo_train. The console script points here; the advisor (and torch,
through the families) is imported only when a plan asks for it, so ``--help`` and the other
subcommands start as fast as before. The ``checkpoint`` subcommand (a training run's
checkpoints, not a dataset's) is injected the same way.
"""

from __future__ import annotations

import sys


def advisor(request, config, workload: dict) -> int:
    from mimo_train.planning.advisor import advise
    return advise(request, config, workload)


def layout_refusal(request, config) -> tuple[str | None, bool | None, bool]:
    from mimo_train.planning.advisor.advise import layout_refusal as refusal
    return refusal(request, config)


def run_settings(path: str, preprocess_path: str) -> dict:
    """The training YAML ``path``'s settings ``plan`` takes (``mimo_data.inspect.cli.
    RUN_SETTINGS``' keys), as the trainer reads them: its values of those keys alone, read
    with the trainer's types and defaults (its layout, datasets and the rest are the plan's
    own options' or the advisor's); ValueError where it cannot be read."""
    import json
    import os

    import yaml

    from mimo_data.files import load_yaml
    from mimo_train.config import TrainConfig, refuse_preprocessing_config
    from mimo_train.config.sources import resolve_paths
    from mimo_train.errors import TrainConfigError
    try:
        with open(path) as f:
            data = load_yaml(f) or {}
        if isinstance(data, dict):
            refuse_preprocessing_config(data, path)
    except OSError as error:
        raise ValueError(f"--model {path}: {error.strerror or error}") from None
    except (yaml.YAMLError, TrainConfigError) as error:
        raise ValueError(f"--model {path}: {error}") from None
    keys = ("train.global_batch_size", "train.micro_batch_size", "train.seed", "data.balance")
    given = []
    for key in keys:
        section, name = key.split(".")
        values = data.get(section) if isinstance(data, dict) else None
        if isinstance(values, dict) and name in values:
            given.append(f"{key}={json.dumps(values[name])}")
    try:
        cfg = TrainConfig.load(None, ["data.datasets=[unused]", "data.preprocess="
                                      f"{os.path.abspath(preprocess_path)}", *given])
    except TrainConfigError as error:
        raise ValueError(f"--model {path}: {error}") from None
    layout = data.get("layout") if isinstance(data, dict) else None
    own = data.get("data") if isinstance(data, dict) else None
    run_data = {key: own.get(key) for key in ("datasets", "weights")} \
        if isinstance(own, dict) else {}
    try:
        resolve_paths({"data": run_data}, os.path.dirname(os.path.abspath(path)))
    except TrainConfigError as error:       # a mistyped URL, say
        raise ValueError(f"--model {path}: {error}") from None
    datasets, weights = run_data.get("datasets"), run_data.get("weights")
    return {"train.global_batch_size": cfg.train.global_batch_size,
            "train.micro_batch_size": cfg.train.micro_batch_size, "train.seed": cfg.train.seed,
            "data.balance": cfg.data.balance,
            "layout": layout if isinstance(layout, str) else None,
            # the run's data, as the trainer resolves its paths (said where DIR is not it)
            "data.datasets": datasets if isinstance(datasets, list) else None,
            "data.weights": weights if isinstance(weights, list) else None}


def preprocess_of(path: str) -> str | None:
    """The training YAML ``path``'s own ``data.preprocess`` (``plan --model TRAIN.yaml``
    without ``--config``), or None."""
    from mimo_train.planning.advisor.inputs import own_preprocess
    return own_preprocess(path)


def checkpoint(args) -> int:
    """``mimo-inspect checkpoint``: a training run's checkpoints (no torch imported)."""
    from mimo_train.components.checkpoint_report import main as check
    return check(args)


def main(argv: list[str] | None = None) -> int:
    from mimo_data.inspect.cli import main as inspect_main
    return inspect_main(argv, advisor=advisor, layout_refusal=layout_refusal,
                        run_settings=run_settings, checkpoint=checkpoint,
                        preprocess_of=preprocess_of)


if __name__ == "__main__":
    sys.exit(main())
