"""Steps that go wrong, traced to their samples (mimo_train/components/anomalies.py), under
torchrun:

- a planted sample whose text SmolLM2 finds very unlikely (150 random vocabulary words among
  short plain-English answers) makes its step's loss spike: the step's record names its
  samples, the planted one among them, and ``mimo-inspect sample`` finds it by that key;
- an exploding learning rate makes the gradient norm non-finite: each such step is skipped
  (recorded with its samples, no weight moves), and past ``train.max_skipped_steps`` the run
  stops on every rank with one message and exit status 1, the records written.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, build_dataset, preprocess_config_file

SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"
ANSWERS = ["Paris is the capital of France.", "Water boils at one hundred degrees.",
           "The sun rises in the east.", "Cats like to sleep in the sun.",
           "A week has seven days.", "Bread is made from flour.", "Snow is cold and white.",
           "Bees make honey from flowers.", "The moon goes around the earth.",
           "Trees grow from seeds.", "Rain falls from the clouds."]


def _train(tmp: Path, name: str, *overrides: str, nproc: int = 1) -> tuple[int, str, list]:
    records = tmp / f"{name}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "mimo_train", "--config",
               str(REPO / "configs" / "train" / "images_language_colocated.yaml"),
               "--records", str(records), "train.device=cpu", "checkpoint.dir=null",
               *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=400)
    lines = records.read_text().splitlines() if records.is_file() else []
    return result.returncode, result.stdout + result.stderr, [json.loads(x) for x in lines]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path, str]:
    """Text-only shards: eleven short answers and one long random one (the planted key)."""
    tmp = tmp_path_factory.mktemp("anomalies")
    from transformers import AutoTokenizer
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)      # 150 random words: loss ~13
    garbage = tokenizer.decode([rng.randrange(1000, 49000) for _ in range(150)])
    records = [{"id": f"plain-{i:02d}", "conversations": [
        {"from": "human", "value": "Tell me a fact."}, {"from": "gpt", "value": answer}]}
        for i, answer in enumerate(ANSWERS)]
    records.append({"id": "planted", "conversations": [
        {"from": "human", "value": "Tell me a fact."}, {"from": "gpt", "value": garbage}]})
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    import yaml
    config = yaml.safe_load(preprocess.read_text())
    config.update(tokenizer=str(SMOLLM2), modalities={})
    preprocess.write_text(yaml.safe_dump(config))
    return tmp / "shards", preprocess, f"{len(ANSWERS):09d}"     # keys follow record order


def test_a_planted_sample_spikes_its_step_and_is_named(planted, tmp_path):
    """SmolLM2 (learning rate 0: its own losses) over two epochs of batches of two: every
    step holding the planted sample after the first few is recorded as a spike, its samples
    (dataset, key, tokens) in the record; no other step is."""
    shards, preprocess, key = planted
    code, output, records = _train(
        tmp_path, "spike", f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
        "layout=language=dp1", f"model.language.pretrained={SMOLLM2}", "model.encoders={}",
        "model.language.num_layers=null", "model.language.hidden_size=null",
        "model.language.num_attention_heads=null", "optimizer.lr=0", "optimizer.min_lr=0",
        "optimizer.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.steps=12", "train.log_interval=4", "train.spike_factor=2.5",
        "train.spike_window=4")
    assert code == 0, output[-4000:]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    spikes = [r for r in records if "anomaly" in r]
    assert spikes, (losses, output[-2000:])
    for spike in spikes:
        anomaly = spike["anomaly"]
        assert anomaly["reason"].startswith("loss spike") and not anomaly["skipped"]
        assert anomaly["loss"] == pytest.approx(losses[spike["step"]])
        assert [s["key"] for s in anomaly["samples"]].count(key) == 1, anomaly
        assert len(anomaly["samples"]) == 2
        assert {s["dataset"] for s in anomaly["samples"]} == {str(shards)}
        assert all(s["tokens"] > s["trained_tokens"] > 0 for s in anomaly["samples"])
    # the planted sample is in 2 of the 12 steps (one per epoch); at most those spike
    assert len(spikes) <= 2
    from mimo_data.inspect.cli import main
    assert main(["sample", str(shards), "--config", str(preprocess), "--key", key]) == 0


def test_non_finite_steps_are_skipped_then_the_run_stops(planted, tmp_path):
    """A learning rate of 1e30 makes the second step's activations overflow: steps 2, 3 and 4
    are skipped (each recorded with its two samples), and with train.max_skipped_steps=2 the
    third skip stops the run: exit 1, one message, the records written."""
    shards, preprocess, _ = planted
    code, output, records = _train(
        tmp_path, "nan", f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
        "layout=language=dp1", "model.encoders={}", "optimizer.lr=1e30", "optimizer.min_lr=0",
        "optimizer.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.steps=8", "train.max_skipped_steps=2")
    assert code != 0, output[-3000:]
    assert output.count("steps were skipped for a non-finite gradient norm") == 1, output
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["skipped"] for r in train] == [False, True, True, True]
    assert all(not math.isfinite(r["grad_norm"]) for r in train[1:])
    skipped = [r["anomaly"] for r in records if "anomaly" in r]
    assert [a["skipped_steps"] for a in skipped] == [1, 2, 3]
    assert all(a["skipped"] and len(a["samples"]) == 2 for a in skipped)
