"""The layout advisor (``mimo-inspect plan --model M --gpus N``; mimo_train/planning/memory.py
and advisor.py):

- the memory formulas against a hand count (numbers written out below);
- its ranking of three layouts of one model on 4 ranks against their runs (one job of forked
  ranks, ``tests/jobs/train_runs.py``: the three runs one after another in one process group):
  the predicted order of the step times is the order of the work the runs' busiest ranks
  did, the floating-point operations torch counted in their train steps, the layouts about 2x
  apart by design (the language model's output layer over 49152 rows is the work, packed and
  balanced; language dp 1, 2 and 4). A count, not seconds: on this 2-core machine, shared
  with the other pytest worker, even the busiest rank's CPU seconds (its main thread's) move
  with the load, and the two closer layouts measured only 1.3x to 1.7x apart, a margin a
  loaded machine can cross; the counts are the same on a busy machine as on an idle one;
- the command in-process: text and ``--json`` output, layouts dropped for memory, a layout
  of the user's marked, and the options' errors (``mimo_data`` alone has no advisor).

The measured peak memory of a real run against the prediction is tests/test_anomalies.py's
(SmolLM2-135M: weights and optimizer state dominate).

Why a job of its own: no existing job trains one model under several layouts with work large
enough for the compute to dominate the step.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, preprocess_config_file
from mimo_data.loading.layout import Layout
from mimo_train.planning import memory as mem
from mimo_train.planning.dims import Stack

LAYOUTS = {"language dp1": "image=dp3;language=dp1", "language dp2": "image=dp2;language=dp2",
           "colocated dp4": "language=dp4;image=dp4,off0"}
BATCH, MICRO, SEED, STEPS = 12, 3, 1, 4


# ------------------------------------------------------------------------ by hand

STACK = Stack(layers=2, hidden=64, heads=4, query_groups=4, kv_channels=16, ffn_hidden=256,
              gated=False, vocab=128)


def test_parameters_and_state_bytes_by_hand():
    # a layer: qkv 64 x 192 = 12288, out 64 x 64 = 4096, MLP 64 x 256 x 2 = 32768, norms 128
    assert STACK.layer_parameters() == (49152, 128)
    # 2 layers 98560 + final norm 64 + embedding and output 128 x 64 x 2 = 16384
    assert mem.language_stage_parameters(STACK) == 115008 == STACK.parameters()
    # tp2 pp2, first stage: one layer 49152 / 2 + 128, embedding 8192 / 2
    assert mem.language_stage_parameters(STACK, tp=2, pp=2, stage=0) == 24704 + 4096
    # last stage: one layer, final norm 64, output 4096 (tied at pp2: a copy there too)
    assert mem.language_stage_parameters(STACK, tp=2, pp=2, stage=1) == 24704 + 64 + 4096
    bf16 = mem.Settings("bf16")
    assert mem.state_bytes(115008, bf16) == mem.Memory(230016, 460032, 1380096)   # 2, 4, 12
    assert mem.state_bytes(115008, mem.Settings("bf16", distributed_optimizer=True),
                           dp=4) == mem.Memory(230016, 460032, 345024)            # 12 / 4
    assert mem.state_bytes(115008, mem.Settings("fp32")).total == 115008 * 16     # 4, 4, 8
    assert mem.state_bytes(115008, bf16, trained=False) == mem.Memory(weights=230016)


def test_activation_bytes_by_hand():
    bf16 = mem.Settings("bf16")
    # one sample of 100 tokens: 34 h T = 34 x 64 x 100 (MHA, MLP 4h: Korthikanti's formula)
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16) == 217600
    # scores kept (local attention): + 5 heads s^2 = 5 x 4 x 10000
    scores = mem.Settings("bf16", attention_scores=True)
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, scores) == 417600
    # ... dropped by selective recompute
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, mem.Settings(
        "bf16", recompute="selective", attention_scores=True)) == 217600
    # tp2 with sequence parallel: everything halves; without, 10 h T stays whole
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16, tp=2,
                                      sequence_parallel=True) == 108800
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, bf16, tp=2) == 64000 + 76800
    # fp32 doubles it
    assert mem.layer_activation_bytes(STACK, 100, 100 ** 2, mem.Settings("fp32")) == 435200
    # the whole model: 2 layers + logits 100 x 128 x (2 + 4)
    assert mem.language_activation_bytes(STACK, [100], bf16) == 2 * 217600 + 76800
    # full recompute: each layer's input 2 h T = 12800, plus one layer's set
    assert mem.language_activation_bytes(STACK, [100], mem.Settings(
        "bf16", recompute="full")) == 2 * 12800 + 217600 + 76800
    # 1F1B: the first of 3 stages holds 3 micro-batches of its layer (pp2: one layer)
    assert mem.in_flight(8, 3, 0) == 3 and mem.in_flight(8, 3, 2) == 1
    assert mem.in_flight(2, 3, 0) == 2
    # temporaries at the last stage: the output's weight gradient 128 x 64 x 2, two fp32
    # copies of the logits 2 x 100 x 128 x 4
    assert mem.language_temporary_bytes(STACK, 100, bf16) == 16384 + 102400


def test_a_tower_under_selective_recompute_keeps_its_scores():
    """A transformers tower has no selective recompute: under the run's ``selective`` it
    keeps what it keeps under ``none``, the attention scores (a local kernel's) included."""
    from mimo_train.planning.dims import Tower
    tower = Tower("siglip", STACK, (), 64)
    grids = [(1, 10, 10)]
    kept = {r: mem.tower_activation_bytes(tower, grids, mem.Settings(
        "bf16", recompute=r, attention_scores=True)) for r in mem.RECOMPUTE}
    assert kept["selective"] == kept["none"] > kept["full"]
    # 2 layers of 100 positions, each with its 5 heads s^2 of scores (as by hand above)
    assert kept["none"] == 2 * 417600


# ------------------------------------------------------------------- the model, the data

@pytest.fixture(scope="module")
def model_yaml(loader_corpus, tmp_path_factory):
    """A small image + language model whose language output layer (49152 rows) is most of
    the work, its preprocessing (images only: samples with audio are dropped)."""
    tmp = tmp_path_factory.mktemp("planning")
    base = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    # at most 16 tokens per image: the images' decoding, on the image ranks, stays small
    preprocess = preprocess_config_file(tmp / "preprocess.yaml", image={
        **base["modalities"]["image"], "max_pixels": 12544})
    config = {"data": {"datasets": [str(loader_corpus)], "preprocess": str(preprocess),
                       "packing": True, "balance": "tokens", "num_workers": 1},
              "layout": LAYOUTS["language dp1"],
              "model": {"language": {"num_layers": 1, "hidden_size": 64,
                                     "num_attention_heads": 2},
                        "encoders": {"image": {"hidden_size": 32, "num_layers": 1,
                                               "num_attention_heads": 2}}},
              "optimizer": {"warmup_steps": 0},
              "train": {"global_batch_size": BATCH, "micro_batch_size": MICRO, "steps": STEPS,
                        "seed": SEED, "device": "cpu", "log_interval": STEPS},
              "checkpoint": {"dir": None}}
    path = tmp / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    return tmp, path, preprocess


def _args(**changes) -> SimpleNamespace:
    values = dict(gpus=4, gpu="h100", gpu_memory_gib=None, gpu_tflops=None, mfu=None,
                  precision=None, distributed_optimizer="both", recompute="any",
                  no_sequence_parallel=False, top=5, layout=None)
    return SimpleNamespace(**{**values, **changes})


def _run(capsys, main, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main`` in-process."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan(capsys, loader_corpus, preprocess, model, *extra, main) -> tuple[int, str, str]:
    return _run(capsys, main, "plan", loader_corpus, "--config", preprocess, "--model", model,
                "--global-batch-size", BATCH, "--micro-batch-size", MICRO, *extra)


# --------------------------------------------------------------------- the measured ranking

@pytest.fixture(scope="module")
def measured(ranks, model_yaml):
    tmp, path, _ = model_yaml
    runs = [{"name": name, "config": str(path), "overrides": [f"layout={layout}"],
             "count_flops": True} for name, layout in LAYOUTS.items()]
    (tmp / "runs.json").write_text(json.dumps(runs))
    ranks.run(4, [REPO / "tests" / "jobs" / "train_runs.py", tmp / "runs.json",
                  tmp / "out.json"], tmp / "logs", timeout=900).check()
    return json.loads((tmp / "out.json").read_text())


def test_the_predicted_order_of_three_layouts_is_the_measured_one(measured, model_yaml):
    """The advisor's step times of the three layouts (fp32, the runs' settings) are ordered as
    the work of the runs' busiest ranks, the FLOPs torch counted in their train steps (the
    language model's share of each micro-batch on its DP rank, the tower's beside it on a
    colocated rank): predicted 1.7x to 1.9x apart, counted about 2x, each pair held to 1.5x.
    The busiest ranks' CPU seconds per step (the least of steps 2 to 4) are in the messages
    only: they order the same way on an idle machine, but the closer pair measured 1.3x to
    1.7x apart, which load can undo."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    _, path, preprocess = model_yaml
    config = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(yaml.safe_load(path.read_text())["data"]["datasets"][0])],
                               config), config, BATCH, MICRO, seed=SEED, steps=STEPS)
    model = read_model(str(path), str(preprocess), config, work["modalities"])
    assert model.precision == "fp32"
    advisor = Advisor(model, read_work(model, work), GPU("cpu", 1e3, 0.02, 1e3, 1e3))
    predicted = {name: advisor.evaluate(Candidate(Layout.parse(layout), mem.Settings("fp32")))
                 for name, layout in LAYOUTS.items()}
    assert all(len(run["records"]) == STEPS for run in measured.values())
    # the busiest rank's FLOPs over the run's steps
    flops = {name: max(sum(steps) for steps in run["step_flops"])
             for name, run in measured.items()}
    order = sorted(LAYOUTS, key=lambda name: predicted[name].step_s)
    cpu_s = {name: max(min(steps[1:]) for steps in run["step_cpu_s"])
             for name, run in measured.items()}
    assert order == sorted(LAYOUTS, key=lambda name: flops[name]), (
        {n: r.step_s for n, r in predicted.items()}, flops, cpu_s)
    for slower, faster in zip(order[1:], order):
        assert predicted[slower].step_s > 1.5 * predicted[faster].step_s
        assert flops[slower] > 1.5 * flops[faster], (flops, cpu_s)
    assert order == ["colocated dp4", "language dp2", "language dp1"]
    assert predicted["language dp1"].bottleneck == "language"


def test_model_flops_count_the_passes_the_trainer_counts(model_yaml):
    """A frozen language model after a trained tower runs 2 passes (input gradients only):
    the advisor's model FLOPs (its MFU) count 2, as the trainer's FlopsCounter does
    (``flops.training_passes``), not 3; its own weights keep no gradients."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.flops import language_flops
    tmp, path, preprocess = model_yaml
    config = yaml.safe_load(path.read_text())
    config["model"]["freeze"] = ["language"]
    frozen = tmp / "model-frozen-language.yaml"
    frozen.write_text(yaml.safe_dump(config))
    preprocessing = PreprocessConfig.from_yaml(preprocess)
    work = workload(DataSource([str(config["data"]["datasets"][0])], preprocessing),
                    preprocessing, BATCH, MICRO, seed=SEED, steps=2)
    model = read_model(str(frozen), str(preprocess), preprocessing, work["modalities"])
    assert model.passes["language"] == 2 and model.passes["image.encoder"] == 3
    assert model.trained == {"language": False, "image.encoder": True,
                             "image.projection": True}
    steps = read_work(model, work)
    result = Advisor(model, steps, GPU("cpu", 1e3, 0.02, 1e3, 1e3)).evaluate(
        Candidate(Layout.parse(LAYOUTS["language dp1"]), mem.Settings("fp32")))
    language = sum(language_flops(model.dims.language, lengths, 2)
                   for lengths in steps.lengths) / len(steps.lengths)
    encoders = sum(map(sum, steps.encoder_flops["image"])) / len(steps.lengths)
    assert language > 0 and result.flops == pytest.approx(language + encoders)


# ------------------------------------------------------------------------------ the command

def test_plan_ranks_layouts_that_fit(capsys, loader_corpus, model_yaml):
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                           "--layout", LAYOUTS["language dp2"], main=main)
    assert code == 0, err
    report = json.loads(out)
    ranked = report["ranked"]
    assert report["layouts"] >= 3 and report["fitting_layouts"] == report["layouts"]
    times = [r["step_s"] for r in ranked if r["rank"] <= 5]
    assert times == sorted(times) and len(times) == min(5, report["fitting_layouts"])
    assert all(r["fits"] and r["peak_memory_gib"] <= report["gpu"]["usable_gib"]
               for r in ranked)
    assert report["yours"] == LAYOUTS["language dp2"]
    assert LAYOUTS["language dp2"] in [r["layout"] for r in ranked]
    assert all(set(r["memory_gib"]) and r["bottleneck"] and 0 <= r["idle_fraction"] < 1
               for r in ranked)
    assert report["model"]["precision"] == "fp32"
    # each comes with the overrides that train it, which the training config takes
    from mimo_train.config import TrainConfig
    for r in ranked:
        cfg = TrainConfig.load(str(path), r["overrides"])
        assert Layout.parse(cfg.layout).colocated == r["colocated"]
        assert cfg.optimizer.distributed == r["settings"]["distributed_optimizer"]
        assert cfg.model.language.recompute == r["settings"]["recompute"]
    # the text form: the table and the reasons, the user's layout marked
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--layout",
                           LAYOUTS["language dp2"], main=main)
    assert code == 0, err
    assert "<- yours" in out and "why" in out and "bottleneck" in out
    assert "train the first with: mimo-train --config ... 'layout=" in out
    assert out.count("\n  1. ") == 1


def test_plan_settings_are_ones_the_trainer_takes(capsys, loader_corpus, model_yaml):
    """Packed data (the YAML's data.packing: true, no --packing given): no candidate takes
    sequence parallel, which the trainer refuses with packing; unpacked, those with tp > 1
    do. Each recommendation's overrides, on a YAML whose optimizer.modules.image sets its
    own ``distributed``, give every module the recommended distributed optimizer and the
    recommended sequence parallel, and the trainer's memory settings accept them."""
    from mimo_train.config import TrainConfig
    from mimo_train.inspect_cli import main
    from mimo_train.plan import resolve
    tmp, path, preprocess = model_yaml
    for packing in (True, False):
        config = yaml.safe_load(path.read_text())
        config["data"]["packing"] = packing
        config["optimizer"]["modules"] = {"image": {"distributed": not packing}}
        variant = tmp / f"model-packing-{packing}.yaml"
        variant.write_text(yaml.safe_dump(config))
        # 5 GPUs: image=dp3;language=tp2 is a layout (the micro-batches of 3 split in 3)
        code, out, err = _plan(capsys, loader_corpus, preprocess, variant, "--gpus", 5,
                               "--json", "--top", 50, main=main)
        assert code == 0, err
        report = json.loads(out)
        assert report["workload"]["packing"] is packing
        ranked = report["ranked"]
        assert any(Layout.parse(r["layout"]).language.tp > 1 for r in ranked)
        for r in ranked:
            tp = Layout.parse(r["layout"]).language.tp
            assert r["settings"]["sequence_parallel"] is (tp > 1 and not packing)
            cfg = TrainConfig.load(str(variant), r["overrides"])
            assert cfg.model.language.sequence_parallel is r["settings"]["sequence_parallel"]
            for module in ("language", "image"):
                assert cfg.optimizer.of(module).distributed is \
                    r["settings"]["distributed_optimizer"]
            resolve(cfg)                # the trainer's start-up: raises what it refuses
    # --packing against the YAML's data.packing: false
    code, _, err = _plan(capsys, loader_corpus, preprocess, variant, "--gpus", 4, "--packing",
                         main=main)
    assert code == 2 and "data.packing: false" in err


def test_plan_drops_layouts_that_do_not_fit(capsys, loader_corpus, model_yaml):
    """A GPU with memory between the layouts' peaks (one setting each): the ranked ones fit,
    the dropped ones are over the usable memory; with less than any needs, none fits (exit
    1)."""
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    one = ("--recompute", "none", "--distributed-optimizer", "no")   # one setting a layout
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--top", 50, *one, main=main)
    peaks = sorted(r["peak_memory_gib"] for r in json.loads(out)["ranked"])
    assert peaks[0] < peaks[-1]
    usable = (peaks[0] + peaks[-1]) / 2
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         "--gpu-memory-gib", (usable + 1) / 0.9, *one, main=main)
    report = json.loads(out)
    assert code == 0 and report["dropped_layouts"] >= 1
    assert all(r["peak_memory_gib"] <= usable + 1e-6 for r in report["ranked"])
    assert all(r["peak_memory_gib"] > usable - 1e-6 for r in report["dropped"])
    # the text: the layouts that fit with no settings counted, the settings that do not
    # fit listed as settings (with all settings tried, each layout fits with some here)
    memory = ("--gpu-memory-gib", (usable + 1) / 0.9)
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                         *memory, main=main)
    every = json.loads(out)
    assert every["dropped"]
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, *memory,
                         main=main)
    assert code == 0 and "smallest settings that do not fit (a layout may fit" in out
    assert f"{every['fitting_layouts']} fit, {every['dropped_layouts']} do not fit in memory "\
        "with any settings" in out
    code, out, _ = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4,
                         "--gpu-memory-gib", 1.0, main=main)
    assert code == 1 and "no layout fits" in out


def test_plan_advisor_options_errors(capsys, loader_corpus, model_yaml):
    from mimo_data.inspect.cli import main as data_main
    from mimo_train.inspect_cli import main
    _, path, preprocess = model_yaml
    code, _, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 2, main=data_main)
    assert code == 2 and "need mimo_train" in err
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess, "--gpus",
                        2, "--global-batch-size", 4, "--micro-batch-size", 1)
    assert code == 2 and "--model" in err
    # a language model alone for a config with images: no encoder dims to guess
    language_only = path.parent / "language-only"
    language_only.mkdir(exist_ok=True)
    (language_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = _plan(capsys, loader_corpus, preprocess, language_only, "--gpus", 2,
                         main=main)
    assert code == 2 and "language model alone" in err and "image" in err, err
    assert "model.encoders" in err
    # numbers that cannot be: refused by argparse (exit 2), no silent default for 0
    for option, value in (("--mfu", 0), ("--mfu", 1.5), ("--gpu-memory-gib", 0),
                          ("--gpu-tflops", -1), ("--gpus-per-node", 0), ("--gpus", 0)):
        with pytest.raises(SystemExit) as exit_:
            _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, option, value,
                  main=main)
        assert exit_.value.code == 2 and option in capsys.readouterr().err
    # your layout on another number of GPUs, or one its check refuses: said, not ranked
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 5, "--layout",
                           LAYOUTS["language dp1"], main=main)
    assert code == 0, err
    assert f"yours     {LAYOUTS['language dp1']}: not ranked: uses 4 GPUs, not 5" in out
    assert "<- yours" not in out
    code, out, err = _plan(capsys, loader_corpus, preprocess, path, "--gpus", 4, "--json",
                           "--layout", "image=dp1;language=dp3", main=main)
    report = json.loads(out)
    assert code == 0 and report["yours_not_ranked"].startswith("not ranked: ")
    assert "global" in report["yours_not_ranked"]       # the LayoutError's own words
    assert "image=dp1;language=dp3" not in [r["layout"] for r in report["ranked"]]
    code, _, err = _run(capsys, main, "plan", loader_corpus, "--config", preprocess,
                        "--global-batch-size", 4, "--micro-batch-size", 1)
    assert code == 2 and "--layout" in err
