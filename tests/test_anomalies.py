"""Steps that go wrong, traced to their samples (mimo_train/components/anomalies.py), in
``mimo-train`` runs on forked ranks (the shards and the launcher: tests/support/anomaly_runs.py):

- a planted sample whose text SmolLM2 finds very unlikely (80 random vocabulary words among
  short plain-English answers) makes its step's loss spike: the step's record names its
  samples, the planted one among them, and ``mimo-inspect sample`` finds it by that key;
- an exploding learning rate makes the gradient norm non-finite: each such step is skipped
  (recorded with its samples, no weight moves), and past ``train.max_skipped_steps`` the run
  stops on every rank with one message and exit status 1, the records written;
- the spike run's evaluation (on a copy of its shards) covers the validation set once although
  ``train.eval_steps`` asks for more, and leaves the spike step's samples alone;
- the spike run's peak memory (``memory_mib``: the rank's growth from before the model build)
  is what ``mimo_train.planning.memory`` predicts for it, within 25%.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from support.anomaly_runs import SMOLLM2, planted, train_planted  # noqa: F401  (planted: a fixture)

SPIKE_SEED = 6


@pytest.fixture(scope="module")
def spike(ranks, planted, tmp_path_factory):  # noqa: F811
    """SmolLM2 (learning rate 0: its own losses) over one epoch of batches of two, fp32, one
    rank, evaluated at the last step on a copy of the shards (``data.valid``: 6 global batches,
    train.eval_steps 8): (exit status, output, records)."""
    shards, preprocess, _ = planted
    tmp = tmp_path_factory.mktemp("spike")
    valid = shutil.copytree(shards, tmp / "valid")
    return train_planted(
        ranks, tmp, "spike", f"data.datasets=[{shards}]", f"data.valid=[{valid}]",
        "train.eval_interval=6", "train.eval_steps=8", f"data.preprocess={preprocess}",
        "layout=language=dp1", f"model.language.pretrained={SMOLLM2}", "model.encoders={}",
        "model.language.num_layers=null", "model.language.hidden_size=null",
        "model.language.num_attention_heads=null", "optimizer.lr=0", "optimizer.min_lr=0",
        "optimizer.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2",
        f"train.seed={SPIKE_SEED}", "train.steps=6", "train.log_interval=4",
        "train.spike_factor=2.5", "train.spike_window=4", "train.precision=fp32")


def test_a_planted_sample_spikes_its_step_and_is_named(spike, planted):  # noqa: F811
    """The spike run (``spike``), whose seed puts the planted sample in the last of its 6
    steps (the spike window's first half seen two steps before, with spike-free steps checked
    on either side of a logging step): that step, and no other, is recorded as a spike, its
    samples (dataset, key, tokens) in the record: the step's two training samples, not the
    evaluation's that follows it."""
    shards, preprocess, key = planted
    code, output, records = spike
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
    # seed 6: the planted sample is in step 6 of the 6 (one epoch); only that step spikes
    assert [spike["step"] for spike in spikes] == [6], (losses, spikes)
    from mimo_data.inspect.cli import main
    assert main(["sample", str(shards), "--config", str(preprocess), "--key", key]) == 0


def test_an_evaluation_counts_each_validation_sample_once(spike):
    """``train.eval_steps`` 8 over a validation set of 6 global batches (the training set's
    copy: the same order, so with learning rate 0 its losses) runs those 6: start-up says so
    and names the set's size; the evaluation's tokens are the epoch's trained tokens, its loss
    their mean over the training steps."""
    code, output, records = spike
    assert code == 0, output[-4000:]
    assert ("mimo-train: train.eval_steps 8 is more than the validation set's 6 global "
            "batch(es) an epoch: each evaluation runs 6, every validation sample once") in output
    assert "mimo-train: validation set: 12 samples, 12 kept; 6 step(s) an epoch; 6 step(s) of " \
        "2 samples per evaluation, the same each time" in output, output[-4000:]
    train = [r for r in records if "loss" in r]
    (evaluation,) = [r for r in records if "eval_loss" in r]
    assert evaluation["step"] == 6 and len(train) == 6
    assert evaluation["eval_tokens"] == sum(r["tokens"] for r in train)
    assert evaluation["eval_samples"] == 12                 # the 6 steps of 2 samples
    assert f"eval step 6: loss {evaluation['eval_loss']:.4f} over " \
        f"{evaluation['eval_tokens']} tokens of 12 samples\n" in output, output[-4000:]
    assert evaluation["eval_loss"] == pytest.approx(
        sum(r["loss"] * r["tokens"] for r in train) / evaluation["eval_tokens"], rel=1e-5)


def test_the_memory_model_predicts_the_peak_of_the_run(spike, planted):  # noqa: F811
    """``mimo_train.planning.memory`` (through the layout advisor's evaluation of this run's
    layout, settings and micro-batches: the loader's dry run of the same seed) predicts the
    spike run's peak memory growth (``memory_mib``: from before the model build to the peak
    of the steps, VmHWM) within 25%. SmolLM2-135M in fp32 with Adam: 4 + 4 + 8 bytes per
    parameter (2.0 GiB) dominate; the activations of a micro-batch of two short samples
    (and their logits over 49152 rows) add about a tenth."""
    from types import SimpleNamespace

    from mimo_data.inspect.workload import workload
    from mimo_data.loading.layout import Layout
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.memory import Settings
    shards, preprocess, _ = planted
    code, output, records = spike
    assert code == 0, output[-4000:]
    measured = max(r["memory_mib"] for r in records if "loss" in r)
    config = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(shards)], config), config, 2, 2, seed=SPIKE_SEED)
    model = read_model(str(SMOLLM2), str(preprocess), config, {}, "fp32")
    advisor = Advisor(model, read_work(model, work), GPU("cpu", 1e6, 1.0, 1.0, 1.0))
    result = advisor.evaluate(Candidate(Layout.parse("language=dp1"), Settings("fp32")))
    predicted = result.memory["language"]
    assert predicted.weights == pytest.approx(4 * model.dims.language.parameters())
    assert predicted.optimizer == 2 * predicted.gradients == 2 * predicted.weights
    assert predicted.total / 2**20 == pytest.approx(measured, rel=0.25), \
        (SimpleNamespace(**predicted.gib()), measured)


def test_non_finite_steps_are_skipped_then_the_run_stops(ranks, planted,  # noqa: F811
                                                         tmp_path):
    """A learning rate of 1e30 makes the second step's activations overflow: steps 2, 3 and 4
    are skipped (each recorded with its two samples), and with train.max_skipped_steps=2 the
    third skip stops the run: exit 1, one message, the records written. The learning rate
    stays where step 1 left it (a skipped step does not step the schedule), though the
    trainer learns of a skip only in the next step (each step's outcome is read while the next
    one's passes are queued; here a logging step every 3). On two tensor-parallel ranks, which
    read the same samples: each record lists the step's two once (one rank reports them). The
    stop names the checkpoints that hold the weights the skips began from, and is torchrun's
    root cause (its error file)."""
    shards, preprocess, _ = planted
    error_file = tmp_path / "error.json"        # torchrun's, for the root cause it reports
    code, output, records = train_planted(
        ranks, tmp_path, "nan", f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
        "layout=language=tp2", "model.encoders={}", "optimizer.lr=1e30", "optimizer.min_lr=0",
        "optimizer.warmup_steps=0", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.steps=8", "train.max_skipped_steps=2", "train.log_interval=3", nproc=2,
        env={"TORCHELASTIC_ERROR_FILE": error_file})
    assert code != 0, output[-3000:]
    stops = re.findall(r"^mimo-train: 3 steps were skipped for a non-finite gradient norm.*$",
                       output, re.MULTILINE)
    assert len(stops) == 1, output
    # the weights the skips began from, step 1's update's: no checkpoint to resume
    assert "Weights gone wrong (a learning rate too high): step 1's update made the weights " \
        "every later step was skipped from, which every checkpoint of the run holds, so lower " \
        "optimizer.lr and start the run again. Or raise the limit" in stops[0], stops[0]
    # torchrun's report names it as the root cause (each rank's error file), not "<N/A>"
    assert json.loads(error_file.read_text())["message"]["message"] == stops[0]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["skipped"] for r in train] == [False, True, True, True]
    assert len({r["lr"] for r in train}) == 1 and 0 < train[0]["lr"] < 1e30, train
    # (JSON has no NaN: a non-finite norm is written as null)
    assert all(r["grad_norm"] is None for r in train[1:]) and \
        all(math.isfinite(r["grad_norm"]) for r in train[:1])
    skipped = [r["anomaly"] for r in records if "anomaly" in r]
    assert [a["skipped_steps"] for a in skipped] == [1, 2, 3]
    # each skipped step's anomaly record right after its own record
    assert [r["step"] for r in records] == [1, 2, 2, 3, 3, 4, 4], records
    assert all(a["skipped"] and len(a["samples"]) == 2 for a in skipped)


def test_the_stop_for_skipped_steps_says_which_checkpoints_hold_the_weights_they_began_from():
    """Past train.max_skipped_steps the stop's advice follows the skips' shape: a run of
    skipped steps from step F began from the weights of step F-1's update, which every
    checkpoint saved since holds; skips with updates between them claim no such step; from
    step 2, none of the run's checkpoints is before it; from step 1, the pretrained weights."""
    from mimo_train.components.anomalies import Watch

    def stop(*steps: int) -> str:
        watch = Watch(len(steps) - 1, 0.0, 1)
        watch.skipped.update(steps)         # as skip() counts them (its record gathered)
        said = watch.over_limit()
        assert said is not None and said.startswith(f"{len(steps)} steps were skipped")
        return said
    assert "the loss rising before step 5, the first skipped): a checkpoint saved at step 4 " \
        "or later holds the weights the skips began from (a skipped step updates none), so " \
        "lower optimizer.lr and resume from one saved before step 4 (mimo-inspect checkpoint " \
        "DIR --all lists them), or start the run again. Or raise the limit" in stop(5, 6, 7)
    spread = stop(5, 400, 401)
    assert "the loss rising before the skips, steps 5, 400, 401): lower optimizer.lr and " \
        "resume from a checkpoint saved before it rose" in spread and "step 4" not in spread
    assert "step 1's update made the weights every later step was skipped from" in stop(2, 3)
    assert "The first step was skipped: look at the pretrained weights too" in stop(1, 2)


@pytest.mark.parametrize("layout", [
    "language=dp1", "image=dp2;language=tp2,dp2", "language=tp2,pp2,dp2;image=dp4",
    "language=cp2,dp2", "image=dp2,off0;language=dp2,off0", "image=dp1;audio=dp1;language=pp2"])
def test_one_rank_of_each_language_dp_part_reports_its_samples(layout):
    """An anomaly record's samples come from one rank of each language DP part (its tensor,
    context and pipeline peers read the same samples), a rank that reads text: each part's
    samples once."""
    from mimo_data.loading.layout import LANGUAGE, Layout
    from mimo_train.components.anomalies import reports_samples
    parsed = Layout.parse(layout)
    reporters = [role for role in parsed.roles() if reports_samples(role)]
    assert sorted(role.module(LANGUAGE).dp_rank for role in reporters) == \
        list(range(parsed.language.dp))
    assert all(role.text_keys for role in reporters)


def test_a_sample_a_step_holds_twice_is_listed_twice(monkeypatch):
    """A small dataset up-sampled by data.weights can give a step one sample twice (where its
    pass ends inside the step): the record lists the step's every sample, the repeat too, as
    the reporting ranks gave them (a rank that does not report gives none)."""
    from mimo_train.components import anomalies
    first, again, other = ({"dataset": "b", "key": "000000001", "tokens": 9},
                           {"dataset": "b", "key": "000000001", "tokens": 9},
                           {"dataset": "a", "key": "000000004", "tokens": 7})
    monkeypatch.setattr(anomalies.distributed, "gather",
                        lambda samples: [[first, again], [], [other]])
    record = anomalies.Watch(0, 0.0, 1).skip(3, "non-finite", math.nan, [first, again])
    assert record["anomaly"]["samples"] == [first, again, other]


def test_spikes_are_looked_for_once_half_the_window_is_seen(monkeypatch):
    """``train.spike_window`` 4, factor 2: a loss above twice the median of the steps before
    is a spike from the third step on (half the window seen), not before; a skipped step's
    loss is in no window."""
    from mimo_train.components import anomalies
    monkeypatch.setattr(anomalies.distributed, "gather", lambda samples: [samples])

    def spiking(losses: list[float], skipped: tuple[int, ...] = ()) -> list[int]:
        watch = anomalies.Watch(9, 2.0, 4)
        for step in skipped:
            watch.skip(step, "non-finite", math.nan, [])
        records = [{"step": step, "loss": loss, "grad_norm": 1.0}
                   for step, loss in enumerate(losses, 1)]
        return [r["step"] for r in watch.spikes(records, {})]
    assert spiking([1.0, 5.0]) == []                      # one step before: not yet
    assert spiking([1.0, 1.0, 5.0]) == [3]
    assert spiking([1.0, 1.0, 5.0, 1.0, 1.0, 1.1]) == [3]
    # the skipped steps' losses are in no median: step 5's is 1, not 5
    assert spiking([1.0, 1.0, 9.0, 9.0, 5.0], skipped=(3, 4)) == [5]
