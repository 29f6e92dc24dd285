"""Qwen3.5 through the model side: the published ``Qwen/Qwen3.5-4B`` and ``Qwen/Qwen3.5-35B-A3B``
(mixture of experts with a shared expert) files (``assets/models/published``, dims shrunk by
tools/make_published.py: four text layers, three gated delta-net (linear attention) then one
gated full attention; the MoE's layers 8 experts, 2 per token, and a shared expert) as
``model.pretrained``, on conversations from the corpus: a system turn and two images over two
turns, text only, a video, an image and a video.

- step 1's loss at lr 0 equals transformers' own ``Qwen3_5ForConditionalGeneration`` /
  ``Qwen3_5MoeForConditionalGeneration`` loss on the same micro-batches within 1e-5 (fp32,
  unpacked: transformers' delta-net is right on one sample), on the same trained-token count;
  and every gradient is transformers' float64 one (within 2e-4 of its largest entry: fp32's
  rounding on these untrained models, measured);
- packed: the four samples in one row give the same loss and every gradient as each sample
  alone (the delta-net's recurrent state and convolution window restart at each sample:
  ``mcore.delta_rule``);
- the tower's module at dp2 fanning in to language tp2 (the delta-net's and the attention's
  heads split over TP; the dense model packed, the MoE under sequence parallelism, its experts
  over ep4), and at dp1 fanning out to language dp2 in two pipeline stages (the gated attention
  layer on the second; packed, the distributed optimizer, full recompute; the MoE's experts
  over ep2), give the colocated step: loss and every
  gradient (the fan-in to 2e-4, as fp32 sums in another order give; the others to 1e-5);
- the language model's sequence cut over two context-parallel ranks (packed; the tower at dp2
  fanning in; the MoE's experts over ep2) gives the colocated step, the delta-net layers
  all-to-all over their heads;
- import then export gives every weight of the checkpoint back bit for bit, the
  multi-token-prediction weights (``mtp.*``, not trained) included; transformers' greedy
  ``generate`` on the export, from its own processor's tokens and pixels, equals
  ``mimo-generate`` on an image prompt and on a video prompt.

The data rules (the training template, timestamps, frame sampling, M-RoPE ids, tokens against
the published processor) are tests/test_qwen3_5_data.py's; the delta-net layer against
transformers' and packed against each sample alone, tests/test_gated_delta_net.py's.

Five jobs per checkpoint (one, one, four, five, and the context-parallel four forked ranks):
no existing job runs these checkpoints, and each layout needs its own world; the colocated one
is the reference the others, the export and the generation read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


from conftest import MODELS
from support.qwen_vlm import (assert_export_as_published, assert_generate_matches, build_shards,
                              run_setup, transformers_loss)
from support.runs import compare, step

PUBLISHED = MODELS / "published"
# the dense 4B (tied embeddings) and the mixture-of-experts 35B-A3B (8 experts of 24, 2 per
# token, a shared expert of 32; untied), as published, dims shrunk
CHECKPOINTS = {"4B": PUBLISHED / "Qwen--Qwen3.5-4B",
               "35B-A3B": PUBLISHED / "Qwen--Qwen3.5-35B-A3B"}
TOLERANCE = 1e-5                   # on the mean loss per trained token
# on a gradient, relative to its largest entry: these seeded (untrained) models' fp32 gradients
# are within 6e-5 of transformers' float64 ones (measured: the MoE's delta-net layers 5.9e-5
# colocated, 5.0e-5 at TP 2; the dense model's 1.5e-5 and 1.8e-5), so two fp32 layouts, which
# add up in other orders, differ by as much
GRADIENT_TOLERANCE = 2e-4
SAMPLES = 4
LAYOUT = "language=dp1;image=dp1,off0,video"


@pytest.fixture(scope="module")
def shards(corpus, corpus_videos, tmp_path_factory) -> Path:
    return build_shards(tmp_path_factory.mktemp("qwen3-5-shards"), corpus, corpus_videos)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def run(request, shards, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp(f"qwen3-5-{request.param}")
    return dict(run_setup(CHECKPOINTS[request.param], shards, tmp, SAMPLES, "model.freeze=[]"),
                name=request.param)


@pytest.fixture(scope="module")
def colocated(ranks, run) -> dict:
    """Step 1 colocated, one sample per micro-batch (padded), with the micro-batches it
    trained on; the imported model saved first (``init/step_0000000``)."""
    tmp = run["tmp"]
    return step(ranks, tmp / "colocated", 1, f"layout={LAYOUT}", "train.micro_batch_size=1",
                *run["common"], save_batches=True, save_init=tmp / "init")


@pytest.fixture(scope="module")
def reference(run, colocated) -> tuple[float, int, dict]:
    """transformers' mean loss per trained token on the colocated step's micro-batches, that
    count, and the gradients of that loss by parameter name, in float64 (the truth fp32 runs
    are held to). Where mimo's ``loss_mask`` is set at t, its label is token t + 1 (checked),
    transformers' label at t + 1 (its loss shifts back)."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(   # its grouped experts take no fp64
        run["checkpoint"], dtype=torch.float64, experts_implementation="eager").eval()
    config = run["config"].modalities
    total, count, kinds = 0.0, 0, set()
    for batch in colocated["ranks"][0]["batches"]:
        loss, tokens, modalities = transformers_loss(model, batch, config, torch.float64)
        (loss * tokens).backward()
        total, count = total + float(loss) * tokens, count + tokens
        kinds.add(modalities)
    assert kinds == {(), ("image",), ("video",), ("image", "video")}
    grads = {name: p.grad / count for name, p in model.named_parameters()
             if p.grad is not None}
    return total / count, count, grads


def _assert_loss(result: dict, reference: tuple, what: str) -> None:
    loss, tokens, _ = reference
    assert result["tokens"] == tokens, what
    assert math.isclose(result["loss_sum"] / result["tokens"], loss, rel_tol=0,
                        abs_tol=TOLERANCE), (what, result["loss_sum"] / result["tokens"], loss)


def test_step_one_loss_is_transformers_loss(colocated, reference):
    _assert_loss(colocated, reference, "colocated, padded")


def test_step_one_gradients_are_transformers_gradients(run, colocated, reference):
    """Every gradient of the colocated fp32 step (the tower's, the delta-nets' ``A_log``,
    ``dt_bias``, convolution and gated norm, the gated attention's, the experts', the
    embedding's) is transformers' float64 one under its published name: the backward through
    mimo's layers is transformers' model's."""
    from mimo_train.families.causal_lm import to_hf
    from mimo_train.families.registry import language_arch, read_vlm
    truth = reference[2]
    arch = language_arch(str(run["checkpoint"]))
    ours = to_hf([colocated["grads"]["language"]], arch)
    vlm = read_vlm(str(run["checkpoint"]))
    (tower, visual), = vlm.checkpoint_names(vlm.weights())
    ours.update({visual + name.removeprefix(tower): grad
                 for name, grad in colocated["grads"]["image"].items()})
    assert set(ours) == set(truth)
    for name, grad in truth.items():
        mine = ours[name] if ours[name].shape == grad.shape else ours[name].transpose(-1, -2)
        scale = max(1.0, grad.abs().max().item())
        assert (mine.double() - grad).abs().max() <= GRADIENT_TOLERANCE * scale, name


def test_packed_samples_give_each_sample_alone(ranks, run, colocated, reference):
    """The four samples packed in one row (one micro-batch) against each alone (the colocated
    step's micro-batches of one): transformers' loss, and every gradient, the delta-net's
    convolution, ``A_log`` and ``dt_bias`` included."""
    packed = step(ranks, run["tmp"] / "packed", 1, f"layout={LAYOUT}",
                  f"train.micro_batch_size={SAMPLES}", "data.packing=true",
                  f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}", *run["common"])
    _assert_loss(packed, reference, "colocated, packed")
    delta_net = [name for name in colocated["grads"]["language"] if name.endswith(".A_log")]
    assert len(delta_net) == 3, delta_net
    compare(colocated, packed, "packed")


def test_fan_in_to_tensor_parallel_is_the_colocated_step(ranks, run, colocated, reference):
    """The tower's module at dp2 fanning in to the language model at tp2 (the delta-net's key
    and value heads and the attention's heads split over the TP ranks): transformers' loss, and
    every gradient the colocated step has. The dense model packed; the mixture of experts with
    sequence parallelism (megatron-core's MoE layer needs it under TP), padded, at tp2 x dp2
    with its 8 experts over ep4, whole (etp1: two per rank, the all-to-all dispatcher over
    four ranks; the shared expert split over TP)."""
    dense = run["name"] == "4B"
    how = ["data.packing=true"] if dense else ["model.language.sequence_parallel=true"]
    language = "tp2" if dense else "tp2,dp2,ep4,etp1"
    fan_in = step(ranks, run["tmp"] / "fan-in", 4 if dense else 6,
                  f"layout=image=dp2,video;language={language}",
                  f"train.micro_batch_size={SAMPLES // 2}", *how,
                  # the MoE imports the checkpoint itself: each rank reads its experts' slices
                  *([f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}"] if dense
                    else []), *run["common"])
    _assert_loss(fan_in, reference, f"image dp2 -> language {language}, {how}")
    compare(colocated, fan_in, f"image dp2 -> language {language}, {how}", GRADIENT_TOLERANCE)
    # no third-party warning on the way: etp1's whole experts run without sequence
    # parallelism (megatron-core's note of it), the towers' DDP config no parallelism
    for log in (run["tmp"] / "fan-in" / "logs").glob("rank_*.err"):
        assert "Warning" not in log.read_text(), (log, log.read_text()[-3000:])


def test_context_parallel_is_the_colocated_step(ranks, run, colocated, reference):
    """The tower's module at dp2 fanning in to the language model's sequence cut over two
    context-parallel ranks, the four samples packed in one row (their boundaries across the
    cut): transformers' loss and every gradient the colocated step has. The delta-net layers
    and the gated attention each run between all-to-alls over their heads (each rank the whole
    row of one of the two key heads, its convolution channels, ``A_log`` and ``dt_bias``);
    the recurrent state and the convolution window still restart at each sample. The mixture
    of experts with its experts over the two ranks (ep2: 4 of each layer's 8 on each, the
    shared expert whole)."""
    dense = run["name"] == "4B"
    layout = "layout=image=dp2,video;language=cp2" + ("" if dense else ",ep2")
    sharded = step(ranks, run["tmp"] / "cp2", 4, layout,
                   f"train.micro_batch_size={SAMPLES}", "data.packing=true",
                   # the MoE imports the checkpoint itself: each rank reads its experts' slices
                   *([f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}"] if dense
                     else []), *run["common"])
    _assert_loss(sharded, reference, "image dp2 -> language cp2, packed")
    compare(colocated, sharded, "image dp2 -> language cp2, packed", GRADIENT_TOLERANCE)


def test_fan_out_to_two_pipeline_stages_gives_the_colocated_step(ranks, run, colocated):
    """The tower's one rank fanning out to two language DP ranks, each a pipeline of two
    stages of two layers (delta-net, delta-net | delta-net, gated attention), its two samples
    packed in one row (the samples' boundaries cross the stages with the hidden states), the
    distributed optimizer and full recompute (each delta-net layer runs twice per
    micro-batch). The 4B's embeddings are tied (as published); the 35B-A3B's experts are laid
    over the two DP ranks (ep2)."""
    experts = "" if run["name"] == "4B" else ",ep2"
    staged = step(ranks, run["tmp"] / "pp2", 5,
                  f"layout=image=dp1,video;language=pp2,dp2{experts}",
                  "train.micro_batch_size=2", "data.packing=true", "optimizer.distributed=true",
                  "model.language.recompute=full",
                  f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}", *run["common"])
    first_stage = next(rank["calls"]["language"] for rank in staged["ranks"]
                       if "language" in rank["calls"])
    (layer, _), (decoder, _) = (first_stage[p] for p in ("decoder.layers.0.self_attention",
                                                       "decoder"))
    assert layer == 2 * decoder > 0, (layer, decoder)
    if run["name"] == "4B":   # tied: the last stage's output layer holds the embedding's
        tied = staged["grads"]["language"].pop("output_layer.weight")
        embedding = colocated["grads"]["language"]["embedding.word_embeddings.weight"]
        assert (tied - embedding).abs().max() <= 1e-5
    compare(colocated, staged, "image dp1 -> language pp2 dp2")


@pytest.fixture(scope="module")
def exported(run, colocated) -> Path:
    """``mimo-export`` of the imported model (the colocated job's step-0 checkpoint)."""
    from mimo_train.hf.export import main as export
    out = run["tmp"] / "export"
    assert export(["--checkpoint", str(run["tmp"] / "init" / "step_0000000"),
                   "--output", str(out)]) == 0
    return out


def test_import_then_export_gives_every_weight_back(run, exported):
    """Every tensor under its published name, shape and dtype (``A_log`` and the gated norm
    float32 as published, the rest bf16), the multi-token-prediction weights included (written
    back as the checkpoint holds them: mimo does not train them)."""
    from safetensors.torch import load_file
    published: dict = {}
    ours: dict = {}
    for directory, found in ((run["checkpoint"], published), (exported, ours)):
        for path in sorted(directory.glob("*.safetensors")):
            found.update(load_file(path))
    assert any(name.startswith("mtp.") for name in published)
    assert set(ours) == set(published)
    for name, tensor in published.items():
        assert torch.equal(ours[name].to(tensor.dtype), tensor), name
    assert_export_as_published(run["checkpoint"], exported, run["config"].modalities)
    config = json.loads((exported / "config.json").read_text())
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_export_onto_a_moved_base_or_another_model(run, colocated, capsys, tmp_path):
    """``--base``: the model moved elsewhere (gone from where the run and its preprocessing
    YAML name it) exports without a word of a changed YAML (its tokenizer moves with the base;
    the YAML is as the run saved it); the other Qwen3.5 (the MoE for the dense run, the dense
    for the MoE's) is refused as another model than the run trained (exit 1), not as a
    damaged checkpoint."""
    import hashlib
    import shutil

    from mimo_train.hf.export import main as export
    step = run["tmp"] / "init" / "step_0000000"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["preprocess"]["tokenizer"] == meta["config"]["model"]["pretrained"]
    # the run as if it had trained on a copy at "old" with a YAML naming it, then moved; the
    # YAML names it by its absolute path (the dense run) or relative to the YAML's folder,
    # one slash in it, which gone cannot be told from a hub name (the MoE's)
    base, old = str(CHECKPOINTS[run["name"]]), str(tmp_path / "models" / "old")
    shutil.copytree(step, tmp_path / "step")
    yaml_path = tmp_path / "preprocess.yaml"
    yaml_path.write_text(run["preprocess"].read_text().replace(
        base, old if run["name"] == "4B" else "models/old"))
    rewritten = (step / "meta.json").read_text().replace(
        str(run["preprocess"]), str(yaml_path)).replace(base, old).encode()
    (tmp_path / "step" / "meta.json").write_bytes(rewritten)
    integrity = json.loads((step / "integrity.json").read_text())
    integrity["files"]["meta.json"] = hashlib.sha256(rewritten).hexdigest()
    integrity["sizes"]["meta.json"] = len(rewritten)
    (tmp_path / "step" / "integrity.json").write_text(json.dumps(integrity))
    shutil.copytree(base, tmp_path / "moved")
    capsys.readouterr()
    assert export(["--checkpoint", str(tmp_path / "step"), "--output", str(tmp_path / "out"),
                   "--base", str(tmp_path / "moved")]) == 0
    assert "is not as the run trained with it" not in capsys.readouterr().err
    other = CHECKPOINTS["35B-A3B" if run["name"] == "4B" else "4B"]
    assert export(["--checkpoint", str(step), "--output", str(tmp_path / "mixed"), "--base",
                   str(other)]) == 1
    err = capsys.readouterr().err
    assert f"which the config of --base {other}" in err and "holds another model than the run " \
        "trained" in err and err.rstrip().endswith(
            "give --base the model the run started from") and \
        not (tmp_path / "mixed").exists(), err


@pytest.mark.parametrize("kind", ["image", "video"])
def test_transformers_generate_on_the_export_equals_mimo_generate(run, exported, corpus,
                                                                  corpus_videos, kind):
    """transformers' processor (the published chat template, its image or video processor:
    frames sampled over the clip, ``<t seconds>`` before each temporal patch) and greedy
    ``generate`` on the exported model give ``mimo-generate``'s prompt and tokens."""
    assert_generate_matches(run["checkpoint"], run["config"].modalities, exported, corpus,
                            corpus_videos, kind)
