"""Where a rank trains and how it waits for the others (mimo_train/runtime/devices.py,
distributed.py).

- ``train.device``: auto with visible GPUs and CUDA that does not start is an error naming
  torch's reason, the driver and the wheel's CUDA, and the ways out, never a silent CPU run;
  no GPU at all is the CPU; cuda without CUDA and cpu with CUDA are refused as before; more
  ranks on a node than it has GPUs is an error on every rank of the node;
- the control group is a gloo group of its own, and it times out: a rank that never joins a
  control collective makes the others fail after ``train.collective_timeout_minutes`` with
  torch's timeout error, not hang (two ranks forked as torchrun would start them); groups
  made later without a timeout (megatron-core's bridge groups) get the same one. Start-up
  failures travel over it in every case of tests/test_train_startup.py;
- ranks on different kinds of device (a node without usable GPUs in a GPU job) all join gloo
  and stop at start-up with one message naming which ranks are on which, instead of waiting
  in NCCL's and gloo's set-up for each other until the timeout (two forked ranks, one of
  them said to have a GPU).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from conftest import REPO

from mimo_train.runtime import devices, distributed
from mimo_train.errors import TrainConfigError

OLD_DRIVER = devices.CudaState(
    usable=False, gpus=("/dev/nvidia0", "/dev/nvidia1"),
    failure="The NVIDIA driver on your system is too old (found version 12020).",
    driver="535.104.05", wheel_cuda="13.0")


def test_auto_with_visible_gpus_and_unusable_cuda_is_an_error():
    device, error = devices.select("auto", OLD_DRIVER)
    assert device.type == "cpu" and isinstance(error, TrainConfigError)
    message = str(error)
    for part in ("train.device is auto", "2 NVIDIA GPU(s) are visible (/dev/nvidia0, /dev/nvidia1)",
                 "The NVIDIA driver on your system is too old (found version 12020)",
                 f"this torch {torch.__version__} is a CUDA 13.0 build, which needs NVIDIA "
                 "driver 580.65.06 or newer", "the driver is 535.104.05",
                 "update the NVIDIA driver", "pip install torch --index-url",
                 "CUDA_VISIBLE_DEVICES= torchrun ... train.device=cpu"):
        assert part in message, message


def test_device_choices():
    none = devices.CudaState(usable=False, gpus=(), failure="Found no NVIDIA driver",
                             driver=None, wheel_cuda="13.0")
    working = devices.CudaState(usable=True, gpus=("/dev/nvidia0",), failure=None,
                                driver="580.65.06", wheel_cuda="13.0")
    assert devices.select("auto", none) == (torch.device("cpu"), None)
    assert devices.select("cpu", OLD_DRIVER) == (torch.device("cpu"), None)
    assert devices.select("auto", working) == (torch.device("cuda", 0), None)
    device, error = devices.select("cuda", OLD_DRIVER)
    assert "train.device is cuda: 2 NVIDIA GPU(s) are visible" in str(error)
    _, error = devices.select("cuda", none)
    assert "no CUDA device is visible" in str(error)
    _, error = devices.select("cpu", working)
    assert "hide them (CUDA_VISIBLE_DEVICES= torchrun ...)" in str(error)


def test_more_ranks_on_a_node_than_gpus_is_an_error(monkeypatch):
    """NCCL refuses two ranks on one GPU: every rank of the node stops at start-up instead."""
    two = devices.CudaState(usable=True, gpus=("/dev/nvidia0", "/dev/nvidia1"), failure=None,
                            driver="580.65.06", wheel_cuda="13.0", count=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert devices.select("auto", two) == (torch.device("cuda", 1), None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for rank in ("0", "2"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        device, error = devices.select("cuda", two)
        assert device.type == "cpu" and isinstance(error, TrainConfigError)
        assert str(error) == ("this node runs 3 ranks but has 2 visible GPU(s): one rank per "
                              "GPU; start at most 2 ranks per node (torchrun --nproc-per-node "
                              "2) with a layout of that many ranks, or more nodes")


def test_hidden_gpus_are_not_visible(monkeypatch):
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices._visible_gpus() == ()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert devices._visible_gpus() == ("/dev/nvidia0",)


def test_this_machine_probe_is_consistent():
    state = devices.probe()
    assert state.usable == torch.cuda.is_available()
    assert state.wheel_cuda == torch.version.cuda
    if not state.usable:
        assert state.failure


SILENT_RANK = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from mimo_train.runtime import distributed
    done = Path(sys.argv[1])
    # both ranks join (however slowly each starts) and leave the barrier together; only then
    # the control group, whose collectives time out after 3 s (its creation is quick: both
    # ranks are there)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    dist.barrier()
    distributed.init(torch.device("cpu"), timedelta(seconds=3))
    control = distributed.control()
    assert control is not None and control is not dist.group.WORLD
    assert dist.get_backend(control) == "gloo"
    # a group made later without a timeout (megatron-core's bridge groups) gets the run's
    later = dist.new_group(backend="gloo")
    assert later._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=3)
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 120                             # never joins: waits
        while not done.exists() and time.monotonic() < deadline:     # for rank 0 to be done
            time.sleep(0.1)
        os._exit(0)
    try:
        distributed.gather("ready")
    except RuntimeError as error:
        print(f"rank 0 gave up: {error}", flush=True)
        sys.exit(3)
    finally:
        done.touch()
    print("rank 0 gathered without rank 1", flush=True)
""")


def test_a_rank_that_never_joins_times_out_the_others(ranks, tmp_path):
    """Two forked ranks (the control group's timeout is mimo's, not torchrun's): rank 1 never
    joins the control collective (it waits until rank 0 is done, so the job ends then)."""
    script = tmp_path / "silent_rank.py"
    script.write_text(SILENT_RANK)
    job = ranks.run(2, [script, tmp_path / "rank-0-done"], tmp_path / "logs", timeout=100)
    output = job.stdout + job.stderr
    assert job.codes[0] != 0, job.explain()
    assert "rank 0 gave up:" in output and "gathered without" not in output, job.explain()
    assert "timed out" in output.lower() or "timeout" in output.lower(), job.explain()


@pytest.mark.parametrize("peer", ["never comes", "port taken"])
def test_an_environment_launch_that_cannot_join_is_one_message(monkeypatch, peer):
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT alone (a launcher without torchrun's
    agent, srun): a rank 1 that never starts, or a port another program holds, is one
    StartupError naming the address and what to check (torch's DistStoreError and
    DistNetworkError came with their tracebacks)."""
    import socket
    from datetime import timedelta

    from mimo_train.errors import StartupError
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        if peer == "port taken":
            held.listen()
        port = held.getsockname()[1]
        if peer == "never comes":
            held.close()                            # free again: rank 0 listens there
        for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
            monkeypatch.setenv(name, value)
        try:
            with pytest.raises(StartupError) as refused:
                distributed.init(torch.device("cpu"), timedelta(seconds=2))
        finally:
            distributed.destroy()
    assert str(refused.value).startswith(
        f"rank 0 of WORLD_SIZE 2 could not join the job at MASTER_ADDR:MASTER_PORT "
        f"127.0.0.1:{port} ("), refused.value
    assert str(refused.value).endswith("check that every rank was started with the same "
                                       "address, that rank 0 runs there and the port is free "
                                       "(not another job's), and that the others started "
                                       "too"), refused.value


def test_a_rank_that_never_joins_torchruns_store_is_named(monkeypatch):
    """torchrun's agent store of a 2-rank job whose rank 1 never comes (its mimo_train ended
    before it joined: a mistyped option on its node): rank 0 stops after the run's collective
    timeout with one StartupError naming rank 1 (torch's DistStoreError, with its traceback)."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from mimo_train.errors import StartupError
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                        ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(StartupError) as refused:
        distributed.device_types("cpu", timedelta(seconds=1.5))
    assert str(refused.value) == (
        "rank(s) [1] never joined the job within train.collective_timeout_minutes (0.025): "
        "their mimo_train stopped before it joined (a usage error, an import error: read "
        "their node's log) or never started"), refused.value
    del store


def test_ranks_on_one_kind_of_device_are_not_mixed():
    assert devices.mixed(None) is None and devices.mixed(["cuda"] * 4) is None
    assert devices.mixed(["cpu", "cpu"]) is None
    error = devices.mixed(["cuda", "cuda", "cpu", "cpu"])
    assert isinstance(error, TrainConfigError)
    assert "rank(s) [2, 3] on cpu; rank(s) [0, 1] on cuda" in str(error), error
    # a rank that joins only to report its own failure (on the CPU in a GPU job): no mix,
    # its failure is the message
    assert devices.mixed(["cuda", distributed.FAILING, "cuda"]) is None
    assert "rank(s) [0] on cpu; rank(s) [2] on cuda" in str(
        devices.mixed(["cpu", distributed.FAILING, "cuda"]))


MIXED_DEVICES = textwrap.dedent("""
    import os, sys
    import torch
    from mimo_train.cli import main
    from mimo_train.runtime import devices
    if os.environ["RANK"] == "1":         # this rank's node has a GPU (said: there is none here)
        devices.select = lambda setting, state: (torch.device("cuda", 0), None)
    sys.exit(main(sys.argv[1:]))
""")


def test_ranks_on_different_devices_stop_at_start_up_with_one_message(ranks, tmp_path,
                                                                       corpus_build):
    """Rank 0 on the CPU, rank 1 on a GPU: both join gloo (rank 1 touches no CUDA: there is
    none here), and the start-up's device phase names the ranks of each kind."""
    script = tmp_path / "mixed_devices.py"
    script.write_text(MIXED_DEVICES)
    config = REPO / "configs" / "train" / "images_language_colocated.yaml"
    job = ranks.run(2, [script, "--config", config, f"data.datasets=[{corpus_build}]",
                        "train.device=cpu"], tmp_path / "logs", timeout=120)
    assert len(job.codes) == 2 and all(job.codes), job.explain()
    assert "mimo_train start-up failed (device)" in job.stderr, job.explain()
    assert "rank(s) [0] on cpu; rank(s) [1] on cuda" in job.stderr, job.explain()
    assert not any("Traceback" in printed for printed in job.ranks.values()), job.explain()


def test_checkpoint_rng_states_carry_cuda_where_it_runs(monkeypatch):
    """A checkpoint's RNG entry: the CPU generator, plus on CUDA the device generator and
    megatron-core's tracked streams (here a stand-in CUDA), restored as saved; the CPU state
    alone, as earlier checkpoints hold it, still restores."""
    from mimo_train.components import checkpoint
    assert set(checkpoint.rng_state()) == ({"cpu", "cuda", "tracker"}
                                           if torch.cuda.is_available() else {"cpu"})

    class Tracker:
        states = {"model-parallel-rng": torch.tensor([1, 2])}

        def get_states(self):
            return dict(self.states)

        def set_states(self, states):
            self.states = states
    device = {"state": torch.tensor([7, 7])}
    tracker = Tracker()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: device.update(state=s))
    monkeypatch.setattr(checkpoint, "get_cuda_rng_tracker", lambda: tracker)
    torch.manual_seed(3)
    saved = checkpoint.rng_state()
    expected = torch.rand(2)
    device["state"] = torch.tensor([0, 0])
    tracker.states = {}
    checkpoint.set_rng_state(saved)
    assert torch.equal(torch.rand(2), expected)
    assert torch.equal(device["state"], torch.tensor([7, 7]))
    assert torch.equal(tracker.states["model-parallel-rng"], torch.tensor([1, 2]))
    torch.manual_seed(3)
    old = torch.get_rng_state()
    torch.rand(5)
    checkpoint.set_rng_state(old)
    assert torch.equal(torch.rand(2), expected)
