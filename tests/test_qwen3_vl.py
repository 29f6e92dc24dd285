"""Qwen3-VL through the model side: the published ``Qwen/Qwen3-VL-2B-Instruct`` and
``Qwen/Qwen3-VL-30B-A3B-Instruct`` (mixture of experts) files (``assets/models/published``,
dims shrunk by tools/make_published.py: four text layers, a four-block tower with deepstack
blocks [0, 1, 2]; the MoE's layers 8 experts, 2 per token) as ``model.pretrained``, on
conversations from the corpus: a system turn and two images over two turns, text only, a
video, an image and a video.

- step 1's loss at lr 0 equals transformers' own ``Qwen3VLForConditionalGeneration`` loss on
  the same micro-batches within 1e-5 (fp32, its ``labels=`` path), on the same trained-token
  count, one sample per micro-batch (padded) and packed;
- the tower's module at dp2 fanning in to language tp2 (packed, a clip cut over the two tower
  ranks by ``data.split_media``; the MoE at tp2 x dp2, whole samples, its experts over ep2),
  and at dp1 fanning out to language dp2 in two pipeline stages (the third
  deepstack layer's rows then cross to the second stage; the MoE's experts over ep2), give the
  colocated step: loss and every gradient, the deepstack mergers' and
  the tower's inner blocks' included;
- import then export gives every weight of the checkpoint back bit for bit; transformers'
  greedy ``generate`` on the export, from its own processor's tokens and pixels, equals
  ``mimo-generate`` on an image prompt and on a video prompt;
- the language model under context parallelism (cp2 packed, cp4 padded) gives the colocated
  step: loss and every gradient;
- what cannot carry deepstack rows is refused with the reason (a projection, the language
  model's full recompute), and the layout advisor does not propose it.

The data rules (timestamps, frame sampling, M-RoPE ids, tokens against the published
processor) are tests/test_qwen3_vl_data.py's.

Five jobs per checkpoint (one, four, five, and the context-parallel four and five forked
ranks): no existing job runs these checkpoints, and each layout needs its own world; the
colocated one is the reference the others, the export and the generation read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch


from conftest import MODELS
from support.qwen_vlm import (assert_export_as_published, assert_generate_matches, build_shards,
                              run_setup, transformers_balance, transformers_loss)
from support.runs import assert_continues, compare, copy_checkpoint, step, train

PUBLISHED = MODELS / "published"
# the dense 2B (tied embeddings) and the mixture-of-experts 30B-A3B (8 experts of 24, 2 per
# token; untied; sharded), as published, dims shrunk
CHECKPOINTS = {"2B": PUBLISHED / "Qwen--Qwen3-VL-2B-Instruct",
               "30B-A3B": PUBLISHED / "Qwen--Qwen3-VL-30B-A3B-Instruct"}
TOLERANCE = 1e-5                   # on the mean loss per trained token
SAMPLES = 4
LAYOUT = "language=dp1;image=dp1,off0,video"
BALANCE = 0.1               # the MoE's load-balancing loss coefficient (large: a real share)


@pytest.fixture(scope="module")
def shards(corpus, corpus_videos, tmp_path_factory) -> Path:
    return build_shards(tmp_path_factory.mktemp("qwen3-vl-shards"), corpus, corpus_videos)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def run(request, shards, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp(f"qwen3-vl-{request.param}")
    # the mixture of experts' steps with its load-balancing loss on (its gradient is part of
    # every comparison across layouts)
    balance = [f"model.language.moe_aux_loss={BALANCE}"] if request.param == "30B-A3B" else []
    return dict(run_setup(CHECKPOINTS[request.param], shards, tmp, SAMPLES, "model.freeze=[]",
                          *balance), name=request.param)


@pytest.fixture(scope="module")
def colocated(ranks, run) -> dict:
    """Step 1 colocated, one sample per micro-batch (padded), with the micro-batches it
    trained on; the imported model saved first (``init/step_0000000``). The mixture of
    experts with its load-balancing loss then trains two steps more, the second watched for
    host reads."""
    tmp, moe = run["tmp"], run["name"] != "2B"
    return step(ranks, tmp / "colocated", 1, f"layout={LAYOUT}", "train.micro_batch_size=1",
                *run["common"], *(["train.steps=3"] if moe else []), save_batches=True,
                save_init=tmp / "init", host_reads=moe)


@pytest.fixture(scope="module")
def reference(run, colocated) -> tuple[float, int]:
    """transformers' mean loss per trained token on the colocated step's micro-batches, and
    that count."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(run["checkpoint"],
                                                        dtype=torch.float32).eval()
    total, count, kinds = 0.0, 0, set()
    for batch in colocated["ranks"][0]["batches"]:
        with torch.no_grad():
            loss, tokens, modalities = transformers_loss(model, batch, run["config"].modalities,
                                                         torch.float32)
        kinds.add(modalities)
        total, count = total + float(loss) * tokens, count + tokens
    assert kinds == {(), ("image",), ("video",), ("image", "video")}
    return total / count, count


def _assert_loss(result: dict, reference: tuple[float, int], what: str) -> None:
    loss, tokens = reference
    assert result["tokens"] == tokens, what
    assert math.isclose(result["loss_sum"] / result["tokens"], loss, rel_tol=0,
                        abs_tol=TOLERANCE), (what, result["loss_sum"] / result["tokens"], loss)


def test_step_one_loss_is_transformers_loss(colocated, reference):
    _assert_loss(colocated, reference, "colocated, padded")


def test_the_load_balancing_loss_is_transformers_on_the_global_batch(run, colocated):
    """With ``model.language.moe_aux_loss``, the step's balancing loss is transformers' own
    (``load_balancing_loss_func`` on its router logits) over the global batch's four
    micro-batches together, padding left out; the dense model has none."""
    if run["name"] == "2B":
        assert colocated["moe_aux_loss"] is None
        return
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(run["checkpoint"],
                                                        dtype=torch.float32).eval()
    expected = transformers_balance(model, colocated["ranks"][0]["batches"],
                                    run["config"].modalities)
    assert expected > 1.0          # 2 (top-k) at perfect balance: the replica is far from it
    assert colocated["moe_aux_loss"] == pytest.approx(expected, rel=1e-6, abs=0)


def test_the_load_balancing_loss_reads_nothing_on_the_host(run, colocated):
    """A step with ``model.language.moe_aux_loss`` (its counting pass, then its training
    pass) reads none of the loss's values on the host: the global batch's expert shares, its
    real rows, its value and the step's trained tokens stay on the device (on a GPU, each read
    waited for the queue), the value read with the step's record (``Readings.read``)."""
    if run["name"] == "2B":
        return
    (rank,) = colocated["ranks"]
    ours = {site for site in rank["host_reads"] if site.startswith("mimo_train")}
    assert any(site.endswith("Readings.read") for site in ours), ours
    assert not any("mcore/balance.py" in site or "forward_backward" in site
                   for site in ours), ours


def test_fan_in_to_tensor_parallel_is_the_colocated_step(ranks, run, colocated, reference):
    """The tower's module at dp2 fanning in to the language model at tp2: transformers' loss,
    and every gradient the colocated step has, deepstack mergers included. The dense model
    packed, with ``data.split_media``: both tower ranks read the micro-batch of two and each
    encodes a token-balanced part of its images and clips in placeholder order (the clip of
    three temporal patches beside the text-only sample is cut after its first patch: rank 0
    encodes [1, h, w], rank 1 [2, h, w]; test_media_split.py checks the parts), the bridge
    joining them in rank order; the whole-sample fan-in of the dense model is the cp2 case's.
    The mixture of experts with whole samples per tower rank (the text-only sample leaves one
    rank nothing to encode, its empty rows as wide as the others) and sequence parallelism
    (megatron-core's MoE layer needs it under TP; the deepstack rows are then split over the
    sequence as the embeddings are), padded, at tp2 x dp2 with its 8 experts over ep2 (each
    rank 4, each expert split over TP: the all-to-all dispatcher between the two
    expert-parallel ranks)."""
    deepstack = [name for name in colocated["grads"]["image"] if "deepstack_merger" in name]
    assert len({name.split(".")[-3] for name in deepstack}) == 3, deepstack
    dense = run["name"] == "2B"
    how = ["data.packing=true", "data.split_media=true"] if dense \
        else ["model.language.sequence_parallel=true"]
    language = "tp2" if dense else "tp2,dp2,ep2"
    fan_in = step(ranks, run["tmp"] / "fan-in", 4 if dense else 6,
                  f"layout=image=dp2,video;language={language}",
                  f"train.micro_batch_size={SAMPLES // 2}", *how,
                  # the MoE imports the checkpoint itself: each rank reads its experts' slices
                  *([f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}"] if dense
                    else []), *run["common"])
    _assert_loss(fan_in, reference, f"image dp2 -> language {language}, {how}")
    compare(colocated, fan_in, f"image dp2 -> language {language}, {how}")


def test_fan_out_to_two_pipeline_stages_gives_the_colocated_step(ranks, run, colocated):
    """The tower's one rank fanning out to two language DP ranks, each a pipeline of two
    stages of two layers: deepstack rows 0 and 1 are added on the first stage, row 2 crosses
    to the second with the hidden states; two micro-batches per pipeline through the 1F1B
    schedule. The 2B's embeddings are tied (as published); the 30B-A3B's experts are laid
    over the two DP ranks (ep2: each stage's rank holds 4 of each layer's 8)."""
    experts = "" if run["name"] == "2B" else ",ep2"
    staged = step(ranks, run["tmp"] / "pp2", 5,
                  f"layout=image=dp1,video;language=pp2,dp2{experts}",
                  "train.micro_batch_size=1",
                  f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}", *run["common"])
    if run["name"] == "2B":   # tied: the last stage's output layer holds the embedding's
        tied = staged["grads"]["language"].pop("output_layer.weight")
        embedding = colocated["grads"]["language"]["embedding.word_embeddings.weight"]
        assert (tied - embedding).abs().max() <= 1e-5
    compare(colocated, staged, "image dp1 -> language pp2 dp2")


@pytest.mark.parametrize("language, how, nproc", [
    ("cp2", "data.packing=true", 4), ("cp4", "data.packing=false", 5)])
def test_context_parallel_gives_the_colocated_step(ranks, run, colocated, reference, language,
                                                   how, nproc):
    """The language model's sequence split over two context-parallel ranks (packed: the
    samples' boundaries cross the shard edge; the tower at dp2 fanning in) and over four
    (padded, one sample per micro-batch; the tower at dp1): transformers' loss on the same
    trained tokens, and every gradient the colocated step has, deepstack mergers and the
    tower's inner blocks included. M-RoPE positions come from the whole sequence, the
    deepstack rows are split with it, attention is all-to-all over heads (4 heads, 2 key/value
    groups: cp4 repeats each group twice). The mixture of experts with its global-batch
    balancing loss (each router counting its own rank's real tokens: the padding the cut adds
    to a packed row is none), its experts at cp2 over ep2 (each CP rank 4 of each layer's
    8)."""
    cp = int(language[2:])
    encoders = nproc - cp
    dense = run["name"] == "2B"
    language += "" if dense or cp == 4 else ",ep2"
    layout = f"layout=image=dp{encoders},video;language={language}"
    sharded = step(ranks, run["tmp"] / language, nproc, layout,
                   f"train.micro_batch_size={SAMPLES // 2 if encoders == 2 else 1}", how,
                   # the MoE imports the checkpoint itself: each rank reads its experts' slices
                   *([f"model.init_from={run['tmp'] / 'init' / 'step_0000000'}"] if dense
                     else []), *run["common"])
    _assert_loss(sharded, reference, f"image dp{encoders} -> language {language}, {how}")
    compare(colocated, sharded, f"image dp{encoders} -> language {language}, {how}")


@pytest.fixture(scope="module")
def exported(run, colocated) -> Path:
    """``mimo-export`` of the imported model (the colocated job's step-0 checkpoint)."""
    from mimo_train.hf.export import main as export
    out = run["tmp"] / "export"
    assert export(["--checkpoint", str(run["tmp"] / "init" / "step_0000000"),
                   "--output", str(out)]) == 0
    return out


def test_import_then_export_gives_every_weight_back(run, exported):
    """Every tensor under its published name and shape (the MoE's fused experts as
    published: ``[E, hidden, 2 · ffn]``, not transformers 5's in-memory transpose)."""
    from safetensors.torch import load_file
    published: dict = {}
    ours: dict = {}
    for directory, found in ((run["checkpoint"], published), (exported, ours)):
        for path in sorted(directory.glob("*.safetensors")):
            found.update(load_file(path))
    assert set(ours) == set(published)
    for name, tensor in published.items():       # bf16 published and exported
        assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name
    assert_export_as_published(run["checkpoint"], exported, run["config"].modalities)
    config = json.loads((exported / "config.json").read_text())
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1, 2]
    assert config["text_config"]["rope_scaling"]["mrope_interleaved"] is True


@pytest.mark.parametrize("kind", ["image", "video"])
def test_transformers_generate_on_the_export_equals_mimo_generate(run, exported, corpus,
                                                                  corpus_videos, kind):
    """transformers' processor (the published chat template, its image or video processor:
    frames sampled over the clip, ``<t seconds>`` before each temporal patch) and greedy
    ``generate`` on the exported model give ``mimo-generate``'s prompt and tokens."""
    assert_generate_matches(run["checkpoint"], run["config"].modalities, exported, corpus,
                            corpus_videos, kind)


@pytest.mark.parametrize("overrides, reason", [
    (["model.encoders.image.projection=linear"], "projection linear .* cannot map them"),
    (["model.projection=linear"], "model.projection is linear, but model.pretrained"),
    (["model.language.recompute=full"], "recompute full"),
])
def test_what_cannot_carry_deepstack_rows_is_refused(run, overrides, reason):
    """At start-up (``plan.resolve``, the trainer's first step), before anything is built."""
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import resolve
    with pytest.raises(TrainConfigError, match=reason):
        resolve(TrainConfig.load(None, [*run["common"], f"layout={LAYOUT}", *overrides]))


def test_the_layout_advisor_proposes_only_what_carries_deepstack_rows(run):
    """``mimo-inspect plan`` on Qwen3-VL: no full recompute (refused at start-up); other
    models keep it."""
    from mimo_data.inspect.advice import AdvisorRequest
    from mimo_data.loading.layout import Layout
    from mimo_train.planning.advisor import read_model, settings_of
    request = AdvisorRequest(str(run["checkpoint"]), str(run["preprocess"]), 8,
                             distributed_optimizer="no")
    model = read_model(str(run["checkpoint"]), str(run["preprocess"]), run["config"],
                       {"image": "image", "video": "image"})
    staged = Layout.parse("language=tp2,pp2;image=dp4,video")
    assert model.facts is not None and model.facts.deepstack
    tried = settings_of(model, staged, request)
    assert tried and not any(s.recompute == "full" for s in tried)
    assert any(s.sequence_parallel for s in tried)
    plain = dataclasses.replace(model, facts=dataclasses.replace(model.facts, deepstack=False))
    assert any(s.recompute == "full" for s in settings_of(plain, staged, request))


@pytest.mark.parametrize("layout, moe, dense", [
    ("image=dp2,video;language=tp2", "only with sequence parallelism", None),
    ("image=dp2,video;language=dp2,ep2", None, "expert parallelism, but its layers are dense"),
])
def test_what_the_experts_cannot_take_is_refused(run, layout, moe, dense):
    """Each checkpoint's start-up takes a layout or refuses it with the reason: the MoE
    trains under TP only with sequence parallelism, the dense model has no experts to lay
    over ep ranks."""
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import resolve
    cfg = TrainConfig.load(None, [*run["common"], f"layout={layout}"])
    reason = dense if run["name"] == "2B" else moe
    if reason is None:
        resolve(cfg)
        return
    with pytest.raises(TrainConfigError, match=reason):
        resolve(cfg)


def test_a_qwen3_moe_language_model_alone_is_refused_with_the_reason(tmp_path):
    """Its checkpoints store each expert apart (transformers fuses them on load), which mimo
    does not map: refused, not read as missing tensors."""
    from transformers import AutoConfig

    from mimo_train.errors import TrainConfigError
    from mimo_train.families.registry import language_arch
    AutoConfig.for_model("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(TrainConfigError, match="Qwen3-MoE language model alone.*apart"):
        language_arch(str(tmp_path))


# ------------------------------------------------------- the experts' checkpoints across ep

def _starved(source: Path, out: Path) -> Path:
    """A copy of the MoE checkpoint whose routers never pick experts 4 to 7: their router rows
    zero, rows 1 and 3 rows 0 and 2 negated, and rows 0 to 3 scaled by 1000, so that one of
    each pair has a logit far above experts 4 to 7's (0, and after the balancing loss's
    updates still near it), for every token."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(source, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, weight in tensors.items():
            if name.startswith("model.language_model.") and name.endswith(".mlp.gate.weight"):
                weight[1], weight[3] = -weight[0], -weight[2]
                weight[:4] *= 1000
                weight[4:] = 0
        save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def moe_training(ranks, shards, tmp_path_factory) -> dict:
    """Three steps of the 30B-A3B at lr 1e-3 (Adam), colocated on two ranks under language
    dp2 with its experts over ep2 (each rank 4 of each layer's 8), the distributed optimizer
    and the load-balancing loss, checkpointed after each step: its records, its checkpoints
    and the overrides. Its routers never pick experts 4 to 7 (``_starved``): the second
    expert-parallel rank receives no token in any micro-batch."""
    tmp = tmp_path_factory.mktemp("qwen3-vl-moe-ep")
    starved = _starved(CHECKPOINTS["30B-A3B"], tmp / "starved")
    common = [*run_setup(starved, shards, tmp, SAMPLES, "model.freeze=[]",
                         f"model.language.moe_aux_loss={BALANCE}")["common"],
              "train.steps=3", "optimizer.lr=1e-3", "optimizer.min_lr=1e-3",
              "optimizer.distributed=true", "train.micro_batch_size=1", "train.log_interval=1"]
    records = train(ranks, tmp, "ep2", "qwen3_vl_finetune.yaml", *common,
                    "layout=language=dp2,ep2;image=dp2,off0,video",
                    f"checkpoint.dir={tmp / 'ep2-ckpt'}", "checkpoint.interval=1", nproc=2)
    return dict(tmp=tmp, common=common, records=records, checkpoint=starved)


@pytest.mark.parametrize("layout, nproc", [("language=dp2;image=dp2,off0,video", 2),
                                           ("image=dp1,video;language=dp4,ep4", 5)])
def test_a_checkpoint_saved_at_ep2_resumes_at_another_ep(ranks, moe_training, layout, nproc):
    """The ep2 run's step-1 checkpoint resumed with every rank holding all 8 experts (ep1,
    colocated) or two of them on each of four language ranks (ep4, the tower on a rank of its
    own: its distributed optimizer saves beside the experts' at the end): steps 2 and 3 give
    the ep2 run's samples, losses, load-balancing losses and grad norms (the experts' weights
    and Adam moments moved to the ranks that now hold them). The ranks whose experts no token
    reaches (ep2's second, ep4's last two) take part in every all-to-all with nothing: experts
    4 to 7 leave the run as they came, experts 0 to 3 trained."""
    tmp = moe_training["tmp"]
    root = copy_checkpoint(tmp / "ep2-ckpt" / "step_0000001", tmp / f"resume-{nproc}")
    resumed = train(ranks, tmp, f"resumed-{nproc}", "qwen3_vl_finetune.yaml",
                    *moe_training["common"], f"checkpoint.dir={root}",
                    f"layout={layout}", nproc=nproc)
    # the grad norm to 5e-4: after two Adam updates at lr 1e-3 the layouts' summation orders
    # (experts on one rank or over two) show in it most, Adam scaling the routers' small,
    # cancelling gradients to full steps (1.4e-4 apart at step 3 under ep1 once the towers
    # took a micro-batch's images and clips in one call, the losses 2.2e-7 apart); a misplaced
    # expert or moment moves the loss and the balancing loss far past their bounds
    assert_continues(resumed, moe_training["records"], [2, 3], loss=1e-5, grad_norm_rel=5e-4)
    balances = {r["step"]: r["moe_aux_loss"] for r in moe_training["records"] if "loss" in r}
    for record in (r for r in resumed if "loss" in r):      # the records carry it
        assert record["moe_aux_loss"] == pytest.approx(balances[record["step"]], rel=1e-6)
    if nproc == 5:
        # both runs' step-3 checkpoints exported: the fused experts (published layout) and
        # every other weight alike, whichever ranks held which experts (to 1e-5: Adam turns
        # the grads' fp32 differences into ~2e-6 on a little-used expert; another expert's
        # weights would differ by ~0.1)
        from safetensors.torch import load_file

        from mimo_train.hf.export import main as export
        weights = []
        for name, checkpoint in (("ep2", tmp / "ep2-ckpt"), ("ep4", root)):
            assert export(["--checkpoint", str(checkpoint / "step_0000003"), "--dtype",
                           "float32", "--output", str(tmp / f"export-{name}")]) == 0
            weights.append({k: v for path in sorted((tmp / f"export-{name}").glob(
                "*.safetensors")) for k, v in load_file(path).items()})
        assert set(weights[0]) == set(weights[1])
        experts = [k for k in weights[0] if k.endswith("mlp.experts.gate_up_proj")]
        assert len(experts) == 4 and weights[0][experts[0]].shape == (8, 64, 48)
        published = {k: v for path in sorted(moe_training["checkpoint"].glob("*.safetensors"))
                     for k, v in load_file(path).items()}
        for key in experts:
            start, trained = published[key].float(), weights[0][key]
            assert torch.equal(trained[4:], start[4:]), key          # no token, no update
            assert (trained[:4] - start[:4]).abs().amax(dim=(1, 2)).min() > 1e-4, key
        # the routers to 5e-5: Adam scales each update by its own gradient's size, and a
        # router's gradients are small sums that cancel, so the layouts' summation order shows
        # most there (1.5e-5 under torch's fused AdamW, 7.6e-6 under its default; an ep2
        # resume of the same run gives every weight bit for bit)
        for key, tensor in weights[0].items():
            torch.testing.assert_close(weights[1][key], tensor, rtol=0, msg=key,
                                       atol=5e-5 if key.endswith("mlp.gate.weight") else 1e-5)

