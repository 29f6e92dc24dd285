"""Weights & Biases beside TensorBoard (``train.wandb``), tested in offline mode: a run's W&B log
holds the config and, at each logging step, the same numbers as its JSONL records; a config
naming W&B without the package installed is refused with what to install. A step record's wait
for its micro-batches (``data_wait_s``), in process on a fake clock."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from support.anomaly_runs import planted, train_planted  # noqa: F401  (planted: the shards fixture)

_BLOCK, _HEADER = 32768, 7       # the W&B log: LevelDB-log blocks, 7-byte file and chunk headers


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's ``run-*.wandb`` log (LevelDB log framing:
    per chunk a checksum, a length and a type, FULL / FIRST / MIDDLE / LAST)."""
    from wandb.proto import wandb_internal_pb2
    data, records, parts, offset = path.read_bytes(), [], b"", _HEADER
    while offset + _HEADER <= len(data):
        left = _BLOCK - offset % _BLOCK
        if left < _HEADER:                      # the block's tail is padding
            offset += left
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        chunk = data[offset + _HEADER:offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 0:
            break
        parts += chunk
        if kind in (1, 4):                      # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_wandb_offline_gets_the_records_numbers_and_the_config(ranks, planted,  # noqa: F811
                                                               tmp_path):
    import json
    shards, preprocess, _ = planted
    directory = tmp_path / "wb"
    code, output, records = train_planted(
        ranks, tmp_path, "wandb", f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
        "layout=language=dp1", "model.encoders={}", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.steps=4", "train.log_interval=2",
        f"data.valid=[{shards}]", "train.eval_interval=3", "train.eval_steps=1",
        f"train.wandb={{project: mimo-test, name: tiny, mode: offline, dir: {directory}}}")
    assert code == 0, output[-3000:]
    (log,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    logged = _wandb_records(log)
    (run,) = [r.run for r in logged if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("mimo-test", "tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 4
    assert config["data"]["datasets"] == [str(shards)]
    history = {}
    for record in logged:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history[items["_step"]] = items
    train = {r["step"]: r for r in records if "loss" in r}
    # every step's scalars, not only the logging steps' (2, 4 and 3, shown by its evaluation);
    # the evaluations at the interval's multiple and at the last step (the weights the run
    # ends with)
    assert sorted(history) == [1, 2, 3, 4]
    evaluations = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evaluations) == [3, 4], records
    for step, evaluation in evaluations.items():
        assert history[step]["eval_loss"] == pytest.approx(evaluation["eval_loss"], rel=1e-12)
    for step, items in history.items():
        assert items["train/loss"] == pytest.approx(train[step]["loss"], rel=1e-12)
        assert items["train/tokens"] == train[step]["tokens"]
        assert items["train/lr"] == pytest.approx(train[step]["lr"], rel=1e-12)
        assert "forward_s/language" in items
        # every token of the samples beside the trained ones (the loss's targets)
        assert items["train/sequence_tokens"] == train[step]["sequence_tokens"] > \
            train[step]["tokens"] > 0
        # the wait for the micro-batches: its figures are the fake-clock test's below
        assert items["train/data_wait_s"] == train[step]["data_wait_s"] >= 0
        # its own column of the ranks' reduction: part of the step, not the memory's
        assert train[step]["data_wait_s"] < train[step]["seconds"]
        assert train[step]["data_wait_s"] != train[step]["memory_mib"]
    lines = [line for line in output.splitlines() if line.startswith(("step ", "eval "))]
    assert [line.split(":")[0] for line in lines] == [
        "step    2", "step    3", "eval step 3", "step    4", "eval step 4"], lines
    lines = [line for line in lines if line.startswith("step ")]
    # step 2's line: its own loss, then the interval's per trained token
    interval = (train[1]["loss"] * train[1]["tokens"] + train[2]["loss"] * train[2]["tokens"]) \
        / (train[1]["tokens"] + train[2]["tokens"])
    assert lines[0].startswith(f"step    2: loss {train[2]['loss']:.4f} (steps 1-2: "
                               f"{interval:.4f})  grad_norm "), (lines[0], train)
    assert "(steps" not in lines[1] + lines[2], lines         # one step each
    assert all(" trained tok/s " in line and " seq tok/s " in line
                                   and "  data wait " in line for line in lines), lines
    # the shipped config's checkpoint.interval, its checkpoint.dir overridden to null
    assert "mimo-train: checkpoint.interval 15 is set but checkpoint.dir is not: no " \
        "checkpoint will be saved" in output, output[-3000:]


def test_the_data_wait_is_the_steps_own_waits_for_its_micro_batches(monkeypatch):
    """A train step's ``data_wait_s``: the host seconds of ``next()`` on the rank's batch
    iterator, summed over the step's micro-batches; not the forward passes, not an
    evaluation's batches between two steps; with the load-balancing loss's counting pass, the
    one fetch of the step's micro-batches before it. In process: a fake clock, the loader's
    and the model's time given, through ``ForwardStep`` and the trainer's own
    ``train_step``, ``evaluate`` and ``forward_backward``; then the record, its step line and
    its TensorBoard scalar."""
    import time
    from types import SimpleNamespace

    import torch

    from mimo_train.components.metrics import line, scalars, train_record
    from mimo_train.training import trainer as trainer_module
    from mimo_train.training.step import ForwardStep
    from mimo_train.training.trainer import Trainer
    now = [0.0]                             # binary fractions: exact sums
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def loader(waits):
        """A micro-batch after each of ``waits`` seconds (None: a rank's batch without
        inputs, enough for the fake model)."""
        for wait in waits:
            now[0] += wait
            yield None

    def model(**inputs):
        now[0] += 1.0                       # a forward pass: not a wait
        return torch.zeros(1), None

    forward = ForwardStep(SimpleNamespace(role=SimpleNamespace(modules=[])),
                          torch.device("cpu"))

    def passes(iterator, forward_only=False):
        for _ in range(2):                  # two micro-batches a step
            forward(iterator, model)
        return torch.zeros(2)

    # the optimizer's step and the settling of the step before: not this test's
    monkeypatch.setattr(trainer_module, "step_on_device", lambda optimizer: torch.zeros(2))
    trainer = SimpleNamespace(
        modules={}, optimizer=SimpleNamespace(zero_grad=lambda: None),
        settle=lambda: ([], []), watch=SimpleNamespace(over_limit=lambda: None),
        forward=forward, forward_backward=passes, step_samples=[], device=torch.device("cpu"),
        peak_memory=SimpleNamespace(mib=lambda: now[0]),    # a peak that grows with time
        schedulers={}, trained={}, step=0, step_flops=torch.zeros(1), balance=None,
        cfg=SimpleNamespace(train=SimpleNamespace(global_batch_size=4)),
        valid_loader=None, eval_steps=1, batches=lambda _: loader([4.0, 8.0]))
    first, _, _ = Trainer.train_step(trainer, loader([0.25, 0.125]))
    Trainer.evaluate(trainer)               # between two steps: 12 s of waits, not theirs
    second, _, _ = Trainer.train_step(trainer, loader([0.5, 0.25]))
    assert (first.data_wait, second.data_wait) == (0.375, 0.75)
    # a step's peak memory is read once its work is queued (its waits and passes: 2.375 s),
    # not when it is settled, by when the next step's passes are queued too
    assert first.memory_mib == 2.375 and second.memory_mib > first.memory_mib
    # with model.language.moe_aux_loss: the step's micro-batches fetched at once, then the
    # counting pass and the training pass over them
    monkeypatch.setattr(trainer_module, "global_sum", lambda values, infra, device: values)
    trainer.__dict__.update(
        plan=SimpleNamespace(language=SimpleNamespace(moe_aux_loss=0.01)), micro_batches=2,
        infra=None, _reports=passes, _through_schedule=passes,
        forward_backward=lambda iterator, forward_only: Trainer.forward_backward(
            trainer, iterator, forward_only))
    third, _, _ = Trainer.train_step(trainer, loader([1.0, 2.0]))
    assert third.data_wait == 3.0 and len(third.forward) == 2, third
    record = train_record(2, 2.0, 1.0, 0.5, {"language": 1e-3}, False, 2.0, 8,
                          {"language": 0.1}, {"image": 40.0, "language": 100.0},
                          second.data_wait)
    assert record["data_wait_s"] == 0.75 and scalars(record)["train/data_wait_s"] == 0.75
    # the peak memory: the world's, and each module's
    assert record["memory_mib"] == 100.0 and scalars(record)["memory_mibs/image"] == 40.0
    assert "forward: language 100ms  data wait 750ms" in line(record), line(record)


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, capsys):
    """The W&B run's id is kept in checkpoint.dir when the run starts; a run resuming a
    checkpoint there resumes that W&B run (``resume="allow"``); a new run starts a new one,
    and an id in the config wins; a W&B run already past the checkpoint is named. In process,
    wandb faked."""
    from types import SimpleNamespace

    from mimo_train.components.metrics import WANDB_ID, wandb_run
    from mimo_train.config import WandbConfig
    calls: list[dict] = []
    sdk = SimpleNamespace(init=lambda **kwargs: calls.append(kwargs) or kwargs,
                          Settings=lambda **kwargs: kwargs)
    settings = WandbConfig(project="p", name="n", mode="offline")
    first = wandb_run(sdk, settings, {"a": 1}, str(tmp_path), 0)
    assert (tmp_path / WANDB_ID).read_text() == first["id"] and first["resume"] == "allow"
    assert len(first["id"]) == 8 and first["config"] == {"a": 1}
    assert wandb_run(sdk, settings, None, str(tmp_path), 12)["id"] == first["id"]
    again = wandb_run(sdk, settings, None, str(tmp_path), 0)          # a new run
    assert again["id"] != first["id"] and (tmp_path / WANDB_ID).read_text() == again["id"]
    given = WandbConfig(project="p", id="mine")
    assert wandb_run(sdk, given, None, str(tmp_path), 12)["id"] == "mine"
    assert "id" not in wandb_run(sdk, settings, None, None, 0)       # no checkpoint.dir
    # the W&B run already past the checkpoint (a copied checkpoint.dir, or a death after the
    # checkpoint): one line says W&B will ignore the steps up to there
    ahead = SimpleNamespace(init=lambda **kwargs: SimpleNamespace(step=21),
                            Settings=lambda **kwargs: kwargs)
    capsys.readouterr()
    wandb_run(ahead, settings, None, str(tmp_path), 20)
    assert capsys.readouterr().out == ""
    wandb_run(ahead, settings, None, str(tmp_path), 12)
    assert f"W&B run {again['id']} already holds steps up to 20 " in capsys.readouterr().out


def test_tensorboard_holds_each_step_once_when_a_run_starts_again(tmp_path, monkeypatch,
                                                                   capsys):
    """A run that died before its first checkpoint, started again in the same folder (a new
    run, from step 1): TensorBoard shows each step once, with the new run's value (its writer
    purges the earlier events from the first step it logs); a run resuming the checkpoint of
    step 1 there replaces the steps after it. In process, rank 0's writer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from mimo_train.components import metrics

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    folder = str(tmp_path / "tb")
    died = SummaryWriter(folder)                    # steps 1-3, then killed: no checkpoint
    for step in (1, 2, 3):
        died.add_scalar("train/loss", 10.0 + step, step)
    died.flush()

    def run(resumed: int, values: dict[int, float]) -> list[tuple[int, float]]:
        logged = metrics.Metrics(folder, 1, 3, None, [], resumed=resumed)
        for step, value in values.items():
            logged._write(step, {"train/loss": value})
        logged.close()
        events = EventAccumulator(folder)
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert run(0, {1: 1.0, 2: 2.0}) == [(1, 1.0), (2, 2.0)]
    # the new run said the folder held an earlier run's events; the resumed one says nothing
    assert capsys.readouterr().out == (
        f"mimo-train: train.tensorboard_dir {folder} holds an earlier run's events: "
        "TensorBoard shows this new run's steps in their place (give another folder to keep "
        "both)\n")
    assert run(1, {2: 20.0, 3: 30.0}) == [(1, 1.0), (2, 20.0), (3, 30.0)]
    assert capsys.readouterr().out == ""


def test_records_of_steps_after_the_resumed_checkpoint_are_dropped(tmp_path):
    """A run that died after step 6 with its checkpoint at step 4: the resumed run's records
    file keeps steps 1-4 (its evaluation at 4 too) and a note saying why 5-6 went; the torn
    last line of a killed writer goes too. Nothing after the step: the file is untouched."""
    import json

    from mimo_train.components.metrics import drop_after
    path = tmp_path / "records.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 7)]
    lines.insert(4, json.dumps({"step": 4, "eval_loss": 2.0}))
    path.write_text("\n".join(lines) + "\n" + '{"step": 7, "lo')
    drop_after(str(path), 4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], "eval_loss" in r) for r in records[:-1]] == \
        [(1, False), (2, False), (3, False), (4, False), (4, True)]
    assert records[-1] == {"step": 4, "note": "records of steps 5-6 and 1 unreadable line(s) "
                           "dropped: the run resumed from the checkpoint of step 4 and trains "
                           "the steps after it again"}
    before = path.read_text()
    drop_after(str(path), 4)
    assert path.read_text() == before


def test_a_records_file_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch):
    """A folder that reads writable (root's, on a virtual file system) may still refuse the
    file: opened as the run opens it, at start-up, and named; a file that can be written is
    neither made nor changed by the check, a link to nothing stays, and a pipe is not opened
    (its reader would see the check's close as the end)."""
    import builtins

    from mimo_train.components import metrics
    from mimo_train.errors import TrainConfigError
    refused, opened = tmp_path / "refused.jsonl", []

    def fake_open(path, *args, **kwargs):
        opened.append(str(path))
        if str(path) == str(refused):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(metrics, "open", fake_open, raising=False)
    with pytest.raises(TrainConfigError, match=f"--records: cannot write {refused}: "
                       "Permission denied: give a file in a writable folder"):
        metrics.check_outputs(str(refused), None)
    fresh, kept, link, pipe = (tmp_path / name for name in ("fresh", "kept", "link", "pipe"))
    kept.write_text('{"step": 1}\n')
    link.symlink_to(tmp_path / "store" / "run1.jsonl")
    (tmp_path / "store").mkdir()
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)     # its reader: an open never blocks
    for path in (fresh, kept, link, pipe):
        metrics.check_outputs(str(path), None)
    os.close(reader)
    assert not fresh.exists() and kept.read_text() == '{"step": 1}\n' and link.is_symlink()
    assert str(pipe) not in opened and str(fresh) in opened


def test_wandb_without_the_package_is_refused(monkeypatch):
    import importlib.util

    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrainConfigError, match="pip install 'mimo\\[wandb\\]'"):
        TrainConfig.load(None, ["data.datasets=[unused]", "train.wandb={project: p}"])
    with pytest.raises(TrainConfigError, match="train.wandb.mode is 'cloud'"):
        TrainConfig.load(None, ["data.datasets=[unused]", "train.wandb={project: p, mode: cloud}"])


def test_the_closing_loss_line_says_what_it_averages():
    """The run's loss, its first steps against its last: three each where there are six or
    more, one each for a short run, and a one-step run's loss alone; skipped steps left out."""
    from mimo_train.components.metrics import summary
    records = [{"loss": float(loss)} for loss in (9, 8, 7, 5, 4, 3)]
    assert summary(records) == ("mimo-train: loss over this run's 6 steps: 8.0000 (mean of the "
                                "first 3) -> 4.0000 (mean of the last 3)")
    assert summary(records[:3]) == ("mimo-train: loss over this run's 3 steps: 9.0000 (the "
                                    "first step) -> 7.0000 (the last step)")
    assert summary(records[:1]) == "mimo-train: loss of this run's one step: 9.0000"
    assert summary([{"step": 1}]) is None
    # steps skipped for a non-finite gradient norm (or loss) are in no mean
    nan = float("nan")
    skipped = [{"loss": 9.0, "skipped": False}, {"loss": nan, "skipped": True},
               {"loss": 7.0, "skipped": False}, {"loss": 1.0, "skipped": True}]
    assert summary(skipped) == ("mimo-train: loss over this run's 2 steps: 9.0000 (the first "
                                "step) -> 7.0000 (the last step) (2 skipped steps left out)")
    assert summary(skipped[1:2]) == ("mimo-train: no loss to sum up: its one step was skipped "
                                     "(a non-finite gradient norm or loss)")
    assert summary([skipped[1], skipped[3]]) == ("mimo-train: no loss to sum up: each of its 2 "
                                                 "steps was skipped (a non-finite gradient norm "
                                                 "or loss)")


def test_the_interval_loss_leaves_out_a_step_skipped_with_a_finite_loss():
    """The step line's ``(steps a-b: loss)`` of a logging interval is the loss per trained
    token of its trained steps: a step skipped for a non-finite gradient norm is left out even
    where its own loss is finite (its update was not applied)."""
    from mimo_train.components.metrics import line, train_record
    nan = float("nan")
    records = [train_record(1, 20.0, 10, 0.5, {"language": 1e-3}, False, 1.0, 4,
                            {"language": 0.1}),
               train_record(2, 500.0, 10, nan, {"language": 1e-3}, True, 1.0, 4,
                            {"language": 0.1}),
               train_record(3, 120.0, 30, 0.5, {"language": 1e-3}, False, 1.0, 4,
                            {"language": 0.1})]
    assert records[1]["loss"] == 50.0 and records[1]["skipped"]
    # (2.0 * 10 + 4.0 * 30) / 40 trained tokens; with step 2: (20 + 500 + 120) / 50 = 12.8
    assert line(records[2], records).startswith(
        "step    3: loss 4.0000 (steps 1-3: 3.5000)  grad_norm 0.500  lr 1.00e-03  "), \
        line(records[2], records)
    assert line(records[1], records[:2]).startswith("step    2: loss 50.0000 (steps 1-2: "
                                                    "2.0000)  grad_norm nan  ")
    assert line(records[1], records[:2]).endswith("  (skipped: non-finite gradients)")


def test_a_records_line_writes_nested_non_finite_values_as_null():
    """A record's JSON line is strict JSON: a NaN or infinity inside its per-module values
    (``lrs``, ``forward_s``, ``memory_mibs``), as well as a skipped step's loss and gradient
    norm, is written as null (Python would write ``NaN``, which jq refuses)."""
    import json

    from mimo_train.components.metrics import json_line
    nan, inf = float("nan"), float("inf")
    record = {"step": 7, "loss": nan, "grad_norm": inf, "lrs": {"image": nan, "language": 1e-3},
              "forward_s": {"image": 0.25, "language": inf}, "memory_mib": 12.0,
              "memory_mibs": {"image": 12.0, "language": nan},
              "anomaly": {"samples": [{"loss": nan}, 1.5]}}
    text = json_line(record)
    assert text.endswith("}\n") and text.count("\n") == 1

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    assert json.loads(text, parse_constant=refuse) == {
        "step": 7, "loss": None, "grad_norm": None, "lrs": {"image": None, "language": 1e-3},
        "forward_s": {"image": 0.25, "language": None}, "memory_mib": 12.0,
        "memory_mibs": {"image": 12.0, "language": None},
        "anomaly": {"samples": [{"loss": None}, 1.5]}}


def test_wandb_gets_the_steps_in_order_with_a_spike_read_among_them(monkeypatch):
    """A logging step reads steps 1-4, then the trainer logs a spike of step 2 and the
    evaluation of step 4: W&B (which drops a step logged after a later one) gets 1, 2, the
    spike's values at 2, 3, 4, the evaluation at 4. In process: rank 0's Metrics, its W&B run
    a recorder."""
    from types import SimpleNamespace

    from mimo_train.components import metrics

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    logged = metrics.Metrics(None, 4, 4, None, [])
    sent: list[tuple[int, list[str]]] = []
    logged.wandb = SimpleNamespace(log=lambda values, step: sent.append((step, sorted(values))),
                                   finish=lambda: None)
    logged.unwritten += [{"step": step, "loss": 1.0} for step in range(1, 5)]   # as flush
    logged.log_anomaly({"step": 2, "anomaly": {"reason": "loss spike", "loss": 9.0,
                                               "samples": []}})
    logged.unwritten.append({"step": 4, "eval_loss": 2.0})                     # as log()
    logged.publish()
    assert sent == [(1, ["train/loss"]), (2, ["train/loss"]), (2, ["anomaly/loss"]),
                    (3, ["train/loss"]), (4, ["train/loss"]), (4, ["eval_loss"])], sent
    logged.close()
    assert sent[6:] == []


def test_a_checkpoint_keeps_the_totals_of_its_own_step(monkeypatch):
    """A checkpoint saved between logging steps (log_interval 4, a save at step 2) keeps the
    totals to its step, its steps not logged yet included; and what it keeps stays as it was
    while an asynchronous save is written (later steps counted meanwhile). In process: rank
    0's Metrics through the trainer's ``save``, the saver a recorder."""
    from types import SimpleNamespace

    import torch

    from mimo_train.components import metrics
    from mimo_train.training.trainer import Trainer

    monkeypatch.setattr(metrics.dist, "get_rank", lambda: 0)
    layout = SimpleNamespace(modules=[SimpleNamespace(name="language")])
    logged = metrics.Metrics(None, 4, 4, layout, [])

    def step(number: int) -> metrics.StepValues:
        readings = metrics.Readings({"sums": torch.tensor([20.0, 10.0 * number]),
                                     "outcome": torch.zeros(2),
                                     "flops": torch.tensor([1.0, 100.0 * number])})
        return metrics.StepValues(number, readings, metrics.Timer(torch.device("cpu")), [], 8,
                                  lrs={})

    kept: list[dict] = []
    trainer = SimpleNamespace(
        saver=SimpleNamespace(save=lambda step, state, meta: kept.append(meta) or "ck",
                              queue=object()),
        unsettled=None, step=2, metrics=logged, training_state=lambda: None,
        _meta=lambda: {})
    for number in (1, 2):
        logged.log(step(number))
    Trainer.save(trainer)
    assert kept[0]["consumed"] == {"samples": 16, "tokens": 30, "sequence_tokens": 300}
    logged.consumed["samples"] += 32                   # steps counted while it is written
    assert kept[0]["consumed"] == {"samples": 16, "tokens": 30, "sequence_tokens": 300}
