"""tools/gpu_check/run.py, the project's GPU check, run here as on the GPU machine but with tiny
dims on the CPU (``--tiny``) so that it cannot rot: every step runs, the trainings through the
suite's forked ranks instead of torchrun (the check's own launcher is a parameter)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools/gpu_check/run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def summary(ranks, tmp_path_factory) -> dict:
    def launch(args: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
        job = ranks.run(1, ["-m", "mimo_train", *args], log.with_suffix(""), env=env,
                        timeout=max(timeout, 1))
        log.write_text(job.stdout + job.stderr)
        return job.codes[0]

    out = tmp_path_factory.mktemp("gpu-check")
    # no budget: the check skips what would start after it (on a GPU machine, its time), and
    # a busy machine must not make a case skipped here; each training is still bounded (240 s)
    found = _module().run(out, tiny=True, budget_s=math.inf, launch=launch)
    assert json.loads((out / "summary.json").read_text()) == found
    return found


def test_every_step_ran_on_the_cpu(summary):
    assert summary["packages"]["missing"] == []
    assert summary["env"]["cuda"] is False and summary["env"]["megatron_core"]
    assert all(probe["skipped"] == "no CUDA" for probe in summary["kernels"].values())
    assert "error" not in summary["shards"], summary["shards"]
    parity = summary["parity"]
    assert "error" not in parity, parity
    # the "device" is the CPU here: the same two steps twice, so equal to the bit
    assert len(parity["device_losses"]) == 2 and parity["max_abs_loss_diff"] == 0.0


def test_cases_train_the_same_batches_with_figures(summary):
    cases = summary["cases"]
    assert set(cases) == {"sdpa_unpacked", "varlen_packed", "sdpa_packed", "local_unpacked",
                          "local_packed", "sdpa_packed_recompute_full"}
    # varlen is a CUDA kernel: refused at start-up on the CPU, the refusal recorded
    assert "varlen" in cases.pop("varlen_packed")["error"]
    first = []
    for name, case in cases.items():
        assert "skipped" not in case, f"{name}: {case} (the check ran out of its budget_s)"
        assert "error" not in case and case["steps"] == 2, (name, case)
        assert all(math.isfinite(loss) for loss in case["losses"])
        assert case["median_seconds"] > 0 and case["median_tflops_per_gpu"] > 0, (name, case)
        assert case["median_memory_mib"] > 0 and case["peak_gpu_mib"] is None
        assert case["predicted_mib"] > 0, case          # the layout advisor's memory model
        first.append(case["losses"][0])
    # every kernel, packing and recompute sees the same samples: one first-step loss (4
    # decimals kept)
    assert max(first) - min(first) <= 2e-4, cases
