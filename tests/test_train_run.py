"""Training runs for real: ``torchrun --nproc-per-node 3 -m mimo_train`` with gloo on the sample
corpus, images + audio + language in a non-colocated layout (one rank per module).

- the loss goes down; evaluation runs every N steps on a validation set, the same batches each
  time; TensorBoard gets the logged scalars; checkpoints land at the interval and at the end;
- resume: a run stopped at a mid-run checkpoint (``train.exit_interval``) and started again
  gives exactly the losses of the uninterrupted run for the following steps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, preprocess_config_file

STEPS = 6
LAYOUT = "image=dp1;audio=dp1;language=dp1"


def _train(tmp: Path, name: str, checkpoints: Path, *overrides) -> list[dict]:
    records = tmp / f"{name}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "3", "-m", "mimo_train", "--config",
               str(REPO / "configs" / "train" / "images_audio_noncolocated.yaml"),
               "--records", str(records), f"checkpoint.dir={checkpoints}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [json.loads(line) for line in records.read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(loader_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-run")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    common = [f"data.datasets=[{loader_corpus}]", f"data.valid=[{loader_corpus}]",
              f"data.preprocess={preprocess}", f"layout={LAYOUT}", f"train.steps={STEPS}",
              "train.eval_interval=3", "train.eval_steps=1", "checkpoint.interval=3",
              "optimizer.warmup_steps=1", "train.global_batch_size=4",
              "train.micro_batch_size=2"]
    full = _train(tmp, "full", tmp / "full-ckpt", *common,
                  f"train.tensorboard_dir={tmp / 'tb'}")
    return tmp, common, full


def _train_records(records):
    return [r for r in records if "loss" in r]


def test_loss_goes_down_and_evaluation_follows(setup):
    _, _, full = setup
    train = _train_records(full)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in train]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.2, losses
    evals = [r for r in full if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
    # the same validation batches each time
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"] > 0
    assert all(set(r["forward_s"]) == {"image", "audio", "language"} for r in train)


def test_checkpoints_at_interval_and_end(setup):
    tmp, _, _ = setup
    root = tmp / "full-ckpt"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000003", "step_0000006"]
    assert (root / "latest").read_text() == "step_0000006"
    for step in ("step_0000003", "step_0000006"):
        assert sorted(p.name for p in (root / step).glob("rank_*.pt")) == \
            [f"rank_{r:05d}.pt" for r in range(3)]
        meta = json.loads((root / step / "meta.json").read_text())
        assert meta["step"] == int(step[-7:]) and meta["world_size"] == 3


def test_tensorboard_gets_the_scalars(setup):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _, full = setup
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    assert logged == pytest.approx([r["loss"] for r in _train_records(full)], rel=1e-6)
    assert [e.step for e in events.Scalars("eval_loss")] == [3, 6]
    assert {"forward_s/image", "forward_s/audio", "forward_s/language", "train/lr",
            "train/grad_norm", "train/tokens_per_s"} <= set(events.Tags()["scalars"])


def test_resume_continues_the_exact_sample_stream(setup):
    tmp, common, full = setup
    stopped = _train(tmp, "stopped", tmp / "resume-ckpt", *common, "train.exit_interval=3")
    assert [r["step"] for r in _train_records(stopped)] == [1, 2, 3]
    resumed = _train(tmp, "resumed", tmp / "resume-ckpt", *common)
    assert [r["step"] for r in _train_records(resumed)] == [4, 5, 6]
    expected = {r["step"]: r for r in _train_records(full)}
    for record in _train_records(resumed):
        reference = expected[record["step"]]
        assert record["tokens"] == reference["tokens"]
        assert record["loss"] == pytest.approx(reference["loss"], abs=1e-6)
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], abs=1e-6)
    eval_resumed = [r["eval_loss"] for r in resumed if "eval_loss" in r]
    assert eval_resumed == pytest.approx([r["eval_loss"] for r in full if "eval_loss" in r
                                          and r["step"] == 6], abs=1e-6)


def test_frozen_module_keeps_its_weights_under_another_layout(setup):
    """``model.init_from`` loads a 3-rank checkpoint into one colocated process; with
    ``model.freeze=[image]`` a step leaves the vision module's weights exactly as loaded and
    changes the others. The shipped warmup (3 steps) is clamped to this 1-step run."""
    import torch

    tmp, common, _ = setup
    start = tmp / "full-ckpt" / "step_0000003"
    overrides = [c for c in common if not c.startswith(("layout=", "train.eval", "data.valid",
                                                        "optimizer.warmup_steps"))]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", "-m", "mimo_train", "--config",
               str(REPO / "configs" / "train" / "images_audio_colocated.yaml"), *overrides,
               f"checkpoint.dir={tmp / 'frozen'}", f"model.init_from={start}",
               "model.freeze=[image]", "train.steps=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "mimo-train: optimizer.warmup_steps 3 clamped to 0 for a 1-step run" in \
        result.stdout
    # start-up phases, one step, summary: no third-party warning on the way
    assert "Warning" not in result.stderr, result.stderr[-5000:]
    for line in ("process groups ready (", "model and optimizer built (", "step    1: loss"):
        assert line in result.stdout, result.stdout
    before = {}
    for path in start.glob("rank_*.pt"):
        before.update(torch.load(path, weights_only=False)["model"])
    after = torch.load(tmp / "frozen" / "step_0000001" / "rank_00000.pt",
                       weights_only=False)["model"]
    assert set(after) == {"image", "audio", "language"}
    for name, weights in after["image"].items():
        assert torch.equal(weights, before["image"][name]), name
    for module in ("audio", "language"):
        changed = [n for n, w in after[module].items() if not torch.equal(w, before[module][n])]
        assert changed, f"{module} did not train"
