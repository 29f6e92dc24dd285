"""LoRA (``model.lora``) on Qwen3.5's gated delta-net layers and on its mixture of experts: the
published ``Qwen/Qwen3.5-4B`` and ``Qwen/Qwen3.5-35B-A3B`` files (``assets/models/published``,
dims shrunk: three gated delta-net layers, then one gated full attention; the MoE's layers 8
experts, 2 per token, and a shared expert), adapters on the delta-nets' fused ``in_proj``
(column-parallel, its rows the sections q, k, v, z, beta, alpha: each TP rank holds its rows of
each, and so does B) and ``out_proj`` (row-parallel), the gated attention's ``linear_qkv``, and
SwiGLU's ``linear_fc1`` (the 4B's MLP; the MoE's shared expert and every routed expert, with
``linear_fc2`` too), B drawn at random (``init_lora_weights: false``) so that the adapters
change the model; the tower frozen; two conversations of tests/test_qwen3_5.py's (two images
over two turns, text only).

- ``mimo-export --adapters`` of the run's step-0 checkpoint names the adapters as transformers'
  layers (``in_proj``'s as four, ``linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``, each with the same A and its section's rows of B; the shared expert's as
  ``shared_expert.gate_proj`` ...; the routed experts' as PEFT's ``target_parameters``
  ``mlp.experts.gate_up_proj`` and ``down_proj``, one adapter per expert); transformers' model
  with them loaded through ``peft.PeftModel.from_pretrained`` has the run's step-1 loss at lr 0
  (float64, within 1e-5), as has the merged export; without them the loss differs;
- the 4B at language tp2 (the tower on its own rank), the MoE at language tp2 with sequence
  parallelism (its experts split over etp2 as the layer's TP), started from that checkpoint
  (saved at TP 1, ``in_proj``'s B saved by sections as megatron-core saves ``in_proj.weight``)
  with B drawn as zero of its own: the checkpoint's adapters, resharded, give the colocated
  step's loss (1e-5) and every adapter gradient (``GRADIENT_TOLERANCE`` of its largest entry);
- a run from the published weights, the 4B at TP 2, the MoE at dp2 with its experts over ep2
  (each rank four of each layer's eight), draws the colocated run's adapters (B's master weight
  drawn in the TP-1 layout, each rank's rows of each section then put together; a routed
  expert's by its global number), saves the same global tensors, and takes the colocated step
  (the 4B's colocated step recomputes every language layer, ``recompute: full``:
  megatron-core's reentrant checkpoint, whose input there needs no gradient, the tower frozen
  and the embedding fixed, still gives the adapters theirs);
- the delta-net's layers are targets by name; so are a mixture of experts' shared and routed
  experts' (all-linear leaves the routed experts out, as PEFT's), not its router; the routed
  experts' PEFT files on the ``Qwen/Qwen3-VL-30B-A3B-Instruct`` replica (its experts stored
  transposed) merge into each expert's weights as mimo's adapters do (in process).

Three jobs per checkpoint (one rank, two of three ranks): no other file's runs build adapters
(tests/test_qwen3_5.py's run these checkpoints whole, tests/test_lora.py a dense Qwen2-VL);
transformers' losses from the colocated job's micro-batches.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import MODELS
from support.qwen_vlm import build_shards, run_setup, transformers_loss
from support.runs import compare, step

PUBLISHED = MODELS / "published"
SAMPLES = ("multi-turn", "text-only")            # tests/test_qwen3_5.py's conversations
LAYOUT = "language=dp1;image=dp1,off0,video"
# checkpoint -> (its files, the language model's adapters' targets, its transformers layers
# they name, the layouts of the step from the colocated checkpoint and of the drawn one, with
# their overrides)
ATTENTION = ["in_proj", "out_proj", "linear_qkv"]          # and the delta-nets'
DELTA_NET = {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
             "linear_attn.in_proj_a", "linear_attn.out_proj", "self_attn.q_proj",
             "self_attn.k_proj", "self_attn.v_proj"}
TP2 = ("layout=image=dp1,video;language=tp2",)             # the tower on its own rank
CHECKPOINTS = {
    "4B": (PUBLISHED / "Qwen--Qwen3.5-4B", [*ATTENTION, "linear_fc1"],
           DELTA_NET | {"mlp.gate_proj", "mlp.up_proj"}, TP2, TP2),
    "35B-A3B": (PUBLISHED / "Qwen--Qwen3.5-35B-A3B", [*ATTENTION, "linear_fc1", "linear_fc2"],
                DELTA_NET | {"shared_expert.gate_proj", "shared_expert.up_proj",
                             "shared_expert.down_proj"},
                (*TP2, "model.language.sequence_parallel=true"),
                ("layout=image=dp1,video;language=dp2,ep2",)),
}
TOLERANCE = 1e-5                                 # on the mean loss per trained token
# on an adapter's gradient under another layout, relative to its largest entry: fp32 through
# these delta-net layers (tests/test_qwen3_5.py: within 1.8e-5 of float64 at TP 2, the MoE's
# 5e-5); measured here, every adapter's within 1.9e-5 of the colocated one's at TP 2 (the 4B),
# 5.9e-5 at TP 2 with sequence parallelism and 2.4e-6 over ep2 (the MoE), a misplaced
# section's off by its size
GRADIENT_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def setup(request, corpus, corpus_videos, tmp_path_factory) -> dict:
    base, targets, layers, from_checkpoint, drawn = CHECKPOINTS[request.param]
    tmp = tmp_path_factory.mktemp(f"qwen3-5-lora-{request.param}")
    shards = build_shards(tmp, corpus, corpus_videos, SAMPLES)
    lora = ("model.lora={language: {rank: 4, alpha: 8, init_lora_weights: false, "
            f"targets: [{', '.join(targets)}]}}}}")
    run = run_setup(base, shards, tmp, len(SAMPLES), "model.freeze=[image]",
                    "train.micro_batch_size=1", lora)
    return dict(run, config=run["config"].modalities, name=request.param, base=base,
                layers=layers, from_checkpoint=from_checkpoint, drawn=drawn)


@pytest.fixture(scope="module")
def colocated(ranks, setup) -> dict:
    """Step 1 colocated, with its micro-batches; the model (adapters drawn) saved first
    (``init/step_0000000``)."""
    tmp = setup["tmp"]
    return step(ranks, tmp / "colocated", 1, f"layout={LAYOUT}", *setup["common"],
                *(["model.language.recompute=full"] if setup["name"] == "4B" else []),
                save_batches=True, save_init=tmp / "init")


def _init(setup) -> Path:
    return setup["tmp"] / "init" / "step_0000000"


def _loss(model, colocated: dict, setup: dict) -> tuple[float, int]:
    """transformers' ``model``'s mean loss per trained token on the colocated step's
    micro-batches, float64, and that count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in colocated["ranks"][0]["batches"]:
            loss, tokens, _ = transformers_loss(model, batch, setup["config"], torch.float64)
            total, count = total + float(loss) * tokens, count + tokens
    return total / count, count


def test_peft_adapters_and_merged_export_give_the_lora_runs_loss(setup, colocated):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mimo_train.hf.export import main as export
    tmp = setup["tmp"]
    adapters, merged = tmp / "adapters", tmp / "merged"
    assert export(["--checkpoint", str(_init(setup)), "--output", str(adapters),
                   "--adapters"]) == 0
    assert export(["--checkpoint", str(_init(setup)), "--output", str(merged),
                   "--dtype", "float32"]) == 0                 # the trained dtype: to 1e-5
    ours = colocated["loss_sum"] / colocated["tokens"]

    config = json.loads((adapters / "adapter_config.json").read_text())
    layers = {name.rsplit(".", 2)[-2:][0] + "." + name.rsplit(".", 1)[-1]
              for name in config["target_modules"]}
    assert layers == setup["layers"], layers
    # one A for the four layers of a fused in_proj
    tensors = load_file(adapters / "adapter_model.safetensors")
    first = next(n for n in config["target_modules"] if n.endswith("linear_attn.in_proj_qkv"))
    a = tensors[f"base_model.model.{first}.lora_A.weight"]
    for section in ("z", "b", "a"):
        name = first.replace("in_proj_qkv", f"in_proj_{section}")
        assert torch.equal(tensors[f"base_model.model.{name}.lora_A.weight"], a)
    moe = setup["name"] == "35B-A3B"
    # the routed experts: both fused parameters of each layer, one adapter of rank 4 per expert
    assert config.get("target_parameters", []) == (
        [f"model.language_model.layers.{i}.mlp.experts.{p}" for i in range(4)
         for p in ("down_proj", "gate_up_proj")] if moe else []), config
    if moe:
        assert tensors["base_model.model.model.language_model.layers.0.mlp.experts"
                       ".base_layer.lora_A.weight"].shape == (8 * 4, 64)    # gate_up: in H

    # the grouped experts take no float64
    options = dict(dtype=torch.float64, experts_implementation="eager")
    base = AutoModelForImageTextToText.from_pretrained(setup["base"], **options)
    peft = PeftModel.from_pretrained(base, adapters).eval()
    loss, tokens = _loss(peft, colocated, setup)
    assert tokens == colocated["tokens"] > 0
    assert abs(loss - ours) <= TOLERANCE, ("PEFT", loss, ours)
    with peft.disable_adapter():
        plain, _ = _loss(peft, colocated, setup)
    assert abs(plain - ours) > 100 * TOLERANCE, (plain, ours)       # the adapters matter
    model = AutoModelForImageTextToText.from_pretrained(merged, **options).eval()
    loss, _ = _loss(model, colocated, setup)
    assert abs(loss - ours) <= TOLERANCE, ("merged", loss, ours)


def _assert_colocated(setup: dict, colocated: dict, other: dict, what: str) -> None:
    """``other``'s step has the colocated one's loss (1e-5) and every adapter's gradient
    (``GRADIENT_TOLERANCE`` of its largest entry; a routed expert no token went to, none)."""
    loss, expected = (r["loss_sum"] / r["tokens"] for r in (other, colocated))
    assert abs(loss - expected) <= TOLERANCE, (what, loss, expected)
    compare(colocated, other, what, GRADIENT_TOLERANCE)
    grads = colocated["grads"]["language"]
    assert all(".lora." in name for name in grads)
    for layer in ("in_proj", "out_proj"):
        assert sum(f".self_attention.{layer}.lora." in name for name in grads) == 6, layer
    if setup["name"] == "35B-A3B":      # 4 layers: the shared expert's two, 8 experts' two each
        assert sum(".mlp.shared_experts." in name for name in grads) == 4 * 2 * 2
        assert sum(".mlp.experts.local_experts." in name for name in grads) == 4 * 8 * 2 * 2
    for name, grad in grads.items():
        difference = (other["grads"]["language"][name] - grad).abs().max()
        assert difference <= GRADIENT_TOLERANCE * grad.abs().max(), (what, name,
                                                                     float(difference))


def test_another_layout_from_the_checkpoint_is_the_colocated_step(ranks, setup, colocated):
    """The colocated run's checkpoint (TP 1; ``in_proj``'s B by sections), read at TP 2 (the
    MoE's under sequence parallelism, its experts split over etp2) by a run whose own B is
    zero: the checkpoint's adapters, resharded, are what it runs."""
    from mimo_train.mcore import dist_checkpointing
    saved = dist_checkpointing.load_tensors_metadata(str(_init(setup)))
    b = [key for key in saved if ".in_proj.lora.b.weight" in key]
    assert b and all(key.rsplit(".", 1)[-1] in ("query", "key", "value", "z", "beta", "alpha")
                     for key in b), b
    layout = setup["from_checkpoint"]
    other = step(ranks, setup["tmp"] / "from-checkpoint", 3, *layout, *setup["common"],
                 f"model.init_from={_init(setup)}", "model.lora.language.init_lora_weights=true")
    _assert_colocated(setup, colocated, other, f"{layout} from the colocated checkpoint")


def test_another_layout_draws_the_colocated_adapters(ranks, setup, colocated):
    """A run from the published weights at TP 2 (the MoE: at dp2, its experts over ep2) draws
    every adapter as the colocated run (``in_proj``'s B in its sections' layout on each rank; a
    routed expert's by its global number), saves them as it does (the same global tensors) and
    takes the colocated step."""
    from mimo_train.components.checkpoint import load_weights
    tmp, layout = setup["tmp"], setup["drawn"]
    other = step(ranks, tmp / "drawn", 3, *layout, *setup["common"], save_init=tmp / "drawn-init")
    _assert_colocated(setup, colocated, other, f"{layout}, adapters drawn there")
    drawn, expected = (load_weights(str(path))["language"]
                       for path in (tmp / "drawn-init" / "step_0000000", _init(setup)))
    adapters = [key for key in expected if ".lora." in key]
    assert any(key.endswith("in_proj.lora.b.weight") for key in adapters)
    assert sorted(key for key in drawn if ".lora." in key) == sorted(adapters)
    for key in adapters:
        assert torch.equal(drawn[key], expected[key]), key


def test_in_proj_b_is_drawn_alike_under_any_tp():
    """B's master weight as drawn for TP 2 and split into two blocks of rows: each block is a
    rank's rows of each section of B drawn for TP 1."""
    from mimo_train.model.lora import Sections, _kaiming, _rank_by_rank
    rows = (4, 4, 6, 6, 2, 2)                 # q, k, v, z, beta, alpha on each of two ranks
    sections = Sections(("query", "key", "value", "z", "beta", "alpha"), rows)
    whole = torch.empty(2 * sum(rows), 3)
    torch.manual_seed(0)
    _rank_by_rank(_kaiming, Sections(sections.names, tuple(2 * r for r in rows)), 1)(whole)
    split = torch.empty_like(whole)
    torch.manual_seed(0)
    _rank_by_rank(_kaiming, sections, 2)(split)
    by_section = whole.split([2 * r for r in rows])
    for rank, block in enumerate(split.chunk(2)):
        assert torch.equal(block, torch.cat([s.chunk(2)[rank] for s in by_section]))


def test_delta_net_layers_are_lora_targets():
    """A hybrid decoder's gated delta-net layers (Qwen3.5's: layers 0-2 of 4) are targeted by
    their ``in_proj`` / ``out_proj``, its full-attention layers by ``linear_qkv`` /
    ``linear_proj``; a dense decoder has no ``in_proj`` to adapt: refused, not ignored."""
    from mimo_train.config import LoraConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan.lora_targets import check_language_targets
    from mimo_train.plan import Adapted
    from mimo_train.plan.parts import Part

    def adapted(*targets):
        return [Adapted(Part("language"), LoraConfig(targets=list(targets)))]
    hybrid = frozenset({0, 1, 2})
    check_language_targets(adapted("in_proj", "self_attention.out_proj", "linear_qkv",
                                   "decoder.layers.*.self_attention.in_proj"), 4,
                           linear_layers=hybrid)
    for targets, layers in ((("in_proj_qkv",), hybrid), (("decoder.layers.3.*.in_proj",), hybrid),
                            (("in_proj",), frozenset()), (("linear_qkv", "out_proj"), frozenset())):
        with pytest.raises(TrainConfigError, match="names none of its linear layers") as refused:
            check_language_targets(adapted(*targets), 4, linear_layers=layers)
        listed = str(refused.value).partition("linear layers: ")[2]
        assert ("in_proj'" in listed) == bool(layers)
    # transformers' (PEFT's) names of the delta-net's projections name the fused in_proj
    for name in ("in_proj_qkv", "in_proj_z", "linear_attn.in_proj_b", "in_proj_a"):
        with pytest.raises(TrainConfigError, match="names none of its linear layers") as refused:
            check_language_targets(adapted(name), 4, linear_layers=hybrid)
        assert "is megatron-core's in_proj here" in str(refused.value), refused.value
        assert str(refused.value).endswith("give in_proj)"), refused.value


def test_mixture_of_experts_layers_are_lora_targets():
    """The shared expert's and each routed expert's layers (global expert numbers) are
    targets, the router is refused as one, and all-linear leaves the routed experts out."""
    from mimo_train.config import LoraConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan.lora_targets import check_language_targets, language_linears
    from mimo_train.plan import Adapted
    from mimo_train.plan.parts import Part, reaches_routed_experts, target_matches

    def adapted(*targets):
        return [Adapted(Part("language"), LoraConfig(targets=list(targets)))]
    check_language_targets(adapted("shared_experts.linear_fc1", "*.local_experts.*.linear_fc2"),
                           4, 8, shared_expert=True)
    with pytest.raises(TrainConfigError, match="names none of its linear layers"):
        check_language_targets(adapted("shared_experts.linear_fc1"), 4, 8)   # none here
    # PEFT's names for the layers: the refusal names megatron-core's
    for theirs, ours, fused in (("q_proj", "linear_qkv", ", which holds q, k and v as one "
                                 "layer"), ("o_proj", "linear_proj", ""),
                                ("mlp.up_proj", "linear_fc1", ", which holds gate and up as "
                                 "one layer")):
        with pytest.raises(TrainConfigError) as refused:
            check_language_targets(adapted(theirs), 4)
        assert str(refused.value).endswith(f"(transformers' {theirs} is megatron-core's {ours} "
                                           f"here{fused}: give {ours})"), refused.value
    with pytest.raises(TrainConfigError, match="router .*stays un-adapted"):
        check_language_targets(adapted("router"), 4, 8, shared_expert=True)
    # transformers' name of the router said as one; a shared expert offered only where
    # there is one (Qwen3-VL-MoE has none)
    for shared in (True, False):
        with pytest.raises(TrainConfigError, match="transformers' mlp.gate\\): it stays "
                           "un-adapted") as refused:
            check_language_targets(adapted("gate"), 4, 8, shared_expert=shared)
        assert ("shared_experts.linear_fc1" in str(refused.value)) is shared
        assert "or the routed experts ('*.local_experts.*.linear_fc1', " in str(refused.value)
    # PEFT's name of a fused expert layer (gate_up_proj, what a mixture's adapters export
    # as): pointed at megatron-core's
    with pytest.raises(TrainConfigError, match=r"\(transformers' gate_up_proj is "
                       "megatron-core's linear_fc1 here, which holds gate and up as one "
                       r"layer: give linear_fc1\)$"):
        check_language_targets(adapted("gate_up_proj"), 4, 8)
    # some routed experts only, or (where the layers are stacked alike) some layers' only:
    # refused, as their adapters could not be saved; a hybrid decoder's layers may differ
    for targets, stacked, said in (
            (("*.local_experts.7.*",), True, "adapt 4 of the 32 routed experts' linear_fc1 "
             "(the first decoder.layers.0.mlp.experts.local_experts.7.linear_fc1), not the "
             "linear_fc1 of every routed expert in every decoder layer"),
            # one layer's every expert (stacked layers): said as 8 of the 32, not as one
            (("decoder.layers.1.*.local_experts.*",), True, "adapt 8 of the 32 routed experts' "
             "linear_fc1 (the first decoder.layers.1.mlp.experts.local_experts.0.linear_fc1), "
             "not the linear_fc1 of every routed expert in every decoder layer: megatron-core "
             "saves the experts' weights stacked over the experts and the layers, which their "
             "adapters must fill: target them all ('*.local_experts.*.linear_fc1') or none"),
            (("decoder.layers.3.*.local_experts.7.*",), False, "adapt 1 of the 8 routed "
             "experts' linear_fc1 (the first decoder.layers.3.mlp.experts.local_experts.7."
             "linear_fc1), not the linear_fc1 of every routed expert of its layer")):
        with pytest.raises(TrainConfigError, match=re.escape(said)):
            check_language_targets(adapted(*targets), 4, 8, shared_expert=True,
                                   linear_layers=frozenset() if stacked else
                                   frozenset({0, 1, 2}))
    check_language_targets(adapted("decoder.layers.3.*.local_experts.*"), 4, 8,
                           shared_expert=True, linear_layers=frozenset({0, 1, 2}))
    names = language_linears(4, 8, shared_expert=True)
    assert not any(".mlp.linear_fc" in name for name in names)
    routed = {n for n in names if ".mlp.experts.local_experts." in n}
    assert len(routed) == 4 * 8 * 2
    assert not any(target_matches("all-linear", n) for n in routed)
    assert all(target_matches("all-linear", n) for n in names - routed)
    assert reaches_routed_experts(("linear_fc2",), 4, 8)
    assert not reaches_routed_experts(("all-linear", "shared_experts.linear_fc2"), 4, 8)


def test_routed_experts_adapters_are_pefts_on_qwen3_vl_moe(tmp_path):
    """The routed experts' adapters as ``mimo-export --adapters`` writes them, on the
    published ``Qwen/Qwen3-VL-30B-A3B-Instruct``'s replica (its fused experts stored
    transposed, as published): PEFT's merge gives each expert's ``gate_up_proj`` and
    ``down_proj`` its weight plus alpha / rank * B A of mimo's adapters (in process, no job;
    one expert of a layer without an adapter stays as it was)."""
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mimo_train.config import TrainConfig
    from mimo_train.errors import ExportError
    from mimo_train.families.registry import language_arch, preprocessing_for
    from mimo_train.hf.adapters import write_adapters
    from mimo_train.plan import resolve
    base = PUBLISHED / "Qwen--Qwen3-VL-30B-A3B-Instruct"          # 4 layers of 8 experts
    preprocess = tmp_path / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump(preprocessing_for(str(base))))
    settings = [f"data.datasets=[{tmp_path}]", f"data.preprocess={preprocess}",
                f"model.pretrained={base}", f"layout={LAYOUT}",
                "model.lora={language: {rank: 2, alpha: 6, targets: ['*.local_experts.*']}}"]
    with pytest.raises(ExportError, match=r"the run also trained \['image.encoder'\] outside "
                       "its adapters"):         # its tower trained in full: not adapters alone
        write_adapters(str(tmp_path / "x"), resolve(TrainConfig.load(None, settings)), {},
                       language_arch(str(base)), "image", "the run")
    assert not (tmp_path / "x").exists()
    plan = resolve(TrainConfig.load(None, [*settings, "model.freeze=[image]"]))
    torch.manual_seed(0)
    state, hidden, ffn = {}, 64, 24
    for layer, expert in [(i, e) for i in range(4) for e in range(8) if (i, e) != (1, 5)]:
        for fc, (rows, columns) in (("linear_fc1", (2 * ffn, hidden)),
                                    ("linear_fc2", (hidden, ffn))):
            key = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.lora."
            state[key + "a.weight"] = torch.randn(2, columns)
            state[key + "b.weight"] = torch.randn(rows, 2)
    out = tmp_path / "adapters"
    config = write_adapters(str(out), plan, {"language": state, "image": {}},
                            language_arch(str(base)), "image", "the run")
    assert config["target_modules"] == [] and len(config["target_parameters"]) == 8
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float64)
    fused = {name: p.detach().clone() for name, p in model.named_parameters()
             if ".mlp.experts." in name}
    merged = dict(PeftModel.from_pretrained(model, out).merge_and_unload().named_parameters())
    for layer, expert in [(i, e) for i in range(4) for e in range(8)]:
        for fc, param in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            name = f"model.language_model.layers.{layer}.mlp.experts.{param}"
            key = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.lora."
            delta = 3 * state[key + "b.weight"].double() @ state[key + "a.weight"].double() \
                if key + "a.weight" in state else 0
            assert torch.allclose(merged[name][expert], fused[name][expert] + delta,
                                  rtol=0, atol=1e-12), (name, expert)
