"""``model.language.pretrained``: a transformers Llama / Qwen2 / Qwen3 checkpoint as the
language model (mimo_train/families/causal_lm/).

- the name mapping round-trips (transformers → megatron TP/PP parts → transformers);
- config.json gives the dims, YAML dims that differ are errors naming both values, and what
  megatron-core cannot reproduce is refused;
- logits equal transformers' (fp32, 1e-4) on real text under tp1, tp2 and pp2 for the real
  SmolLM2-135M-Instruct and tiny Llama (untied, GQA, llama3 rope), Qwen2 (qkv bias, tied) and
  Qwen3 (qk-norm) checkpoints: one job of two ranks runs every layout and model;
- with ``model.language.mrope_section`` and M-RoPE position ids, tiny-qwen2's logits equal
  transformers' Qwen2-VL text model holding its weights, padded or packed, local or sdpa;
- (a training run starts from the converted weights, SmolLM2's first loss far below a random
  model's: tests/test_smollm2_export.py, whose run serves that check too);
- tied embeddings stay tied under pipeline stages: tiny-qwen2's gradients under language pp2
  equal one colocated process's, the last stage's output layer getting the embedding's, also
  with the loss in chunks there (``model.language.loss_chunk_tokens``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO, model_dir, preprocess_config_file
from mimo_data.preprocess.config import PreprocessConfig
from support.runs import step

FAMILIES = ["smollm2-135m-instruct", "tiny-llama", "tiny-qwen2", "tiny-qwen3"]
TOLERANCE = 1e-4


# ------------------------------------------------------------------------------ mapping

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_mapping_round_trips_over_tp_and_pp(name):
    from safetensors.torch import load_file

    from mimo_train.families.causal_lm import to_hf, to_megatron
    from mimo_train.families.registry import language_arch

    path = str(model_dir(name))
    arch = language_arch(path)
    hf = load_file(os.path.join(path, "model.safetensors"))
    vocab = arch.vocab_size + 128
    parts = []
    for tp_rank in range(2):                 # tp2 x pp2: one layer per stage
        merged: dict = {}
        for stage, layers in enumerate(([0], [1])):
            state = to_megatron(hf.__getitem__, arch, tp_rank=tp_rank, tp_size=2,
                                layers=layers, first_stage=stage == 0, last_stage=stage == 1,
                                vocab_size=vocab, has=hf.__contains__)
            merged.update({k.replace("decoder.layers.0.", f"decoder.layers.{layers[0]}."): v
                           for k, v in state.items()})
        parts.append(merged)
    back = to_hf(parts, arch)
    assert set(back) == set(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key
    # megatron's per-group [q..., k, v] rows: TP rank 0 holds the first query group whole
    d, per_group = arch.kv_channels, arch.num_attention_heads // arch.num_query_groups
    qkv = parts[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    attn = "model.layers.0.self_attn."
    assert torch.equal(qkv[:per_group * d], hf[attn + "q_proj.weight"][:per_group * d])
    assert torch.equal(qkv[per_group * d:(per_group + 1) * d], hf[attn + "k_proj.weight"][:d])


def test_rows_past_the_vocabulary_start_at_the_mean():
    from safetensors.torch import load_file

    from mimo_train.families.causal_lm import to_megatron
    from mimo_train.families.registry import language_arch

    path = str(model_dir("tiny-llama"))
    arch = language_arch(path)
    hf = load_file(os.path.join(path, "model.safetensors"))
    state = to_megatron(hf.__getitem__, arch, tp_rank=0, tp_size=1, layers=[],
                        first_stage=True, last_stage=True, vocab_size=arch.vocab_size + 3,
                        has=hf.__contains__)
    for key, source in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                        ("output_layer.weight", "lm_head.weight")):
        rows = state[key]
        assert torch.equal(rows[:arch.vocab_size], hf[source])
        assert torch.allclose(rows[arch.vocab_size:], hf[source].mean(0).expand(3, -1))


# ------------------------------------------------------------------------------- config

# a text-only preprocessing config: what the plan reads of it here is that it writes no media
TEXT_ONLY = PreprocessConfig(tokenizer="unused", modalities={})


def _load(*overrides):
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    return resolve(TrainConfig.load(None, ["data.datasets=[x]", *overrides]), TEXT_ONLY)


def test_dims_come_from_the_checkpoint():
    plan = _load(f"model.language.pretrained={model_dir('smollm2-135m-instruct')}",
                 "model.language.num_layers=30")
    lm = plan.language
    assert (lm.num_layers, lm.hidden_size, lm.num_attention_heads, lm.ffn_hidden_size) == \
        (30, 576, 9, 1536)
    from mimo_train.families.registry import language_arch
    arch = language_arch(lm.pretrained)
    assert (arch.num_query_groups, arch.kv_channels, arch.tied, arch.rotary_base) == \
        (3, 64, True, 100000.0)


def test_a_yaml_dim_that_differs_names_both_values():
    from mimo_train.errors import TrainConfigError
    with pytest.raises(TrainConfigError, match=r"model.language.num_layers is 4, but model."
                       r"language.pretrained .*tiny-qwen3 has num_layers 2"):
        _load(f"model.language.pretrained={model_dir('tiny-qwen3')}",
              "model.language.num_layers=4")


def test_a_relative_path_in_the_yaml_is_taken_from_its_folder(tmp_path):
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    target = model_dir("tiny-llama")
    (tmp_path / "train.yaml").write_text(
        "data: {datasets: [x]}\n"
        f"model: {{language: {{pretrained: {os.path.relpath(target, tmp_path)}}}}}\n")
    plan = resolve(TrainConfig.load(str(tmp_path / "train.yaml")), TEXT_ONLY)
    assert plan.config.model.language.pretrained == plan.language.pretrained == str(target)
    assert plan.language.num_layers == 2 and plan.language.hidden_size == 64


def test_a_peft_adapter_folder_given_as_the_model_names_its_base(tmp_path):
    """PEFT's adapters saved alone (``save_pretrained`` of a PEFT model: adapter_config.json
    and the adapters' weights, no config.json) given as the model: one refusal naming the
    folder, its base and what to do, not transformers' "Should have a model_type key"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mimo_train.errors import TrainConfigError
    base = str(model_dir("tiny-llama"))
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                          LoraConfig(r=2, target_modules=["q_proj"]))
    peft.save_pretrained(tmp_path / "adapters")
    with pytest.raises(TrainConfigError) as caught:
        _load(f"model.language.pretrained={tmp_path / 'adapters'}")
    message = str(caught.value)
    assert message.startswith(f"model.language.pretrained: {tmp_path / 'adapters'} holds PEFT "
                              "adapters alone (adapter_config.json, no config.json), not a "
                              f"model: give their base ({base}) as the model"), message
    assert "merge_and_unload" in message and "model_type" not in message


def test_a_mimo_checkpoint_given_as_the_model_says_init_from(tmp_path):
    """A mimo-train checkpoint (a checkpoint.dir with its ``latest``, or a step's folder)
    given as the model: named as such, with the model it trained and model.init_from, not
    transformers' "Should have a model_type key"."""
    import json

    from mimo_train.errors import TrainConfigError
    base = str(model_dir("tiny-llama"))
    step = tmp_path / "checkpoints" / "step_0000002"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"config": {"model": {
        "pretrained": None, "language": {"pretrained": base}}}}))
    (tmp_path / "checkpoints" / "latest").write_text("step_0000002\n")
    for given in (tmp_path / "checkpoints", step):
        with pytest.raises(TrainConfigError) as caught:
            _load(f"model.language.pretrained={given}")
        assert str(caught.value) == (
            f"model.language.pretrained: {given} is a mimo-train checkpoint, not a "
            "transformers model: to train on from its weights, give it as model.init_from and "
            f"keep model.language.pretrained ({base}, the model it trained); for a "
            f"transformers model of it: mimo-export --checkpoint {given} --output OUT"), \
            caught.value


def test_a_tied_checkpoint_storing_another_output_layer_is_refused(tmp_path):
    """A tied checkpoint (``tie_word_embeddings: true``) whose file also stores an
    ``lm_head.weight`` other than the embedding: transformers un-ties them (its model's output
    layer is the stored one), so a tied mimo model would train another model: refused naming
    the tensor and what to do. The same file storing the embedding as its head loads tied."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from mimo_train.errors import TrainConfigError
    for name, head in (("other", "noise"), ("same", "embedding")):
        folder = tmp_path / name
        shutil.copytree(model_dir("tiny-qwen2"), folder)
        weights = load_file(folder / "model.safetensors")
        embedding = weights["model.embed_tokens.weight"]
        assert "lm_head.weight" not in weights            # saved tied, as transformers saves
        weights["lm_head.weight"] = (embedding.clone() if head == "embedding" else
                                     torch.randn_like(embedding))
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        reference = AutoModelForCausalLM.from_pretrained(folder)
        assert torch.equal(reference.lm_head.weight, weights["lm_head.weight"])
        assert (reference.lm_head.weight is reference.model.embed_tokens.weight) == \
            (head == "embedding")
    from mimo_train.families.registry import language_arch
    with pytest.raises(TrainConfigError) as caught:        # read as the model's build reads it
        language_arch(str(tmp_path / "other"))
    assert str(caught.value).startswith(
        f"model.language.pretrained: {tmp_path / 'other'}'s config.json ties the output layer "
        "to the embedding (tie_word_embeddings: true), but its weights also hold a "
        "lm_head.weight other than model.embed_tokens.weight"), caught.value
    assert language_arch(str(tmp_path / "same")).tied


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-vl"])
def test_a_tied_checkpoint_storing_only_its_output_layer_loads_as_transformers_ties_it(
        tmp_path, name):
    """A tied checkpoint whose file stores ``lm_head.weight`` and no embedding: transformers
    ties the embedding to the stored output layer (it swaps the pair), and so does mimo: its
    megatron weights are those of the folder transformers saves from it (which stores the
    embedding), every tensor equal, the embedding and output layer the stored head. A causal
    LM's, and a VLM's (its published layout's names; the fixture made tied)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from mimo_train.families.base import CheckpointWeights
    from mimo_train.families.causal_lm import to_megatron
    from mimo_train.families.registry import language_arch
    folder = tmp_path / "head-only"
    shutil.copytree(model_dir(name), folder)
    config = json.loads((folder / "config.json").read_text())
    for section in (config, config.get("text_config", {})):
        section["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    head = weights.pop("model.embed_tokens.weight") + 1.0      # not the fixture's embedding
    weights["lm_head.weight"] = head
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    auto = AutoModelForImageTextToText if name.endswith("-vl") else AutoModelForCausalLM
    reference = auto.from_pretrained(folder)
    assert reference.lm_head.weight is reference.get_input_embeddings().weight
    assert torch.equal(reference.get_input_embeddings().weight, head)
    reference.save_pretrained(tmp_path / "saved")             # the embedding stored
    states = []
    for path in (folder, tmp_path / "saved"):
        arch = language_arch(str(path))
        assert arch.tied
        held = CheckpointWeights(str(path))
        states.append(to_megatron(held, arch, tp_rank=0, tp_size=1,
                                  layers=range(arch.num_layers), first_stage=True,
                                  last_stage=True, vocab_size=arch.vocab_size,
                                  has=held.__contains__))
    ours, theirs = states
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key].float(), value.float()), key
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(ours[key].float(), head.float()), key


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
     "rope scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                          "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}},
     "megatron-core fixes"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_what_megatron_cannot_reproduce_is_refused(tmp_path, change, message):
    from mimo_train.errors import TrainConfigError
    config = json.loads((model_dir("tiny-llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(TrainConfigError, match=message):
        _load(f"model.language.pretrained={tmp_path}")


def test_a_mixture_whose_experts_or_top_k_megatron_would_change_is_refused(tmp_path):
    """The published Qwen3.5-MoE's shape: fused experts holding more or fewer experts than
    config.json's num_experts are refused naming the tensor (transformers refuses the size
    mismatch; the first num_experts were trained silently), and top-1 routing (transformers'
    renormalized weight 1, which megatron-core's router refuses) in the config's terms, not
    megatron-core's command-line flag."""
    from mimo_train.errors import TrainConfigError
    from mimo_train.families.base import CheckpointWeights, Tensors
    from mimo_train.families.causal_lm import to_megatron
    from mimo_train.families.registry import language_arch
    folder = model_dir("published/Qwen--Qwen3.5-35B-A3B")
    arch, held = language_arch(str(folder)), CheckpointWeights(str(folder))
    for fused, count in ((f"{arch.prefix}layers.1.mlp.experts.{name}", arch.experts + change)
                         for name in ("gate_up_proj", "down_proj") for change in (2, -2)):
        assert held.shape(fused)[0] == arch.experts

        def read(name: str, count: int = count, fused: str = fused) -> torch.Tensor:
            whole = held(name)
            return whole.repeat(2, 1, 1)[:count] if name == fused else whole
        for experts in (None, range(arch.experts // 2)):        # all of them; ep2's first
            with pytest.raises(TrainConfigError) as caught:
                to_megatron(Tensors(read), arch, tp_rank=0, tp_size=1, layers=[1],
                            first_stage=True, last_stage=True, vocab_size=arch.vocab_size,
                            experts=experts)
            assert str(caught.value) == (
                f"the checkpoint's {fused} holds {count} experts, its config.json names "
                f"{arch.experts} (num_experts): not the architecture its config.json "
                "describes"), caught.value
    for file in folder.glob("model.safetensors*"):
        (tmp_path / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_experts_per_tok"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TrainConfigError, match=r"num_experts_per_tok 1 \(megatron-core's "
                       "router takes top-1") as refused:
        language_arch(str(tmp_path))
    assert "pre-softmax" not in str(refused.value)
    # norm_topk_prob false: transformers' Qwen3.5-MoE router renormalizes anyway (its config
    # drops the key), so the checkpoint is the one it says with true: taken
    config["text_config"].update(num_experts_per_tok=2, norm_topk_prob=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert language_arch(str(tmp_path)).experts_per_token == 2


# ------------------------------------------------------------------------------- parity

LAYOUTS = ["language=dp2", "language=tp2", "language=pp2"]     # dp2: tp1 on each rank
MROPE_CASES = [f"mrope/{backend}/{rows}" for backend in ("local", "sdpa")
               for rows in ("padded", "packed")]


@pytest.fixture(scope="module")
def parity(ranks, tmp_path_factory) -> dict:
    """One job of two forked ranks: every layout, every family, and the M-RoPE cases."""
    out = tmp_path_factory.mktemp("parity")
    ranks.run(2, [REPO / "tests" / "jobs" / "hf_language_parity.py", out, "+".join(LAYOUTS),
                  "--mrope", model_dir("tiny-qwen2"), *[model_dir(m) for m in FAMILIES]],
              out / "logs").check()
    results = json.loads((out / "result.json").read_text())
    print(json.dumps(results, indent=1))
    assert set(results) == set(LAYOUTS)
    return results


def test_logits_match_transformers_under_tp1_tp2_pp2(parity):
    for layout, cases in parity.items():
        models = {name: value for name, value in cases.items() if name not in MROPE_CASES}
        assert set(models) == set(FAMILIES), layout
        for name, difference in models.items():
            if (layout, name) == ("language=tp2", "smollm2-135m-instruct"):
                # 9 heads in 3 query groups: megatron-core cannot split them over 2 ranks
                assert "9 attention heads, which do not split into language tp2" in difference
                continue
            assert isinstance(difference, float) and 0 <= difference <= TOLERANCE, \
                (layout, name, difference)


def test_mrope_logits_match_qwen2_vl_text_model_padded_or_packed(parity):
    """megatron-core's M-RoPE fed mimo's position ids (a grid amid the text) gives the logits
    of transformers' Qwen2-VL text model, under tp1/tp2/pp2, local and sdpa attention,
    padded rows or the rows packed into one (every sample's own angles)."""
    for layout, cases in parity.items():
        for case in MROPE_CASES:
            assert 0 <= cases[case] <= TOLERANCE, (layout, case, cases[case])


# ------------------------------------------------------------------------------ training

def _step(ranks, out: Path, nproc: int, layout: str, micro_batch: int,
          common: list[str]) -> dict:
    """One step of tests/jobs/train_parity.py: loss and the language gradients, all ranks."""
    result = step(ranks, out, nproc, f"layout={layout}", f"train.micro_batch_size={micro_batch}",
                  *common)
    return {"loss": result["loss_sum"] / result["tokens"], **result["grads"].get("language", {})}


def test_tied_embeddings_stay_tied_under_pipeline_stages(ranks, loader_corpus, tmp_path):
    preprocess = preprocess_config_file(tmp_path / "preprocess.yaml")
    common = [f"data.datasets=[{loader_corpus}]", f"data.preprocess={preprocess}",
              f"model.language.pretrained={model_dir('tiny-qwen2')}", "train.steps=1",
              "optimizer.warmup_steps=0", "train.global_batch_size=4", "train.seed=3"]
    whole = _step(ranks, tmp_path / "pp1", 1, "language=dp1;image=dp1,off0;audio=dp1,off0", 4,
                  common)
    staged = _step(ranks, tmp_path / "pp2", 4, "image=dp1;audio=dp1;language=pp2", 2,
                   [*common, "model.language.loss_chunk_tokens=97"])
    assert abs(whole.pop("loss") - staged.pop("loss")) < 1e-5
    embedding = "embedding.word_embeddings.weight"
    assert "output_layer.weight" not in whole          # one matrix in a single stage
    assert torch.allclose(staged.pop("output_layer.weight"), whole[embedding], atol=1e-6)
    assert set(staged) == set(whole)
    for key, grad in whole.items():
        assert torch.allclose(staged[key], grad, atol=1e-6), key
