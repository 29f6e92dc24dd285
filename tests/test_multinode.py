"""Training across several nodes, for real: two torchrun agents on this one machine stand for two
nodes of two processes each, meeting through torchrun's c10d rendezvous::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank R \\
        --rdzv-backend c10d --rdzv-endpoint localhost:PORT --rdzv-id ID -m mimo_train ...

The layout ``image=dp1;language=dp2;audio=dp1`` puts the vision encoder and the first language
rank on one node, the second language rank and the audio encoder on the other: the language
model's data-parallel group and both encoder -> language bridges cross the nodes.

- both agents exit 0; rank 0 (on one of the two agents) prints one ``step N: loss X`` line per
  step with a finite loss; the last step's checkpoint holds all four ranks' ``.distcp`` files;
- the same job on 4 ranks of one node gives every step's loss within 1e-6: the rendezvous does
  not change which samples the ranks see.

A hang (an agent waiting for its peer, a rank in a collective) runs into ``TIMEOUT``, which kills
both agents' process groups and fails the test.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, preprocess_config_file
from support.launch import BASE_ENV, torchrun_command
from support.runs import train

NODES, PER_NODE = 2, 2
STEPS = 3
LAYOUT = "image=dp1;language=dp2;audio=dp1"
# seconds for one launch (both agents), a hang guard only: the launch takes about a minute on
# the busy 2-core machine (six fresh interpreters), far below what any load stretches it to
TIMEOUT = 600
CONFIG = REPO / "configs" / "train" / "images_audio_noncolocated.yaml"
STEP_LINE = re.compile(r"^step +(\d+): loss (\S+) ", re.MULTILINE)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _launch(tmp: Path, name: str, agents: list[list[str]], overrides: list[str]) -> dict:
    """Start every agent at once (``torchrun RENDEZVOUS_ARGS -m mimo_train ...``) and wait
    for all; each must exit 0. Returns every agent's output (stdout and stderr together), rank
    0's records (``--records``) and the checkpoint dir."""
    checkpoints = tmp / f"{name}-ckpt"
    records = tmp / f"{name}.jsonl"
    env = {**os.environ, **BASE_ENV, "CUDA_VISIBLE_DEVICES": ""}
    processes, logs = [], []
    for index, agent in enumerate(agents):
        log = tmp / f"{name}-agent{index}.log"
        command = torchrun_command(PER_NODE, ["-m", "mimo_train", "--config", CONFIG,
                                              "--records", records, *overrides,
                                              f"checkpoint.dir={checkpoints}"], agent)
        with open(log, "w") as out:
            processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                              stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT
    codes = [None] * len(processes)
    try:
        # until all exit, one fails (its peer would wait in the rendezvous) or the time is up
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            if None not in codes or any(codes):
                break
            time.sleep(0.5)
    finally:                                    # also when the test is interrupted
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)      # the agent and its ranks, if any
            except ProcessLookupError:
                pass
            process.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    tails = "\n".join(f"--- agent {i}:\n{o[-4000:]}" for i, o in enumerate(outputs))
    if None in codes and not any(codes):
        pytest.fail(f"{name}: no exit within {TIMEOUT} s\n{tails}")
    assert codes == [0] * len(processes), f"{name}: agents exited {codes} (None: stopped)\n{tails}"
    return {"outputs": outputs, "checkpoints": checkpoints,
            "records": [json.loads(line) for line in records.read_text().splitlines()]}


@pytest.fixture(scope="module")
def runs(ranks, loader_corpus, tmp_path_factory) -> dict:
    """The 2-node job (two agents) and the same job on 4 ranks of one node."""
    tmp = tmp_path_factory.mktemp("multinode")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    overrides = [f"data.datasets=[{loader_corpus}]", f"data.preprocess={preprocess}",
                 f"layout={LAYOUT}", f"train.steps={STEPS}", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "train.device=cpu", "model.language.num_layers=2",
                 "model.language.hidden_size=32", "model.language.num_attention_heads=2",
                 "optimizer.warmup_steps=0", "checkpoint.interval=0"]
    port, run_id = _free_port(), f"mimo-multinode-{os.getpid()}"
    nodes = [["--nnodes", str(NODES), "--node-rank", str(r), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id]
             for r in range(NODES)]
    multi = _launch(tmp, "multinode", nodes, overrides)
    # the reference: the same job on one node (forked ranks: the rendezvous is the difference)
    single = {"records": train(ranks, tmp, "single", CONFIG.name, *overrides,
                               f"checkpoint.dir={tmp / 'single-ckpt'}", nproc=NODES * PER_NODE)}
    return {"multi": multi, "single": single}


def _losses(run: dict) -> list[float]:
    train = [r for r in run["records"] if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)), run["records"]
    return [r["loss"] for r in train]


def test_two_nodes_train_and_print_one_line_per_step(runs):
    multi = runs["multi"]
    printed = [STEP_LINE.findall(output) for output in multi["outputs"]]
    # rank 0 prints, and rank 0 is on exactly one of the two agents
    assert sorted(len(lines) for lines in printed) == [0, STEPS], multi["outputs"]
    (lines,) = [lines for lines in printed if lines]
    assert [int(step) for step, _ in lines] == list(range(1, STEPS + 1))
    for (_, loss), recorded in zip(lines, _losses(multi)):
        assert math.isfinite(float(loss)) and float(loss) > 0, lines
        assert float(loss) == pytest.approx(recorded, abs=6e-5)      # printed to 4 decimals


def test_two_nodes_write_every_ranks_checkpoint_file(runs):
    root = runs["multi"]["checkpoints"]
    last = f"step_{STEPS:07d}"
    assert (root / "latest").read_text() == last
    files = sorted(p.name for p in (root / last).iterdir())
    world = NODES * PER_NODE
    assert [f for f in files if f.endswith(".distcp")] == [f"__{r}_0.distcp"
                                                          for r in range(world)]
    assert {".metadata", "integrity.json", "meta.json"} <= set(files)
    meta = json.loads((root / last / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["world_size"] == world


def test_two_nodes_match_one_node(runs):
    """Same ranks, same layout, same seed: one agent or two give the same losses and tokens."""
    multi, single = runs["multi"], runs["single"]
    assert _losses(multi) == pytest.approx(_losses(single), abs=1e-6)
    tokens = [[r["tokens"] for r in run["records"] if "loss" in r] for run in (multi, single)]
    assert tokens[0] == tokens[1]


def test_tasks_srun_started_without_torchrun_are_refused(monkeypatch, capsys):
    """``srun python -m mimo_train`` on two tasks (no torchrun: no RANK): each task would
    train a run of its own (into one checkpoint.dir, taking the other's checkpoints over);
    refused (exit 2) first, before the config is read, said once (by task 0), with the
    torchrun line to use. An
    allocation's own shell (salloc's: no SLURM_STEP_NUM_TASKS) and torchrun's ranks train."""
    from mimo_train import cli
    from mimo_train.runtime import launcher
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")                       # salloc -n 2's shell
    assert launcher.unjoined_tasks() is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")               # srun -n 2's tasks
    said = launcher.unjoined_tasks()
    assert said is not None and said.startswith(
        "srun started 2 tasks of this command (SLURM_STEP_NUM_TASKS=2) and no torchrun joined "
        "them into one job") and "srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES" \
        in said, said
    from mimo_train.training import trainer
    monkeypatch.setattr(trainer, "train", lambda *args: pytest.fail("a task trained alone"))
    config = REPO / "configs" / "train" / "images_language_colocated.yaml"
    for task, printed in (("1", ""), ("0", f"mimo-train: {said}\n")):
        monkeypatch.setenv("SLURM_PROCID", task)
        capsys.readouterr()
        assert cli.main(["--config", str(config), "checkpoint.dir=null",
                         "layout=language=dp1;image=dp1,off0"]) == 2
        assert capsys.readouterr().err.endswith(printed)
    monkeypatch.setenv("RANK", "0")                               # a rank of torchrun's
    assert launcher.unjoined_tasks() is None


def test_nodes_started_with_different_rank_counts_are_named(monkeypatch):
    """Two nodes, one started with --nproc-per-node 1 and one with 2: what the layout's
    refusal of the 3-rank world adds says the nodes differ (the fix is the launch line, not
    the layout); nodes alike add nothing."""
    import torch.distributed as dist

    from mimo_train.training import start_checks
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 3)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    for here, said in (("1", " (the world's 3 ranks come from 2 nodes, this one running 1: the "
                        "nodes were started with different --nproc-per-node; give each the "
                        "same)"), ("3", "")):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", here)
        monkeypatch.setenv("GROUP_WORLD_SIZE", "2" if said else "1")
        assert start_checks._uneven_nodes() == said
