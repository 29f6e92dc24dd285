"""mimo_train.runtime.profile's parts that the CPU run of the GPU check (test_gpu_check.py)
cannot reach: kernel names sorted into kinds as CUDA names them, and the sync sites counted
from torch's sync debug mode (its warnings stand in for a GPU's here), other warnings shown
as before; on the CPU, which operators count as waits (and which do not), at their callers,
in the backward pass too."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mimo_train.runtime import profile


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_128x256_64x4_4x2_h_bz_coopA_NTN", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void cudnn::cnn::conv2d_grouped_direct_kernel<float, float, float>", "matmul"),
    ("aten::convolution_backward", "matmul"),           # the CPU's operator
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>", "copy"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 4>", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add<c10::BFloat16>>",
     "elementwise"),
])
def test_kernels_sort_into_kinds_by_their_cuda_names(name, kind):
    assert profile.kind(name) == kind


def test_sync_sites_count_syncs_by_caller_and_show_other_warnings(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: shown.append(
        str(message)))

    def reads_a_value():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    with profile.SyncSites() as sites:
        for _ in range(3):
            reads_a_value()
        warnings.warn("an unrelated warning", stacklevel=1)
    assert modes == ["warn", "default"]
    (top,) = sites.top(steps=3)
    assert top["per_step"] == 1.0 and top["site"].endswith("reads_a_value"), top
    assert shown == ["an unrelated warning"]


def test_host_waits_count_on_the_cpu_what_would_wait_on_a_gpu_at_its_caller():
    values = torch.arange(6.0, requires_grad=True)
    mask = torch.tensor([True, False] * 3)

    def waits():
        values.sum().item()
        values.tolist()
        values[mask]
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.nonzero(mask)

    def does_not_wait():
        values.detach()[mask] = 0.0                 # torch's masked_fill_
        values[1:3] * 2
        values.repeat_interleave(2)
        torch.repeat_interleave(values, torch.tensor([1] * 6), output_size=6)
        torch.where(mask, values, 0.0)

    def trains():
        values[mask].sum().backward()       # the masked index, forward and backward

    with profile.HostWaits() as sites:
        waits()
        does_not_wait()
        trains()
    by_function: dict[str, list[str]] = {}
    for site, count in sites.sites.items():
        where, call = site.rsplit(" [", 1)
        by_function.setdefault(where.rsplit(" ", 1)[1], []).extend([call.rstrip("]")] * count)
    assert sorted(by_function["waits"]) == [
        "aten::_local_scalar_dense", "aten::index.Tensor", "aten::nonzero",
        "aten::repeat_interleave.Tensor", "tolist"], by_function
    assert sorted(by_function["trains"]) == ["aten::index.Tensor", "aten::index_put"]
    assert by_function.keys() == {"waits", "trains"}, by_function


def test_cpu_shares_are_the_operators_not_the_python_around_them():
    """On the CPU the shares are operators' own time: a data loader's annotated range and a
    dispatch mode's own Python (HostWaits in the goal case) are no operator's, so they are
    neither elementwise time nor top entries."""
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with torch.profiler.profile() as profiler:
        for _ in loader:
            with profile.HostWaits():
                torch.randn(96, 96) @ torch.randn(96, 96)
            with torch.profiler.record_function("annotated"):
                torch.randn(96).relu()
    found = profile.summarize(profiler, steps=4, top=50)
    names = {entry["name"] for entry in found["top"]}
    assert "aten::mm" in names and "aten::relu" in names, names
    assert not names & {"PythonDispatchMode", "annotated"}, names
    assert not any(name.startswith("enumerate(DataLoader)") for name in names), names
    assert abs(sum(found["shares"].values()) - 1) < 0.01, found["shares"]
    # each kind's first kernels (operators here), with their calls a step
    by_kind = found["top_by_kind"]
    assert by_kind["matmul"][0]["name"] == "aten::mm", by_kind
    assert len(by_kind["elementwise"]) == profile.KIND_TOP        # more ran: the first listed
    for listed in by_kind.values():
        assert 0 < len(listed) <= profile.KIND_TOP
        assert [e["ms_per_step"] for e in listed] == sorted(
            (e["ms_per_step"] for e in listed), reverse=True), listed
        assert all(e["kind"] == listed[0]["kind"] for e in listed), listed
    a = torch.randn(64, 64)
    with torch.profiler.profile() as profiler:
        for _ in range(4):
            a @ a, a @ a, a.relu()
    calls = {e["name"]: e["calls_per_step"]
             for e in profile.summarize(profiler, steps=4, top=50)["top"]}
    assert (calls["aten::mm"], calls["aten::relu"]) == (2.0, 1.0), calls
    launched = profile.summarize(profiler, steps=4, top=50)["top_by_calls"]
    counts = [e["calls_per_step"] for e in launched]
    assert counts == sorted(counts, reverse=True), launched             # most launched first
    names = [e["name"] for e in launched]
    assert names.index("aten::mm") < names.index("aten::relu"), launched   # 2 a step, 1
    # the operators the host dispatched: outermost calls only (randn's empty and normal_ are
    # its own work), per step
    x = torch.randn(8, requires_grad=True)
    with torch.profiler.profile() as profiler:
        for _ in range(4):
            torch.randn(8).relu().sum()
            # mul, sum; backward: ones_like (the seed), expand (sum's), mul, detach (the
            # gradient accumulated)
            (x * 2).sum().backward()
    found = profile.summarize(profiler, steps=4)
    assert found["operators_per_step"] == 3 + 6, found
    assert "kernels_per_step" not in found


def test_the_profiled_steps_are_marked_and_span_the_gpu_window(tmp_path, monkeypatch):
    """``Profile`` marks each profiled step (``ProfilerStep#N``; torch marks none without a
    schedule), and on a GPU the window the shares and ``ms_per_step`` are of runs from the
    first step's mark to the last's: the host's time before the first kernel and after the
    last one is idle GPU time (kernels here stand-ins: one CPU run has none)."""
    import json
    from types import SimpleNamespace

    from mimo_train.config import ProfileConfig
    seen: list[str] = []
    summarize = profile.summarize

    def recorded(profiler, steps, top=8):
        seen.extend(e.name for e in profiler.events() if e.name.startswith("Profiler"))
        return summarize(profiler, steps, top)
    monkeypatch.setattr(profile, "summarize", recorded)
    run = profile.Profile(ProfileConfig(str(tmp_path), start=3, steps=2), 0,
                          torch.device("cpu"))
    for step in range(1, 6):
        run.before(step)
        (torch.randn(32, 32) @ torch.randn(32, 32)).relu() if step == 2 else \
            torch.randn(32, 32) @ torch.randn(32, 32)
        run.after(step)
    # torch's name for each step's mark (its own "#N" kept for the lead-in, the step before)
    assert seen == [profile.LEAD_IN + "#2", "ProfilerStep*", "ProfilerStep*"], seen
    written = json.loads((tmp_path / "profile_rank0.json").read_text())
    assert written["first_step"] == 3 and written["steps"] == 2

    def event(name, start, end, device=torch.autograd.DeviceType.CUDA, own=0.0):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=False,
                               time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=own)
    cpu = torch.autograd.DeviceType.CPU
    # on a CPU: the operators of the window's steps, not the lead-in's
    lead_in = [event(profile.LEAD_IN + "#2", -600, -5, cpu), event("aten::relu", -500, -400, cpu,
                                                                    own=100.0)]
    events = [event("ProfilerStep*", 0, 500, cpu), event("ProfilerStep*", 500, 1000, cpu),
              event("aten::mm", 100, 400, cpu, own=300.0)]
    found = profile.summarize(SimpleNamespace(events=lambda: lead_in + events), steps=2)
    assert [e["name"] for e in found["top"]] == ["aten::mm"], found
    assert found["operators_per_step"] == 0.5 and found["shares"]["matmul"] == 1.0

    events = [event("ProfilerStep*", 0, 500, cpu), event("ProfilerStep*", 500, 1000, cpu),
              event("nvjet_sm90_gemm", 100, 400), event("flash_fwd_kernel", 600, 900),
              event("ncclDevKernel_AllReduce", 950, 1100)]      # ends after the last mark
    found = profile.summarize(SimpleNamespace(events=lambda: events), steps=2)
    # 1100 us from the first mark to the last kernel, 750 busy: 350 idle
    assert found["ms_per_step"] == 0.55 and found["shares"]["idle"] == round(350 / 1100, 4)
    assert found["shares"]["matmul"] == round(300 / 1100, 4)
    assert found["kernels_per_step"] == 1.5 and found["operators_per_step"] == 0
    assert found["busy_ms_per_step"] == 0.375              # 750 us of kernels in 2 steps
    # each kernel's calls a step, counted from the kernel events (one each in 2 steps)
    assert {e["name"]: e["calls_per_step"] for e in found["top"]} == {
        "nvjet_sm90_gemm": 0.5, "flash_fwd_kernel": 0.5, "ncclDevKernel_AllReduce": 0.5}
    assert found["top_by_kind"]["matmul"][0]["name"] == "nvjet_sm90_gemm", found
    assert found["top_by_kind"]["attention"][0]["name"] == "flash_fwd_kernel", found
    # with the lead-in's kernels before them: one that ended before the window is not its,
    # one still running when it began counts from then (40 us more of the gemm)
    lead_in = [event(profile.LEAD_IN + "#2", -600, -5, cpu), event("lead_in_gemm", -500, -300),
               event("nvjet_sm90_gemm", -50, 40)]
    found = profile.summarize(SimpleNamespace(events=lambda: lead_in + events), steps=2)
    assert found["ms_per_step"] == 0.55 and found["busy_ms_per_step"] == 0.395
    assert found["shares"]["matmul"] == round(340 / 1100, 4) and found["kernels_per_step"] == 2
    assert "lead_in_gemm" not in {e["name"] for e in found["top"]}, found


def test_the_idle_time_and_the_hosts_time_are_split_by_the_phase_the_host_was_in():
    """The GPU's idle time (no kernel running) and the steps' wall time go to the phase the
    host marked then (``mark_phase``), the innermost where marks nest (a micro-batch's data
    and forward pass inside the schedule's ``backward``), ``step`` where none is; only the
    steps' thread's marks count, not their copies on the GPU's timeline nor another
    thread's (events stand-ins)."""
    from types import SimpleNamespace
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, start, end, device=cuda, annotation=False, thread=1):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               thread=thread, time_range=SimpleNamespace(start=start, end=end))
    mark = profile.MARK
    # one step, 0-1000 us: data 0-100 and forward 100-300 inside the schedule (0-700), the
    # optimizer 750-900; kernels 150-250, 320-600 (400-500 overlapping it), 800-850, 900-960
    events = [event("ProfilerStep*", 0, 1000, cpu), event(mark + "backward", 0, 700, cpu),
              event(mark + "data", 0, 100, cpu), event(mark + "forward", 100, 300, cpu),
              event(mark + "optimizer", 750, 900, cpu),
              event(mark + "optimizer", 0, 1000, annotation=True),  # its GPU-side copy
              event(mark + "data", 0, 1000, cpu, thread=2),           # another thread's
              event("nvjet_sm90_gemm", 150, 250), event("flash_fwd_kernel", 320, 600),
              event("flash_bwd_kernel", 400, 500),
              event("multi_tensor_apply_kernel", 800, 850), event("vectorized_kernel", 900, 960)]
    found = profile.summarize(SimpleNamespace(events=lambda: events), steps=1)
    assert found["host_ms_by_phase"] == {"data": 0.1, "forward": 0.2, "backward": 0.4,
                                         "optimizer": 0.15, "step": 0.15}, found
    # idle: 0-150 (data 100, forward 50), 250-320 (forward 50, backward 20), 600-800
    # (backward 100, step 50, optimizer 50), 850-900 (optimizer), 960-1000 (step)
    assert found["idle_ms_by_phase"] == {"data": 0.1, "forward": 0.1, "backward": 0.12,
                                         "optimizer": 0.1, "step": 0.09}, found
    # all of the idle time: the window's 1,000 us less the 490 some kernel ran
    assert found["busy_ms_per_step"] == 0.49 and found["ms_per_step"] == 1.0
    assert sum(found["idle_ms_by_phase"].values()) == pytest.approx(0.51)
    with pytest.raises(ValueError, match="no phase 'loss'"):
        profile.mark_phase("loss")


def test_a_step_that_raises_in_the_window_stops_the_profile_and_writes_nothing(tmp_path):
    """A step that raises inside the profiled window (out of memory, a lost peer) leaves no
    profiler recording and no mode of torch's counting the error's report, and no summary
    of a step cut short; a run that ends before its window's last step writes what it had,
    one that ends on the lead-in nothing."""
    from mimo_train.config import ProfileConfig

    def window(name: str) -> ProfileConfig:
        return ProfileConfig(str(tmp_path / name), start=2, steps=3, waits=True)

    with pytest.raises(MemoryError), profile.Profile(window("raised"), 0,
                                                      torch.device("cpu")) as run:
        for step in (1, 2):
            run.before(step)
            # the profiler from the lead-in step (1), the waits' mode from the window's first
            assert torch.autograd.profiler._is_profiler_enabled
            assert bool(torch.overrides._get_current_function_mode_stack()) == (step == 2)
            torch.randn(8, 8) @ torch.randn(8, 8)
            run.after(step)
        run.before(3)
        raise MemoryError("step 3")
    assert not torch.autograd.profiler._is_profiler_enabled
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not (tmp_path / "raised").exists()

    with profile.Profile(window("ended"), 0, torch.device("cpu")) as run:
        for step in (1, 2):
            run.before(step)
            torch.randn(8, 8) @ torch.randn(8, 8)
            run.after(step)
    assert not torch.autograd.profiler._is_profiler_enabled
    assert json.loads((tmp_path / "ended" / "profile_rank0.json").read_text())["steps"] == 1
    # a run that ends on the lead-in step (train.steps = start - 1, a stop there): the
    # profiler stopped and no summary written, as for a run that ends before its window
    with profile.Profile(window("lead-in"), 0, torch.device("cpu")) as run:
        run.before(1)
        torch.randn(8, 8) @ torch.randn(8, 8)
        run.after(1)
    assert not torch.autograd.profiler._is_profiler_enabled
    assert not (tmp_path / "lead-in").exists()
