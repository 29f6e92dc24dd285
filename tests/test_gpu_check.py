"""tools/gpu_check/run.py, the project's GPU check, run here as on the GPU machine but with tiny
dims on the CPU (``--tiny``) so that it cannot rot: every step runs, mimo's trainings and the
peer's (transformers' own model on the same batches, tools/gpu_check/peer.py) through the
suite's forked ranks instead of torchrun (the check's own launcher is a parameter)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

PEER = REPO / "tools" / "gpu_check" / "peer.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools/gpu_check/run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _peer():
    spec = importlib.util.spec_from_file_location("gpu_check_peer", PEER)
    assert spec and spec.loader
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


@pytest.fixture(scope="module")
def check_out(tmp_path_factory) -> Path:
    """The folder the CPU check writes to (its logs under work/)."""
    return tmp_path_factory.mktemp("gpu-check")


@pytest.fixture(scope="module")
def summary(ranks, check_out) -> dict:
    def launch(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
        job = ranks.run(1, argv, log.with_suffix(""), env=env, timeout=max(timeout, 1))
        log.write_text(job.stdout + job.stderr)
        return job.codes[0]

    out = check_out
    # no budget: the check skips what would start after it (on a GPU machine, its time), and
    # a busy machine must not make a case skipped here; each training is still bounded (240 s)
    found = _module().run(out, tiny=True, budget_s=math.inf, launch=launch)
    assert json.loads((out / "summary.json").read_text()) == found
    return found


def test_every_step_ran_on_the_cpu(summary):
    assert summary["packages"]["missing"] == [] and summary["packages"]["unmet"] == []
    assert summary["env"]["cuda"] is False and summary["env"]["megatron_core"]
    assert all(probe["skipped"] == "no CUDA" for probe in summary["kernels"].values())
    shards = summary["shards"]
    assert shards["samples"] == 64 and shards["images"] > 0 and shards["clips"] > 0, shards
    assert summary["checkpoint"]["checkpoint"].endswith("Qwen--Qwen2-VL-2B-Instruct")
    parity = summary["parity"]
    assert "error" not in parity, parity
    # the "device" is the CPU here: the same two steps twice, so equal to the bit
    assert len(parity["device_losses"]) == 2 and parity["max_abs_loss_diff"] == 0.0
    assert parity["cpu_s"] > 0 and "device_s" not in parity, parity     # one side's run


def test_a_package_the_project_does_not_allow_is_named(tmp_path):
    """The GPU image brings its own torch and transformers: one at a version pyproject.toml
    does not allow is named before any case fails on it (a CUDA build's local version tag
    and a requirement for another platform are no finding)."""
    import importlib.metadata
    torch_version = importlib.metadata.version("torch")
    transformers_version = importlib.metadata.version("transformers")
    (tmp_path / "pyproject.toml").write_text(
        "[project]\ndependencies = [\n"
        f'  "torch=={torch_version.split('+')[0]}",\n'
        '  "transformers>=99",\n  "no-such-package>=1",\n'
        "  \"pillow>=999; sys_platform == 'win32'\",\n]\n")
    assert _module().unmet(tmp_path / "pyproject.toml") == [
        f"transformers {transformers_version} (needs >=99)"]


@pytest.fixture
def pyav_stub_forgotten():
    """The PyAV stub a test's build imports, and the project's modules first imported beside
    it (which hold the stub as ``av``), leave ``sys.modules`` after it: left there, the
    module's later shards (and every later file's ``import av`` in this worker) would take
    the stub for PyAV and hold no clips."""
    before = set(sys.modules)
    yield
    project = [REPO / folder for folder in ("mimo_data", "mimo_train", "tools")]
    for name in set(sys.modules) - before:
        file = Path(getattr(sys.modules[name], "__file__", None) or "/")
        if any(file.is_relative_to(folder) for folder in project):
            del sys.modules[name]


def test_without_pyav_the_shards_hold_no_clips_and_say_why(tmp_path, monkeypatch,
                                                             pyav_stub_forgotten):
    """Where PyAV's wheel was not carried (the GPU image has no PyAV), the packages step goes
    on without it, the check's shards are the corpus's image and text conversations, the
    summary says why there are no clips, and the cases' configs neither expand video nor
    route it to the tower."""
    import yaml
    module = _module()
    missing = module._missing
    monkeypatch.setattr(module, "_missing", lambda name: name == "av" or missing(name))
    monkeypatch.setattr(sys, "path", list(sys.path))         # the stub goes on it
    (tmp_path / "work").mkdir()
    check = module.Check(tmp_path, True, math.inf, lambda *a: 0, None, tmp_path / "work")
    shards = module.build_shards(check)
    assert shards["clips"] == 0 and shards["images"] > 0, shards
    assert shards["video"] == "no PyAV: no clips" and not check.video
    check.checkpoints["2B"] = module.REPLICA
    preprocess = yaml.safe_load(module.preprocessing(check, 8192).read_text())
    assert "video" not in preprocess["modalities"] and "image" in preprocess["modalities"]
    config = yaml.safe_load(module.write_config(check, "case", "cpu", {}).read_text())
    assert config["layout"] == "language=dp1;image=dp1,off0"
    # the packages step without any carried wheel: PyAV alone missing is no error
    monkeypatch.setattr(module, "ROOT", tmp_path)
    packages = module.install_packages(gpu=False)
    assert packages["missing"] == ["av"] and packages["av"] == "stub", packages
    assert "installed" not in packages and "error" not in packages, packages


def test_shards_built_under_a_relative_work_folder_keep_their_media(tmp_path, monkeypatch):
    """``--out OUT`` as the README writes it is relative: the replicated corpus's media paths
    must not be read relative to the JSONL's folder a second time (every media record was
    skipped as missing_media, the cases trained text alone)."""
    module = _module()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "work").mkdir(parents=True)
    check = module.Check(Path("out"), True, math.inf, lambda *a: 0, None, Path("out/work"))
    shards = module.build_shards(check)
    assert shards["images"] > 0, shards


RUN = {"packed_8k", "unpacked", "packed_8k_recompute_full", "packed_8k_local",
       "lora_7b_packed_8k"}
WITH_PEER = {"packed_8k", "unpacked", "packed_8k_recompute_full", "lora_7b_packed_8k"}


def test_cases_train_the_same_batches_with_figures(summary):
    cases = summary["cases"]
    assert set(cases) == RUN | {"packed_32k", "packed_8k_sdpa"}
    # on the CPU the 32k and sdpa cases would be packed_8k's run again (SDPA, tiny batches)
    assert "same run as packed_8k" in cases["packed_32k"]["skipped"]
    assert "same run as packed_8k" in cases["packed_8k_sdpa"]["skipped"]
    # the goal's case sizes its tower's recompute against the GPU: none here, so recomputed
    assert cases["packed_8k"]["tower_kept"] == {"kept": False, "capacity_mib": None}
    first = []
    for name in RUN:
        case = cases[name]["mimo"]
        assert "error" not in case and case["steps"] == 2, (name, case)
        assert all(math.isfinite(loss) for loss in case["losses"])
        assert case["median_seconds"] > 0 and case["median_tflops_per_gpu"] > 0, (name, case)
        assert case["median_memory_mib"] > 0 and case["peak_gpu_mib"] is None
        # the wait for the micro-batches: the median of the same steps' records (both here)
        work = Path(summary["shards"]["dir"]).parent
        records = [json.loads(line) for line in
                   (work / f"{name}.jsonl").read_text().splitlines() if '"loss"' in line]
        waits = [record["data_wait_s"] for record in records]
        assert case["median_data_wait_s"] == statistics.median(waits) >= 0, (name, waits)
        # the profiled step (the last) against the timed ones (here both steps)
        seconds = [record["seconds"] for record in records]
        assert case["seconds_by_step"] == seconds
        assert case["profiled_over_timed"] == round(seconds[-1] / statistics.median(seconds), 3)
        assert "busy_over_timed" not in case        # kernel time: a GPU's profile alone
        assert case["predicted_mib"] > 0, case          # the layout advisor's memory model
        parts = case["predicted_gib"]
        assert parts["total"] * 1024 == pytest.approx(case["predicted_mib"], abs=8), parts
        assert parts["activations"] > 0 and parts["weights"] > 0, parts
        assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(
            parts["total"], abs=0.03), parts
        peaks = case["memory_mib_by_step"]
        assert len(peaks) == 2 and peaks == sorted(peaks), peaks    # a peak since the start
        assert case["memory_error"] == round(case["predicted_mib"] / peaks[-1] - 1, 4)
        if cases[name]["packed"] and name != "lora_7b_packed_8k":     # the 2B model's
            first.append(case["losses"][0])
    # packed, every attention kernel and recompute sees the same samples: one first-step loss
    assert max(first) - min(first) <= 2e-5, cases


def test_a_sides_busy_share_is_its_kernels_time_over_the_timed_steps(tmp_path):
    """On a GPU the profile holds the kernels' time a profiled step (``busy_ms_per_step``,
    which the profiler does not slow); a side's ``busy_over_timed`` is that over the median
    of the steps between the warm-up and the profiler's lead-in (profiled, so slowed)."""
    seconds = [9.0, 3.0, 1.2, 1.0, 1.1, 1.9, 2.0, 2.2]  # warm-up 2, timed 3, lead-in, profiled 2
    records = [{"loss": 1.0, "seconds": s} for s in seconds]
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "profile_rank0.json").write_text(json.dumps(
        {"device": "cuda", "busy_ms_per_step": 880.0}))
    figures = _module()._figures(records, 0, tmp_path / "log", 8, 2, tmp_path / "profile")
    assert figures["median_seconds"] == 1.1
    assert figures["busy_over_timed"] == 0.8 and figures["profiled_over_timed"] == 1.909


def test_each_case_is_profiled(summary, check_out):
    for name in RUN:
        profile = summary["cases"][name]["mimo"]["profile"]
        # torch's CUDA build profiling on a machine without a GPU logs no device error
        assert "gpuGetDeviceCount" not in (check_out / "work" / f"{name}.log").read_text()
        assert profile["device"] == "cpu" and profile["steps"] == 1 and profile["first_step"] == 2
        # on the CPU the shares are of the operators' own time: they add up, each kind's
        # share holds its operators among the top ones, the matmuls and SDPA's kernels are
        # named as such (which operator leads depends on the machine and its load: a matmul
        # or SDPA's backward seen)
        shares, top = profile["shares"], profile["top"]
        assert abs(sum(shares.values()) - 1) < 0.01, shares
        for label, share in shares.items():
            assert share >= sum(e["share"] for e in top if e["kind"] == label) - 1e-3, profile
        for entry in top:
            if entry["name"] in ("aten::mm", "aten::addmm", "aten::bmm"):
                assert entry["kind"] == "matmul", entry
            if "scaled_dot_product" in entry["name"]:
                assert entry["kind"] == "attention", entry
        assert any(e["kind"] == "matmul" for e in top), top
        assert shares["matmul"] > 0 and shares["attention"] > 0
        assert profile["host_reads_per_step"] > 0, profile
        assert profile["operators_per_step"] > 100 and "kernels_per_step" not in profile
        # the host's time by the phase the trainer marked: each one seen, and the step's
        # (zeroing the gradients, the records) less than the rest together
        phases = profile["host_ms_by_phase"]
        assert all(phases[name] > 0 for name in ("data", "forward", "backward", "optimizer"))
        assert phases["step"] < sum(phases.values()) / 2 and "idle_ms_by_phase" not in profile
        if name != "packed_8k":         # the map of waits is slow on the CPU: one case's
            assert "sync_sites" not in profile, profile
            continue
        # on the CPU the waits a GPU would have are found by operator, at their callers: not
        # the optimizer's step (megatron-core's read its gradient norm: mimo's keeps the norm
        # and the non-finite check on the device, mcore.optimizer_step), nor the cross
        # entropy's masked writes (masked_fill_ on a GPU) nor MimoModel's splice of the rows
        # (mcore.splice counts the placeholders on the host)
        sites = profile["sync_sites"]
        assert profile["host_syncs_per_step"] >= sum(s["per_step"] for s in sites) > 0
        assert not any("optimizer" in s["site"] for s in sites), sites
        assert not any("cross_entropy" in s["site"] or "align_embeddings" in s["site"] or
                       "get_text_embeddings" in s["site"] for s in sites), sites


def test_the_peer_trains_the_same_batches_as_transformers(summary):
    cases = summary["cases"]
    work = Path(summary["shards"]["dir"]).parent
    assert not {"peer"} & set(cases["packed_8k_local"])         # mimo's kernels alone
    for name in WITH_PEER:
        case, peer = cases[name], cases[name]["peer"]
        assert "error" not in peer and peer["steps"] == 2 and peer["attention"] == "sdpa", peer
        assert peer["profile"]["steps"] == 1 and peer["profile"]["top"], peer
        assert all(peer["profile"]["host_ms_by_phase"][phase] > 0 for phase in (
            "data", "forward", "backward", "optimizer")), peer["profile"]
        # the same samples in the same steps: each step's trained tokens, from both records
        ours, theirs = ([json.loads(line)["tokens"] for line in
                         (work / f"{run}.jsonl").read_text().splitlines()
                         if '"loss"' in line] for run in (name, f"{name}_peer"))
        assert ours == theirs and len(ours) == 2, (name, ours, theirs)
        seconds = [json.loads(line)["seconds"] for line in
                   (work / f"{name}_peer.jsonl").read_text().splitlines() if '"loss"' in line]
        assert peer["seconds_by_step"] == seconds and peer["profiled_over_timed"] == round(
            seconds[-1] / statistics.median(seconds), 3), (name, peer, seconds)
        # images and clips in the first step (the shards take them in turn), so the first
        # losses below compare the two sides' video inputs too
        first = json.loads((work / f"{name}_peer.jsonl").read_text().splitlines()[0])
        assert first["images"] > 0 and first["clips"] > 0, (name, first)
        # the same weights: transformers' own model on mimo's batches gives mimo's first loss
        # (fp32; with LoRA, PEFT's adapters start at zero as mimo's do)
        # (a peer with transformers' default key-value cache leaks across packed samples:
        # 5e-3 apart here)
        assert case["first_loss_diff"] <= 2e-5, (name, case["first_loss_diff"])
        # and after the first update the second: megatron-core's optimizer (fp32 main weights,
        # clipping, fused AdamW) moved the weights as torch's AdamW on transformers' model
        # under the same schedule (measured within 1e-6; LoRA's A matrices start from other
        # random draws)
        if name != "lora_7b_packed_8k":
            ours, theirs = ([json.loads(line)["loss"] for line in
                             (work / f"{run}.jsonl").read_text().splitlines()
                             if '"loss"' in line] for run in (name, f"{name}_peer"))
            assert abs(ours[1] - theirs[1]) <= 2e-5, (name, ours, theirs)
        # the same steps' trained tokens over their seconds on each side (tiny: every step
        # timed), not two medians that may fall on different steps
        rates = []
        for run in (name, f"{name}_peer"):
            steps = [json.loads(line) for line in
                     (work / f"{run}.jsonl").read_text().splitlines() if '"loss"' in line]
            rates.append(sum(r["tokens"] for r in steps) / sum(r["seconds"] for r in steps))
        assert case["speedup"] == round(rates[0] / rates[1], 3), (name, case, rates)


def test_the_peers_packed_varlen_attention_trains_as_its_sdpa(summary, check_out, tmp_path,
                                                             monkeypatch):
    """On a GPU without flash-attn the peer takes a packed row through torch's varlen kernels
    (``PACKED_VARLEN``, registered with transformers), as mimo does, so the speedup is not a
    kernel's. The kernel needs CUDA: here a stand-in (SDPA per sample, grouped keys and values
    repeated), and the peer's two steps of ``packed_8k`` give the losses its SDPA run gave
    (the summary's), the language layers called causal with the row's samples' boundaries
    (read from the text positions), the tower's without."""
    import torch.nn.attention.varlen as varlen
    import torch.nn.functional as F
    peer, calls = _peer(), []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and type(max_q) is int
        bounds = cu_q.tolist()
        assert bounds[-1] == len(q) and max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
        calls.append((len(bounds) - 1, window_size))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale,
            is_causal=window_size == (-1, 0)).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])])
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    monkeypatch.setattr(peer, "attention_choice",
                        lambda device, packed: peer.PACKED_VARLEN if packed else "sdpa")
    records = peer.train(check_out / "work" / "packed_8k.yaml", tmp_path / "peer.jsonl")
    assert [r["attention"] for r in records] == [peer.PACKED_VARLEN] * 2
    sdpa = summary["cases"]["packed_8k"]["peer"]["losses"]
    assert [r["loss"] for r in records] == pytest.approx(sdpa, abs=1e-5), (records, sdpa)
    language = [samples for samples, window in calls if window == (-1, 0)]
    # two layers, forward (and the backward's recompute none): a row of two samples each
    assert language and all(samples == 2 for samples in language), calls
    assert any(window == (-1, -1) for _, window in calls), calls        # the tower's items


@pytest.mark.parametrize("warmup, steps", [(0, 7), (1, 7), (3, 10), (12, 10)])
def test_the_peer_learns_at_mimos_rate_every_step(warmup, steps):
    """The peer's optimizer and schedule (``peer.optimizer_and_schedule``: transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup``) give each step the learning rate mimo's
    (``build_schedulers``: megatron-core's warmup from 0 and cosine to ``min_lr``) gives it,
    from the same config (a warmup longer than the run clamped as mimo clamps it), so the two
    sides' losses compare after the first step too."""
    from types import SimpleNamespace

    from mimo_train.components.optimizer import build_schedulers
    from mimo_train.config import TrainConfig

    peer = _peer()
    lr, min_lr = 3e-3, 3e-4
    cfg = TrainConfig.load(None, ["data.datasets=[shards]", f"optimizer.lr={lr}",
                                  f"optimizer.min_lr={min_lr}",
                                  f"optimizer.warmup_steps={warmup}", f"train.steps={steps}"])
    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    module = SimpleNamespace(optimizer=cfg.optimizer, warmup_steps=cfg.warmup_steps()[0])
    scheduler = build_schedulers({"language": module}, steps, {"language": ours})["language"]
    theirs, schedule = peer.optimizer_and_schedule([torch.nn.Parameter(torch.zeros(1))], cfg,
                                                   fused=False)
    rates = []
    for _ in range(steps):
        rates.append((ours.param_groups[0]["lr"], theirs.param_groups[0]["lr"]))
        scheduler.step(1)
        schedule.step()
    assert rates[0][0] == (0.0 if warmup else lr)
    assert all(a == pytest.approx(b, rel=1e-12, abs=1e-15) for a, b in rates), rates
    assert rates[-1][0] > min_lr


def test_the_goal_case_keeps_its_tower_where_the_prediction_fits(summary, monkeypatch,
                                                                  tmp_path):
    """``packed_8k``'s ``auto`` tower recompute on a GPU (its memory read by nvidia-smi, here
    given): the advisor's prediction of the case's own config with the tower kept decides it,
    against 85% of the GPU's memory."""
    module = _module()
    work = Path(summary["shards"]["dir"]).parent
    check = module.Check(tmp_path, True, math.inf, lambda *a: 0, work / "shards", work)
    check.checkpoints["2B"] = module.REPLICA
    goal = module.WORKLOADS[0]
    assert goal.name == "packed_8k" and goal.tower_recompute == "auto"
    preprocess = module.preprocessing(check, goal.seq_length)
    train = {"steps": 3, "precision": "fp32", "global_batch_size": 4, "micro_batch_size": 2}
    config = {"model": {"pretrained": str(module.REPLICA), "attention": "sdpa",
                        "language": {"recompute": "none", "loss_chunk_tokens": 0},
                        "encoders": {"image": {"recompute": "auto"}}},
              "data": {"packing": True, "preprocess": str(preprocess)}, "train": train}
    found = {}
    for capacity in (10**6, 1):
        monkeypatch.setattr(module, "gpu_total_mib", lambda capacity=capacity: capacity)
        found[capacity] = module.tower_kept(check, goal, "cuda", config, preprocess)
    predicted = found[1]["predicted_kept_mib"]
    assert predicted > 0 and found[10**6]["predicted_kept_mib"] == predicted
    assert found[10**6]["kept"] and not found[1]["kept"], found


def _case_failing_once(summary, tmp_path, kept: bool, says: str, fails: bool = True):
    """``packed_8k`` run by ``case`` (its tower kept or not) where mimo's first training stops
    after a step (or, not ``fails``, runs) with ``says`` in its log and every other training
    runs: the case's result, the check, and each training's (script, tower recompute,
    TORCH_COMPILE_DISABLE)."""
    import yaml
    module = _module()
    runs: list[tuple[str, str, str | None]] = []

    def launch(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
        config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        runs.append((argv[0], config["model"]["encoders"]["image"]["recompute"],
                     env.get("TORCH_COMPILE_DISABLE")))
        failing = len(runs) == 1 and fails
        steps = module.TINY_STEPS - 1 if failing else module.TINY_STEPS
        Path(argv[argv.index("--records") + 1]).write_text("".join(
            json.dumps({"step": s, "loss": 2.0, "seconds": 1.0, "tokens": 10,
                        "tokens_per_s": 10.0, "memory_mib": 100.0}) + "\n"
            for s in range(1, steps + 1)))
        log.write_text(says if len(runs) == 1 else "")
        return 1 if failing else 0

    work = Path(summary["shards"]["dir"]).parent
    (tmp_path / "work").mkdir(parents=True)
    check = module.Check(tmp_path, True, math.inf, launch, work / "shards", tmp_path / "work")
    check.checkpoints["2B"] = module.REPLICA
    module.tower_kept = lambda *a: {"kept": kept}
    return module.case(check, "cpu", module.WORKLOADS[0]), check, runs


def test_the_goal_case_recomputes_its_tower_after_running_out_of_memory(summary, tmp_path):
    """Where the tower was kept on the advisor's word and mimo's run stops out of GPU memory
    (mimo-train's message), the case runs again with the tower recomputed, the peer on that
    config too, and keeps the first run's figures: one run's time rather than the goal case's
    figures lost."""
    result, _, runs = _case_failing_once(
        summary, tmp_path, True, "mimo-train: training stopped in step 3 on rank 0 (image dp0 "
        "tp0 pp0): out of GPU memory (OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 2.00 GiB.); to fit, ...\n")
    assert [run[:2] for run in runs] == [("-m", "none"), ("-m", "full"), (str(PEER), "full")]
    assert "out of GPU memory" in result["tower_kept"]["out_of_memory"]["error"]
    assert result["tower_kept"]["out_of_memory"]["steps"] == 1
    assert "error" not in result["mimo"] and result["mimo"]["steps"] == 2
    assert result["speedup"] == 1.0
    assert result["tower_recompute"] == "full" and result["compiled"]
    assert "out of GPU memory" in (tmp_path / "work" / "packed_8k_out_of_memory.log").read_text()
    # saved once mimo's side ran: a run stopped from outside during the peer keeps it
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["cases"]["packed_8k"]["mimo"]["steps"] == 1


def test_what_comes_back_from_a_lease_fits_its_eight_files(tmp_path):
    """With ``--work`` outside ``--out`` the runs' logs come back in one archive beside
    the summary (a lease brings back at most 8 files); a case that failed before its sides
    ran fails the check (its exit status); a run past its limit gets SIGTERM first, which
    torchrun passes to its worker (a session of its own, which SIGKILL would leave running)."""
    import tarfile
    module = _module()
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    check = module.Check(out, True, math.inf, module.torchrun_launcher, None, work)
    for name in ("a.log", "a.jsonl", "b.log"):
        (work / name).write_text(name)
        check.bring_back(work / name)
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "run.log"]
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["logs", "logs/a.jsonl", "logs/a.log",
                                             "logs/b.log"]
        assert archive.extractfile("logs/b.log").read() == b"b.log"
    assert module.failures({"packages": {}, "cases": {"packed_8k": {"error": "ImportError"},
                                                      "unpacked": {"mimo": {"error": "x"}}}}
                           ) == ["packed_8k", "unpacked.mimo"]
    script = tmp_path / "slow.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (print('terminated', "
                      "flush=True), sys.exit(3)))\nprint('started', flush=True)\n"
                      "time.sleep(60)\n")
    log = tmp_path / "slow.log"
    assert module.torchrun_launcher([str(script)], {}, 3.0, log) == 124
    assert log.read_text().splitlines()[:2] == ["started", "terminated"], log.read_text()
    # both sides' runs on a GPU with the allocator's expandable segments, unless set
    assert module.child_env("cuda")["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in module.child_env("cpu")


def test_a_failed_compile_runs_mimo_again_without_torch_compile(summary, tmp_path):
    """A mimo run whose compiled kernels failed (inductor's error in its log) runs again, and
    so do the later mimo runs, with ``TORCH_COMPILE_DISABLE=1`` (the fused regions as written);
    the failure is named in the summary; the peer, which compiles nothing, runs as it is."""
    failure = ("torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
               "RuntimeError: Failed to find C compiler.\n")
    result, check, runs = _case_failing_once(
        summary, tmp_path, False, "Traceback (most recent call last):\n" + failure)
    assert runs == [("-m", "full", None), ("-m", "full", "1"), (str(PEER), "full", None)]
    assert check.summary["compile_failed"] == failure.splitlines()[0]
    assert result["compile_failed"]["steps"] == 1
    assert "error" not in result["mimo"] and result["mimo"]["steps"] == 2
    assert check.compile_env == {"TORCH_COMPILE_DISABLE": "1"} and not result["compiled"]
    assert failure in (tmp_path / "work" / "packed_8k_compile_failed.log").read_text()
    # a run that went through, whatever its log says, is not run again
    result, check, runs = _case_failing_once(summary, tmp_path / "ran", False,
                                             failure, fails=False)
    assert [run[2] for run in runs] == [None, None] and "compile_failed" not in result
    assert result["compiled"] and result["tower_recompute"] == "full"


def _scheduled(tmp_path: Path, *argv: str, spend: str | None = None, left: float = 0.27
               ) -> tuple[list, dict, int]:
    """``main`` with every step faked (in process, nothing trained): the steps in the order
    they ran, the summary and the exit code; after the case ``spend`` the budget has ``left``
    seconds (the H200 run of 2026-11-30: the first two cases used up 450 s)."""
    import time
    module = _module()
    ran: list[str] = []

    def case(check, device, work):
        ran.append(work.name)
        if work.name == spend:
            check.deadline = time.monotonic() + left
        return {"mimo": {"steps": 2}}

    module.install_packages = lambda gpu: ran.append("packages") or {}
    module.build_shards = lambda check: ran.append("shards") or {}
    module.make_checkpoint = lambda check, size="2B": ran.append("checkpoint") or {}
    module.case = case
    module.probe_here = lambda: ran.append("probes") or {"env": {"cuda": False}, "kernels": {}}
    module.parity = lambda check, device: ran.append("parity") or {}
    rc = module.main(["--out", str(tmp_path), "--tiny", "--budget-s", "100000", *argv])
    return ran, json.loads((tmp_path / "summary.json").read_text()), rc


def test_the_probes_run_after_the_chosen_cases_while_their_time_is_left(tmp_path):
    """The machine's probes run after the first case (the goal's), or after the last one
    chosen where none is (``--cases none``: packages, shards, probes, parity); where the cases
    left less than the probes' limit, they are skipped, not started to time out, and the
    check still succeeds."""
    first = ["packages", "shards", "checkpoint"]
    ran, found, rc = _scheduled(tmp_path / "all")
    # packed_32k and packed_8k_sdpa: packed_8k's run again on the CPU, not run
    assert ran == first + ["packed_8k", "probes", "unpacked", "lora_7b_packed_8k",
                           "packed_8k_recompute_full", "packed_8k_local", "parity"], ran
    assert found["env"] == {"cuda": False} and rc == 0
    ran, found, rc = _scheduled(tmp_path / "one", "--cases", "packed_8k")
    assert ran == first + ["packed_8k", "probes", "parity"] and rc == 0, ran
    ran, found, rc = _scheduled(tmp_path / "none", "--cases", "none")
    assert ran == ["packages", "shards", "probes", "parity"] and rc == 0, ran
    assert found["checkpoint"] == {"skipped": "no cases"} and found["cases"] == {}
    ran, found, rc = _scheduled(tmp_path / "bare", "--cases", "packed_8k", "--skip-probes")
    assert ran == first + ["packed_8k", "parity"] and "env" not in found and rc == 0, ran
    # the budget used up by the first case: the rest skipped, the probes too, no error
    ran, found, rc = _scheduled(tmp_path / "spent", spend="packed_8k")
    assert ran == first + ["packed_8k"], ran
    skipped = {"skipped": "out of time"}
    assert found["env"] == found["kernels"] == found["parity"] == skipped, found
    assert found["cases"]["packed_8k_local"] == skipped and rc == 0
    ran, found, rc = _scheduled(tmp_path / "spent_one", "--cases", "packed_8k",
                                spend="packed_8k")
    assert ran == first + ["packed_8k"] and found["kernels"] == skipped and rc == 0, ran
    # 100 s left after the case (the H200 run of 2026-12-04 started parity with ~80 s, whose
    # CPU side then stopped at the budget: an error): parity is skipped, not started
    ran, found, rc = _scheduled(tmp_path / "short", "--cases", "packed_8k", "--skip-probes",
                                spend="packed_8k", left=100)
    assert ran == first + ["packed_8k"] and found["parity"] == skipped and rc == 0, ran
    with pytest.raises(SystemExit):         # a misspelt case is no probes-only run
        _scheduled(tmp_path / "typo", "--cases", "packed8k")


@pytest.mark.parametrize("convention, ok", [("interleaved", True), ("tiled", False)])
def test_the_varlen_probe_checks_the_kernels_grouped_queries(monkeypatch, convention, ok):
    """The ``varlen_kernel`` probe on the CPU, torch's kernel (CUDA only) replaced by causal SDPA
    per sample: given the key/value groups, a kernel reading them as megatron-core orders its
    heads (query head i: group i // (heads / groups)) passes; one reading them tiled (group
    i % groups) is caught by the comparison with the groups repeated to the heads."""
    import torch.nn.functional as F
    import torch.nn.attention.varlen as varlen_module

    def stand_in(q, k, v, cu, _cu_k, _max_q, _max_k, *, window_size=(-1, -1), scale=None):
        assert window_size == (-1, 0)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = ((t.repeat_interleave(repeat, dim=1) if convention == "interleaved"
                     else t.repeat(1, repeat, 1)) for t in (k, v))
        bounds = cu.tolist()
        return torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale
        ).transpose(0, 1) for a, b in zip(bounds, bounds[1:])])

    monkeypatch.setattr(varlen_module, "varlen_attn", stand_in)
    sys.path.insert(0, str(REPO / "tools" / "gpu_check"))
    try:
        import probes
    finally:
        sys.path.remove(str(REPO / "tools" / "gpu_check"))
    found = probes.varlen("cpu", (9, 4, 7))
    assert found["ok"] is ok and found["max_abs_diff_vs_sdpa"] < 2e-2
    assert (found["grouped_max_rel_diff"] < 1e-2) is ok
    assert found["grouped_ms"] > 0 and found["repeated_ms"] > 0


@pytest.mark.parametrize("ending", ["complete", "timeout", "crash", "at_exit"])
def test_the_probes_process_keeps_what_it_reported_before_it_stopped(tmp_path, monkeypatch,
                                                                    ending):
    """The machine's probes run in a child process that reports each probe as it ends: where
    it is stopped at its limit or dies in a probe (a kernel's crash can take it), the probes
    before keep their figures and the one it was in gets the reason as its error."""
    module = _module()
    script = tmp_path / "probes.py"
    script.write_text(f"""
import json, sys, time
def line(record):
    print(json.dumps(record), flush=True)
line({{"env": {{"cuda": True}}}})
print("a library's own line")
print(42)
line({{"starting": "first"}})
line({{"kernel": "first", "found": {{"ok": True, "ms": 1.5}}}})
line({{"starting": "second"}})
ending = {ending!r}
if ending == "timeout":
    time.sleep(60)
if ending == "crash":
    print("Segmentation fault in the kernel", file=sys.stderr)
    sys.exit(139)
line({{"kernel": "second", "found": {{"ok": False, "error": "refused"}}}})
sys.exit(1 if ending == "at_exit" else 0)
""")
    monkeypatch.setattr(module, "PROBES", script)
    (tmp_path / "out").mkdir()
    check = module.Check(tmp_path / "out", False, math.inf, lambda *a: 0, None, tmp_path)
    found = module.probe(check, {}, 3 if ending == "timeout" else 60)
    assert found["env"] == {"cuda": True}
    kernels = found["kernels"]
    assert kernels.pop("first") == {"ok": True, "ms": 1.5}, found
    second = kernels.pop("second")
    if ending in ("complete", "at_exit"):
        assert second == {"ok": False, "error": "refused"}
    elif ending == "timeout":
        assert second == {"ok": False, "error": "stopped at the probes' limit of 3 s"}
    else:
        assert second["error"] == ("the probes' process ended (exit 139): Segmentation fault "
                                   "in the kernel"), second
    if ending == "at_exit":          # between probes: the process's own entry says it
        assert kernels.pop("probes_process")["error"].startswith(
            "the probes' process ended (exit 1)")
    assert kernels == {}, found


def test_the_tower_attention_probe_compares_each_kernel_with_fp32_per_image():
    """The ``tower_attention`` probe on the CPU at small dims, its CUDA kernels replaced: a
    kernel attending within each image in bf16 is within bf16's rounding of fp32 SDPA per
    image (output and q, k, v gradients); one attending across the packed images is caught,
    and one that raises is reported with its error, the others still timed."""
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO / "tools" / "gpu_check"))
    try:
        import probes
    finally:
        sys.path.remove(str(REPO / "tools" / "gpu_check"))

    def per_image(q, k, v, cu, longest):
        bounds = cu.tolist()
        return torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])])

    def across(q, k, v, cu, longest):
        return F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)

    def refuses(*args):
        raise RuntimeError("no kernel for this width")

    found = probes.tower_attention("cpu", images=3, side=4, heads=2, width=80,
                                   kernels={"per_image": per_image, "refuses": refuses})
    assert found["ok"] is True and found["per_image"]["max_rel_diff"] < 2e-2, found
    assert found["per_image"]["fwd_bwd_ms"] > 0
    assert found["refuses"] == {"error": "RuntimeError: no kernel for this width"}
    found = probes.tower_attention("cpu", images=3, side=4, heads=2, width=80,
                                   kernels={"per_image": per_image, "across": across})
    assert found["ok"] is False and found["across"]["max_rel_diff"] > 0.1, found
    found = probes.tower_attention("cpu", images=3, side=4, heads=2, width=80,
                                   kernels={"refuses": refuses})
    assert found["ok"] is False                     # nothing ran

    def faults(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    # after a CUDA error the device may be unusable: the kernels after it are not run
    found = probes.tower_attention("cpu", images=3, side=4, heads=2, width=80,
                                   kernels={"faults": faults, "per_image": per_image})
    assert found["per_image"] == {"error": "not run: faults failed with a CUDA error"}, found
    # the GPU's kernels: on the CPU the CUDA-only ones refuse, flash's SDPA runs there
    found = probes.tower_attention("cpu", images=2, side=4, heads=2, width=80)
    assert list(found)[-3:] == ["flash_varlen", "flash_batched", "cudnn_batched"], found
    assert found["ok"] is True and found["flash_batched"]["max_rel_diff"] < 2e-2, found
    assert "error" in found["flash_varlen"] and "error" in found["cudnn_batched"], found


def test_the_wgrad_probe_compares_the_fused_gradient_with_the_exact_sum():
    """The ``wgrad`` probe on the CPU at small dims: the fused buffer no further from the exact
    sum than megatron-core's bf16 gradient and addition (there: one bf16 rounding a value)."""
    sys.path.insert(0, str(REPO / "tools" / "gpu_check"))
    try:
        import probes
    finally:
        sys.path.remove(str(REPO / "tools" / "gpu_check"))
    found = probes.wgrad("cpu", (256, 32, 48))
    assert found["ok"] is True and found["supported"] is True
    assert found["fused_rel_diff"] < 1e-6 < found["unfused_rel_diff"]
    assert found["fused_ms"] > 0 and found["unfused_ms"] > 0


def test_the_32k_case_takes_its_loss_in_several_chunks(summary, check_out, tmp_path,
                                                       monkeypatch):
    """``packed_32k`` is the case of ``model.language.loss_chunk_tokens``; the loss makes the
    trained tokens' logits alone (about one token in eleven of a packed row: ~30 a sample), so
    its chunk is exercised only where a micro-batch of its ``micro`` samples trains more
    tokens than a chunk holds: fewer, the loss is one chunk, the unchunked path
    (``language_loss``: ``single``), and the case measures nothing of the chunks."""
    module = _module()
    monkeypatch.setattr(sys, "path", list(sys.path))
    # the shards the module's check built (its tiny samples are the corpus's conversations)
    (tmp_path / "work").mkdir()
    check = module.Check(tmp_path, True, math.inf, lambda *a: 0, check_out / "work" / "shards",
                         tmp_path / "work")
    check.checkpoints["2B"] = module.REPLICA
    from mimo_data.loading.loader import build_loader
    from mimo_data.preprocess.config import PreprocessConfig
    case = next(w for w in module.WORKLOADS if w.name == "packed_32k")
    preprocess = PreprocessConfig.from_yaml(str(module.preprocessing(check, case.seq_length)))
    loader = build_loader([str(check.shards)], preprocess, module.LAYOUTS[check.video], 0, 1,
                          8, 8, 3, decode_media=False)
    assert loader is not None
    trained = [n for _, metadata in loader for n in metadata["trained_tokens"]]
    # the trained tokens are the answers' (no pixel budget changes them): the GPU's micro-batch
    per_micro = statistics.mean(trained) * case.micro
    assert 0 < case.loss_chunk and per_micro >= 2 * case.loss_chunk, (per_micro, case)
