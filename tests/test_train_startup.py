"""Bad configs fail at start-up with one clear message, never a hang: config errors before the
process groups exist, stub ranks, non-divisible batches, colocated fan-in with variable counts,
missing shards, a vocab smaller than the tokenizer, encoder tp, unknown encoder modules and a
missing pretrained encoder.

Each case runs for real: ``torchrun --standalone --nproc-per-node 3 -m mimo_train --config CFG
key=value ...`` with gloo on the CPU. torchrun writes each rank's stderr to its own file
(``--log-dir``, ``--redirects 3``), so the test sees exactly what every rank printed: rank 0
prints one ``mimo-train: mimo_train start-up failed (PHASE)`` message naming the ranks, the
numbers or paths involved and the fix; the other ranks print nothing of it; no rank prints a
Python traceback or a third-party warning. A hang would run into the subprocess
timeout, which kills the whole process group and fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, preprocess_config_file

NPROC = 3
TIMEOUT = 120          # seconds: a hang fails the test instead of blocking the suite

# The default preprocessing config's image section (dynamic resolution), for image-only files.
DYNAMIC_IMAGE = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())[
    "modalities"]["image"]


@pytest.fixture(scope="module")
def preprocess(tmp_path_factory) -> dict:
    """Preprocessing configs: image + audio (the default), image only (dynamic resolution),
    image only (fixed 28 px, 4 tokens per image)."""
    tmp = tmp_path_factory.mktemp("startup-preprocess")
    return {"default": preprocess_config_file(tmp / "p.yaml"),
            "image": preprocess_config_file(tmp / "p_image.yaml", image=DYNAMIC_IMAGE),
            "fixed": preprocess_config_file(tmp / "p_fixed.yaml", image={
                "policy": "fixed", "image_size": 28, "patch_size": 14})}


def _base_config(tmp_path: Path, datasets, preprocess_file) -> Path:
    """A small model that would train as is with the default 3-rank layout."""
    config = {
        "data": {"datasets": [str(d) for d in datasets], "preprocess": str(preprocess_file)},
        "layout": "image=dp1;audio=dp1;language=dp1",
        "model": {"language": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}},
        "optimizer": {"warmup_steps": 0},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu"},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchrun(tmp_path: Path, config: Path, overrides: list[str]):
    """Run the job; returns (exit code, {rank: its stderr}, torchrun's own output)."""
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(NPROC), "--log-dir", str(logs), "--redirects", "3",
               "-m", "mimo_train", "--config", str(config), *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        launcher, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)         # torchrun and every rank
        launcher, _ = process.communicate()
        ranks = {p.parent.name: p.read_text(errors="replace")[-2000:]
                 for p in logs.glob("*/attempt_0/*/stderr.log")}
        pytest.fail(f"start-up hung: no exit within {TIMEOUT} s\n{launcher[-3000:]}\n{ranks}")
    ranks = {int(p.parent.name): p.read_text(errors="replace")
             for p in logs.glob("*/attempt_0/*/stderr.log")}
    return process.returncode, ranks, launcher


def _check_startup_failure(tmp_path, config, overrides, phase: str, expected: list[str]):
    code, ranks, launcher = _torchrun(tmp_path, config, overrides)
    context = f"torchrun output:\n{launcher[-3000:]}\nrank stderr:\n" + "\n".join(
        f"--- rank {r}:\n{text[-3000:]}" for r, text in sorted(ranks.items()))
    assert code != 0, f"the job exited 0 with a bad config\n{context}"
    assert sorted(ranks) == list(range(NPROC)), f"missing rank logs\n{context}"
    for rank, text in sorted(ranks.items()):
        assert "Traceback" not in text, f"rank {rank} printed a traceback\n{context}"
        assert "Warning" not in text, f"rank {rank} printed a warning\n{context}"
        if rank:
            assert "mimo-train" not in text and "start-up failed" not in text, \
                f"rank {rank} printed the start-up error too\n{context}"
    text = ranks[0]
    assert text.count("mimo-train: ") == 1, \
        f"rank 0 printed the start-up error {text.count('mimo-train: ')} times\n{context}"
    message = text[text.index("mimo-train: "):]
    assert f"mimo_train start-up failed ({phase})" in message, context
    # every rank failed for the same reason, and the message says so
    assert f"rank(s) {list(range(NPROC))}:" in message, context
    for part in expected:
        assert part in message, f"{part!r} not in the message\n{context}"


# (id, preprocessing config, overrides, failing phase, substrings the user needs). Overrides
# and substrings may use {tmp}: the test's tmp_path.
CASES = [
    # -- stub ranks
    # -- a config error before the process groups exist (the ranks still agree)
    ("unknown key in an override", "default",
     ["train.stpes=3"], "config",
     ["TrainConfigError: unknown key(s) train.stpes", "known under train.: "]),
        ("two-rank layout on three ranks", "default",
     ["layout=image=dp1;language=dp1"], "config",
     ["ranks 2..2 are in no module", "image 1 + language 1 = 2 ranks", "the world has 3",
      "run 2 ranks"]),
    ("layout with a gap", "default",
     ["layout=image=dp1;audio=dp1,off2;language=dp1"], "config",
     ["ranks 1..1 are in no module", "gap before 'audio' at offset 2", "set its offset to 1"]),
    # -- non-divisible batches
    ("global batch not a multiple of micro batch x language dp", "image",
     ["layout=image=dp1;language=dp2", "train.global_batch_size=6"], "config",
     ["global batch 6 is not a multiple of micro batch 2 x language dp 2 = 4",
      "use a global batch that is a multiple of 4"]),
    ("encoder dp does not divide the global micro-batch", "image",
     ["layout=image=dp2;language=dp1", "train.micro_batch_size=1"], "config",
     ["module 'image' has dp 2", "global micro-batch of 1 samples",
      "micro batch 1 x language dp 1", "make the micro batch a multiple of 2"]),
    # -- colocated modules of different dp with variable counts (megatron-core's colocated
    #    bridge splits evenly; non-colocated fan-in routes any counts)
    ("colocated fan-in of dynamic-resolution images", "image",
     ["layout=image=dp3,off0;language=tp3,off0", "train.micro_batch_size=3",
      "train.global_batch_size=6"], "config",
     ["colocated module 'image' (dp 3)", "variable token count", "'language' (dp 1)",
      "Give image dp 1", "policy: fixed"]),
    # -- missing shards
    ("dataset directory does not exist", "default",
     ["data.datasets=[{tmp}/no-such-shards]"], "config",
     ["no shards at {tmp}/no-such-shards", "index.json is missing",
      "mimo-shard build ... --output {tmp}/no-such-shards"]),
    ("dataset directory without index.json", "default",
     ["data.datasets=[{tmp}/unfinished]"], "config",
     ["no shards at {tmp}/unfinished", "index.json is missing",
      "mimo-shard build ... --output {tmp}/unfinished"]),
    # -- vocab smaller than the tokenizer
    ("vocab smaller than the tokenizer", "default",
     ["model.language.vocab_size=1000"], "config",
     ["model.language.vocab_size 1000 is smaller than the tokenizer's 49154 tokens",
      "set it >= 49154 or leave it unset"]),
    # -- encoder modules the trainer cannot build
    ("encoder with tp2", "image",
     ["layout=image=tp2;language=dp1"], "model",
     ["encoder module 'image' has tp 2", "use dp only for encoders"]),
    ("model.encoders names a module the layout lacks", "default",
     ["model.encoders.foo.hidden_size=16"], "model",
     ["model.encoders has ['foo']", "does not name", "rename them"]),
    ("pretrained encoder path does not exist", "default",
     ["model.encoders.image.pretrained=/nonexistent"], "model",
     ["model.encoders.image.pretrained", "/nonexistent"]),
]


def _case_id(case) -> str:
    name = case.values[0] if hasattr(case, "values") else case[0]
    return name.replace(" ", "-").replace(",", "")


@pytest.mark.parametrize("name, preprocess_kind, overrides, phase, expected", CASES,
                         ids=[_case_id(case) for case in CASES])
def test_bad_config_fails_cleanly_on_every_rank(tmp_path, loader_corpus, preprocess, name,
                                                 preprocess_kind, overrides, phase, expected):
    unfinished = tmp_path / "unfinished"            # an interrupted build: shards, no index
    unfinished.mkdir()
    for shard in sorted(loader_corpus.glob("*.tar"))[:1]:
        (unfinished / shard.name).write_bytes(shard.read_bytes())
    config = _base_config(tmp_path, [loader_corpus], preprocess[preprocess_kind])
    _check_startup_failure(tmp_path, config, [o.format(tmp=tmp_path) for o in overrides],
                           phase, [e.format(tmp=tmp_path) for e in expected])

