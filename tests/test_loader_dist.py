"""The loader in real multi-process jobs: ``torchrun`` with gloo, one loader per rank.

Run 1: 3 ranks, language dp2 + images dp1 (one DataLoader worker per rank), one epoch; the
ranks gather what they consumed and rank 0 checks exactly-once and cross-module order.
Run 2: 4 ranks, language pp2 dp1 + images dp2 (another layout, another micro-batch), resumed
from the state run 1 saved after two steps: its steps must be run 1's remaining steps, keys
and tensors alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, preprocess_config_file

TORCHRUN = Path(sys.executable).parent / "torchrun"
SCRIPT = Path(__file__).parent / "loader_dist_run.py"
GLOBAL_BATCH = 8
SAVE_AFTER = 2


def torchrun(ranks: int, out: Path, *args) -> dict:
    command = [str(TORCHRUN) if TORCHRUN.exists() else sys.executable, *(
        [] if TORCHRUN.exists() else ["-m", "torch.distributed.run"]),
        "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT), "--out", str(out),
        "--global-batch-size", str(GLOBAL_BATCH), "--seed", "21", *map(str, args)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(SCRIPT.parent)]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                            cwd=REPO)
    assert result.returncode == 0, (f"torchrun exited {result.returncode}\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(loader_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist")
    # Fixed-resolution images: the only way encoder dp > language dp (run 2) is allowed.
    config = preprocess_config_file(folder / "fixed.yaml",
                                    image={"policy": "fixed", "image_size": 112})
    common = ["--dataset", loader_corpus, "--config", config]
    first = torchrun(3, folder / "first.json", *common, "--layout", "language=dp2;images=dp1",
                     "--micro-batch-size", 2, "--workers", 1, "--save-after-steps", SAVE_AFTER)
    (folder / "state.json").write_text(json.dumps(first["state"]))
    second = torchrun(4, folder / "second.json", *common, "--layout",
                      "language=pp2,dp1;images=dp2", "--micro-batch-size", 2,
                      "--state", folder / "state.json")
    return first, second


def test_one_epoch_on_three_ranks_serves_every_kept_sample_once(runs, loader_corpus):
    first, _ = runs
    assert first["problems"] == [] and first["world_size"] == 3
    kept = {f"0/{row['key']}" for row in pq.read_table(loader_corpus / "samples.parquet")
            .to_pylist() if not row["audio_duration"]}           # image-only config
    for module in ("language", "images"):
        steps = first["modules"][module]
        assert [s["step"] for s in steps] == list(range(len(kept) // GLOBAL_BATCH))
        served = [key for step in steps for key in step["keys"]]
        assert len(served) == len(set(served)) and set(served) <= kept
        assert len(kept - set(served)) == len(kept) % GLOBAL_BATCH
    assert [s["keys"] for s in first["modules"]["language"]] == \
        [s["keys"] for s in first["modules"]["images"]]
    assert {"/input_ids", "/labels"} <= set(first["modules"]["language"][0]["digests"])
    assert any(s["digests"] for s in first["modules"]["images"])
    assert (first["state"]["step"], first["state"]["micro_batch"]) == (SAVE_AFTER, 0)


def test_resume_on_four_ranks_with_another_layout_continues_exactly(runs):
    first, second = runs
    assert second["problems"] == [] and second["world_size"] == 4
    for module in ("language", "images"):
        assert second["modules"][module] == first["modules"][module][SAVE_AFTER:], module
