"""Build scaled-down replicas of published vision-language repositories offline, in the files
and formats those repositories publish (``tools/published/`` holds the published small files
and where each came from), and print a line per replica written.

- ``config.json``: the published file, key for key and in its structure (Qwen2-VL and
  Qwen2.5-VL flat as transformers 4.41 wrote them; Qwen3-VL and llava-hf nested, llava-hf
  with the keys the text config leaves to transformers' defaults left out), only the dims
  replaced by tiny ones (``SHRINK``; Qwen3.5's ``layer_types`` cut to the four layers).
  Token ids, ``rope_scaling`` / ``rope_parameters`` (but Qwen3-VL's and Qwen3.5's
  ``mrope_section``, scaled with the head), window sizes, ``fullatt_block_indexes``,
  ``tokens_per_second``, ``vision_feature_layer``, ``vision_feature_select_strategy``, image
  sizes, ``num_position_embeddings`` and vocabulary sizes stay the published values.
- the processor, tokenizer, template and generation files as published (copied; Qwen3.5's
  repositories have no generation_config.json).
- ``tokenizer.json``: the published special tokens at their published ids, around a byte-level
  BPE made from SmolLM2's (the only tokenizer installed offline): its merges truncated where
  the published base vocabulary is smaller (LLaVA-1.5's 32000), unreachable filler entries
  where it is larger (Qwen's 151643).
- weights under the published names (``visual.`` / ``model.`` / ``lm_head.`` for Qwen2-VL
  and Qwen2.5-VL; ``model.visual.`` / ``model.language_model.`` / ``lm_head.`` for Qwen3-VL,
  Qwen3-VL-MoE, whose fused experts are written in the published layout, transposed from
  transformers 5's, and Qwen3.5 / Qwen3.5-MoE, whose gated delta-net ``A_log`` and norm are
  float32 as published and whose multi-token prediction weights ``mtp.*``, which
  transformers drops on load, are written from a seeded init, experts one per tensor as
  published);
  ``vision_tower.`` / ``multi_modal_projector.`` / ``language_model.model.`` /
  ``language_model.lm_head.`` for llava-hf), no output layer where the embeddings are tied,
  in the published dtype, sharded with an index where the published repository is sharded.
  The build loads each replica back with transformers and checks that every weight arrives.

    python tools/make_published.py --out assets/models/published \
        --tokenizer assets/tokenizer/smollm2
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

# the tiny checkpoints' seeded init and staging (a sibling script, as tools/ runs them)
from make_models import SEED, publish, randomize, staging_folder

PUBLISHED = Path(__file__).resolve().parent / "published"
_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
_QWEN2_VL_VISION = {"vision_config.depth": 2, "vision_config.embed_dim": 32,
                    "vision_config.num_heads": 2, "vision_config.mlp_ratio": 2,
                    "vision_config.hidden_size": 64}
_QWEN2_5_VL_VISION = {"vision_config.depth": 4, "vision_config.hidden_size": 32,
                      "vision_config.intermediate_size": 48, "vision_config.num_heads": 2,
                      "vision_config.out_hidden_size": 64,
                      # every fourth block attends the whole image, as every eighth of 32 does
                      "vision_config.fullatt_block_indexes": [1, 3]}
# head_dim 16: 8 rotary pairs, split over time / height / width as 16 / 24 / 24 of 64 are
_MROPE = {"rope_scaling.mrope_section": [2, 3, 3], "max_window_layers": 2}
# Qwen3-VL (nested text_config / vision_config): four text layers, so that with two pipeline
# stages the third DeepStack layer lands on the second; head_dim 16 gives 8 rotary pairs, split
# over time / height / width as 24 / 20 / 20 of 64 are (3 / 2.5 / 2.5: the nearest whole split)
_QWEN3_VL = {"text_config.hidden_size": 64, "text_config.intermediate_size": 96,
             "text_config.num_hidden_layers": 4, "text_config.num_attention_heads": 4,
             "text_config.num_key_value_heads": 2, "text_config.head_dim": 16,
             "text_config.rope_scaling.mrope_section": [3, 3, 2],
             "vision_config.depth": 4, "vision_config.hidden_size": 32,
             "vision_config.intermediate_size": 48, "vision_config.num_heads": 2,
             "vision_config.out_hidden_size": 64,
             # three DeepStack taps, as the published [5, 11, 17] of 24 blocks
             "vision_config.deepstack_visual_indexes": [0, 1, 2]}
# Qwen3-VL-MoE: the Qwen3-VL replica's dims, every layer sparse (as published: decoder_sparse_step
# 1, no mlp_only_layers) with 8 experts, 2 per token (enough to lay out over ep 2 and 4).
# moe_intermediate_size 24, not 32: with hidden 64 a 32 makes the fused gate_up_proj square
# ([8, 64, 64]), and transformers 5's
# Transpose(check_dims=True) on load then leaves the published [experts, hidden, 2 * moe]
# layout untransposed (it transposes only when the shapes differ)
_QWEN3_VL_MOE = {**_QWEN3_VL, "text_config.num_experts": 8,
                 "text_config.num_experts_per_tok": 2, "text_config.moe_intermediate_size": 24}
# Qwen3.5 (nested text_config / vision_config, no DeepStack): four text layers, so that the
# published pattern (three gated delta-net layers, then one full attention layer,
# full_attention_interval 4) holds once; head_dim 64 with the published partial_rotary_factor
# 0.25 gives 16 rotary dims = 8 pairs, split over time / height / width as 11 / 11 / 10 of 32
# are (2.75 / 2.75 / 2.5: [3, 3, 2], every section kept; head_dim 16 or 32 would leave 2 or 4
# pairs, too few for three non-empty sections near the published ratio). Linear attention: 2 key
# heads and 4 value heads of 16 (the published 16 / 32 or 16 / 48: more value than key heads,
# each key head shared by value heads); the tower outputs the decoder width (out_hidden_size 64)
_QWEN3_5_TEXT = {"text_config.hidden_size": 64, "text_config.num_hidden_layers": 4,
                 "text_config.layer_types": ["linear_attention"] * 3 + ["full_attention"],
                 "text_config.num_attention_heads": 4, "text_config.num_key_value_heads": 2,
                 "text_config.head_dim": 64,
                 "text_config.rope_parameters.mrope_section": [3, 3, 2],
                 "text_config.linear_num_key_heads": 2, "text_config.linear_num_value_heads": 4,
                 "text_config.linear_key_head_dim": 16, "text_config.linear_value_head_dim": 16,
                 "vision_config.depth": 2, "vision_config.hidden_size": 32,
                 "vision_config.intermediate_size": 48, "vision_config.num_heads": 2,
                 "vision_config.out_hidden_size": 64}
_QWEN3_5 = {**_QWEN3_5_TEXT, "text_config.intermediate_size": 96}
# Qwen3.5-MoE: every layer sparse (as published: no dense layer) with 8 experts, 2 per token,
# and the shared expert; moe_intermediate_size 24 (fused gate_up_proj [8, 48, 64], not square,
# as for Qwen3-VL-MoE), shared_expert_intermediate_size 32
_QWEN3_5_MOE = {**_QWEN3_5_TEXT, "text_config.num_experts": 8,
                "text_config.num_experts_per_tok": 2, "text_config.moe_intermediate_size": 24,
                "text_config.shared_expert_intermediate_size": 32}
# published repository -> (dotted config key -> tiny value, shards of the published weights)
SHRINK: dict[str, tuple[dict[str, Any], int]] = {
    "Qwen/Qwen2-VL-2B-Instruct": (
        {**_TEXT, "num_key_value_heads": 2, **_MROPE, **_QWEN2_VL_VISION}, 1),
    "Qwen/Qwen2-VL-7B-Instruct": (
        {**_TEXT, "num_key_value_heads": 2, **_MROPE, **_QWEN2_VL_VISION}, 2),
    "Qwen/Qwen2.5-VL-3B-Instruct": (
        {**_TEXT, "num_key_value_heads": 2, **_MROPE, **_QWEN2_5_VL_VISION}, 2),
    "Qwen/Qwen2.5-VL-7B-Instruct": (
        {**_TEXT, "num_key_value_heads": 2, **_MROPE, **_QWEN2_5_VL_VISION}, 2),
    # llava-1.5's text config names only what differs from LlamaConfig's defaults; the tiny
    # dims join it (no key/value heads: multi-head attention, as the default gives)
    "llava-hf/llava-1.5-7b-hf": (
        {**{f"text_config.{k}": v for k, v in _TEXT.items()},
         "vision_config.hidden_size": 32, "vision_config.intermediate_size": 48,
         "vision_config.num_attention_heads": 2, "vision_config.num_hidden_layers": 3,
         "vision_config.projection_dim": 32}, 3),
    "llava-hf/llava-interleave-qwen-0.5b-hf": (
        {**{f"text_config.{k}": v for k, v in _TEXT.items()},
         "text_config.num_key_value_heads": 4, "text_config.max_window_layers": 2,
         "vision_config.hidden_size": 32, "vision_config.intermediate_size": 48,
         "vision_config.num_attention_heads": 2, "vision_config.num_hidden_layers": 2}, 1),
    # one model.safetensors, no index (the published repository is not sharded)
    "Qwen/Qwen3-VL-2B-Instruct": (_QWEN3_VL, 1),
    # published in 13 shards with an index
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (_QWEN3_VL_MOE, 2),
    # published in 2 and 14 shards with an index, multi-token prediction weights (mtp.*) beside
    "Qwen/Qwen3.5-4B": (_QWEN3_5, 2),
    "Qwen/Qwen3.5-35B-A3B": (_QWEN3_5_MOE, 2),
}
# shard file names where the repository's differ from the Hub's model-0000N-of-0000M form
SHARD_FILES = {"Qwen/Qwen3.5-4B": "model.safetensors-{:05d}-of-{:05d}.safetensors",
               "Qwen/Qwen3.5-35B-A3B": "model.safetensors-{:05d}-of-{:05d}.safetensors"}
# transformers 5's parameter prefix -> the published one, by config model_type
PUBLISHED_NAMES = {
    "qwen2_vl": (("model.visual.", "visual."), ("model.language_model.", "model."),
                 ("lm_head.", "lm_head.")),
    "llava": (("model.vision_tower.", "vision_tower.vision_model."),
              ("model.multi_modal_projector.", "multi_modal_projector."),
              ("model.language_model.", "language_model.model."),
              ("lm_head.", "language_model.lm_head.")),
}
PUBLISHED_NAMES["qwen2_5_vl"] = PUBLISHED_NAMES["qwen2_vl"]
# Qwen3-VL checkpoints publish transformers' own nesting
PUBLISHED_NAMES["qwen3_vl"] = (("model.visual.", "model.visual."),
                               ("model.language_model.", "model.language_model."),
                               ("lm_head.", "lm_head."))
PUBLISHED_NAMES["qwen3_vl_moe"] = PUBLISHED_NAMES["qwen3_vl"]
PUBLISHED_NAMES["qwen3_5"] = PUBLISHED_NAMES["qwen3_5_moe"] = PUBLISHED_NAMES["qwen3_vl"]
# parameters published transposed from transformers 5's in-memory layout (dims 1 and 2), by
# model_type: Qwen3-VL-MoE's fused experts are published as gate_up_proj [experts, hidden,
# 2 * moe_intermediate] and down_proj [experts, moe_intermediate, hidden]; transformers 5
# holds [experts, 2 * moe_intermediate, hidden] and [experts, hidden, moe_intermediate] and
# transposes on load (conversion_mapping "qwen3_vl_moe")
PUBLISHED_TRANSPOSED = {"qwen3_vl_moe": (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")}
# parameters published in float32 whatever the config's dtype, by model_type: Qwen3.5's gated
# delta-net A_log and its gated RMSNorm weight (mamba_ssm_dtype float32; everything else bf16)
PUBLISHED_FP32 = {"qwen3_5": (".linear_attn.A_log", ".linear_attn.norm.weight")}
PUBLISHED_FP32["qwen3_5_moe"] = PUBLISHED_FP32["qwen3_5"]
# model types whose checkpoints carry multi-token prediction weights (``mtp.*``), which
# transformers does not model (``_keys_to_ignore_on_load_unexpected``)
WITH_MTP = ("qwen3_5", "qwen3_5_moe")
# dtype of the published weights
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def directory_name(repo: str) -> str:
    return repo.replace("/", "--")


def shrunk_config(published: dict, shrink: dict[str, Any]) -> dict:
    """``published`` with each dotted key of ``shrink`` set (order and structure kept; a key
    the published file leaves to the defaults is added at the end of its section)."""
    config = copy.deepcopy(published)
    for dotted, value in shrink.items():
        *parents, key = dotted.split(".")
        section = config
        for parent in parents:
            section = section[parent]
        section[key] = value
    return config


def replica_tokenizer(smollm2: dict, base: int, specials: dict[str, int]) -> dict:
    """A ``tokenizer.json`` whose BPE has ``base`` entries (SmolLM2's merges, truncated or
    padded with unreachable fillers) and the published ``specials`` (content -> id) as added
    special tokens; SmolLM2's own special tokens become fillers."""
    tokenizer = copy.deepcopy(smollm2)
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    for added in tokenizer["added_tokens"]:
        by_id[added["id"]] = f"<|filler_{added['id']}|>"
    for index in range(len(by_id), base):
        # a filler is one BPE entry no merge produces: the pre-tokenizer splits it apart
        by_id[index] = f"<|filler_{index}|>"
    for content, index in specials.items():
        if index < base:
            by_id[index] = content
    vocab = {by_id[i]: i for i in range(base)}
    merges = [pair for pair in tokenizer["model"]["merges"]
              if all(part in vocab for part in pair) and "".join(pair) in vocab]
    tokenizer["model"]["vocab"], tokenizer["model"]["merges"] = vocab, merges
    tokenizer["added_tokens"] = [
        dict(id=index, content=content, single_word=False, lstrip=False, rstrip=False,
             normalized=False, special=True)
        for content, index in sorted(specials.items(), key=lambda item: item[1])]
    return tokenizer


def _specials(files: Path) -> dict[str, int]:
    """The published special tokens (content -> id), from ``tokenizer_config.json``'s
    ``added_tokens_decoder`` or ``added_tokens.json``."""
    config = files / "tokenizer_config.json"
    if config.is_file() and "added_tokens_decoder" in json.loads(config.read_text()):
        decoder = json.loads(config.read_text())["added_tokens_decoder"]
        return {entry["content"]: int(index) for index, entry in decoder.items()}
    return json.loads((files / "added_tokens.json").read_text())


def _bos_template(tokenizer: dict, bos: str, bos_id: int) -> None:
    """Prepend ``bos`` to every encoding, as LLaMA tokenizers' ``add_bos_token`` does."""
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _published_dtype(published: dict) -> str:
    """The weights' dtype as the published config names it (``torch_dtype`` at the top level;
    Qwen3-VL's only in ``text_config.dtype``)."""
    for section in (published, published.get("text_config", {})):
        for key in ("torch_dtype", "dtype"):
            if key in section:
                return str(section[key])
    raise SystemExit("the published config names no dtype")


def _published_name(name: str, model_type: str) -> str:
    for ours, theirs in PUBLISHED_NAMES[model_type]:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise SystemExit(f"no published name for the parameter {name}")


def _published_tensor(name: str, tensor: torch.Tensor, model_type: str) -> torch.Tensor:
    """``tensor`` in the published layout (``PUBLISHED_TRANSPOSED``)."""
    if name.endswith(PUBLISHED_TRANSPOSED.get(model_type, ())):
        return tensor.transpose(1, 2)
    return tensor


def _published_dtype_of(name: str, model_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``name`` is published in (``PUBLISHED_FP32``, else the config's)."""
    return torch.float32 if name.endswith(PUBLISHED_FP32.get(model_type, ())) else dtype


def _mtp_tensors(config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded multi-token prediction weights under the published names and shapes: ``fc``
    [hidden, 2 x hidden] over the normed embedding and hidden state, one full-attention decoder
    layer ``mtp.layers.0`` (its experts one tensor per expert and projection, as published,
    not fused), the final norm. transformers has no module for them: the shapes come from its
    own full-attention decoder layer of the same text config."""
    text = config.text_config
    kind = type(text).__name__.removesuffix("TextConfig")
    module = __import__(f"transformers.models.{config.model_type}.modeling_{config.model_type}",
                        fromlist=["_"])
    layer = getattr(module, f"{kind}DecoderLayer")(text, text.layer_types.index("full_attention"))
    randomize(layer)
    tensors = {}
    for name, parameter in layer.named_parameters():
        if name == "mlp.experts.gate_up_proj":           # [experts, 2 x moe, hidden]
            gate, up = parameter.detach().chunk(2, dim=1)
            for e in range(parameter.shape[0]):
                tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
                tensors[f"mlp.experts.{e}.up_proj.weight"] = up[e]
        elif name == "mlp.experts.down_proj":            # [experts, hidden, moe]
            for e in range(parameter.shape[0]):
                tensors[f"mlp.experts.{e}.down_proj.weight"] = parameter.detach()[e]
        else:
            tensors[name] = parameter.detach()
    generator = torch.Generator().manual_seed(SEED + 1)
    hidden = text.hidden_size
    found = {f"mtp.layers.0.{name}": tensor for name, tensor in tensors.items()}
    found["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.pre_fc_norm_hidden.weight"):
        found[norm] = 1.0 + 0.2 * torch.randn(hidden, generator=generator)
    return {name: tensor.to(dtype).contiguous() for name, tensor in sorted(found.items())}


def _write_weights(tensors: dict[str, torch.Tensor], out: Path, shards: int,
                   file_name: str = "model-{:05d}-of-{:05d}.safetensors") -> None:
    """``model.safetensors``, or ``shards`` files (``file_name``) and their index, as the
    Hub writes them."""
    from safetensors.torch import save_file
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(shards):
        file = file_name.format(shard + 1, shards)
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2) + "\n")


def _check_names(written: set[str], files: Path) -> None:
    """Where the published weight names are recorded (``weights.txt``: the names outside
    numbered layers, blocks and experts, and those of the numbers it lists: layer 0, and for
    Qwen3.5 layer 3 too, its first full-attention layer), the replica has exactly those."""
    listing = files / "weights.txt"
    if not listing.is_file():
        return
    published = set(listing.read_text().split())
    numbered = re.compile(r"\.(layers|blocks|experts)\.(\d+)\.")
    listed = {found for name in published for found in numbered.findall(name)}
    ours = {n for n in written if all(found in listed for found in numbered.findall(n))}
    if ours != published:
        raise SystemExit(f"{files.name}: weight names differ from the published ones: "
                         f"only ours {sorted(ours - published)[:5]}, only published "
                         f"{sorted(published - ours)[:5]}")


def build_replica(repo: str, out: Path, smollm2_tokenizer: Path) -> None:
    """The replica of ``repo`` in ``out`` (staged, then renamed when complete)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    files = PUBLISHED / directory_name(repo)
    shrink, shards = SHRINK[repo]
    staging = staging_folder(out)
    for path in sorted(files.iterdir()):
        if path.name not in ("config.json", "weights.txt"):
            shutil.copy(path, staging / path.name)
    published = json.loads((files / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(shrunk_config(published, shrink),
                                                    indent=2) + "\n")
    config = AutoConfig.from_pretrained(staging)
    specials = _specials(files)
    # the base vocabulary ends where the added tokens past it begin (LLaMA's <unk> <s> </s>
    # are inside it, at 0 1 2)
    base = min(i for i in specials.values() if i > 2)
    tokenizer = replica_tokenizer(json.loads(smollm2_tokenizer.read_text()), base, specials)
    if "<s>" in specials:               # LLaMA's tokenizer: a BOS before every text
        _bos_template(tokenizer, "<s>", specials["<s>"])
    (staging / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))

    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    randomize(model)
    model.tie_weights()
    dtype = DTYPES[_published_dtype(published)]
    kind = config.model_type
    tied = {id(p) for p in model.get_input_embeddings().parameters()}
    tensors = {_published_name(name, kind): _published_tensor(
                   name, p.detach().to(_published_dtype_of(name, kind, dtype)), kind).contiguous()
               for name, p in model.named_parameters(remove_duplicate=False)
               if not (name.startswith("lm_head.") and id(p) in tied)}
    if kind in WITH_MTP:
        tensors |= _mtp_tensors(config, dtype)
    _write_weights(tensors, staging, shards, SHARD_FILES.get(repo, "model-{:05d}-of-{:05d}"
                                                             ".safetensors"))
    _check_names(set(tensors), files)

    loaded = AutoModelForImageTextToText.from_pretrained(staging, dtype=torch.float32)
    expected = {n: p.detach().to(_published_dtype_of(n, kind, dtype)).float()
                for n, p in model.named_parameters()}
    got = dict(loaded.named_parameters())
    wrong = [n for n, t in expected.items() if n not in got or not torch.equal(got[n], t)]
    if wrong or set(got) != set(expected):
        raise SystemExit(f"{repo}: transformers does not load the replica's weights as "
                         f"written: {wrong[:5]}")
    publish(staging, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/models/published"))
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/smollm2"))
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    for repo in SHRINK:
        out = args.out / directory_name(repo)
        if (out / ".complete").is_file():
            continue
        start = time.perf_counter()
        build_replica(repo, out, args.tokenizer / "tokenizer.json")
        print(f"models: {repo} (published format) -> {out} "
              f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
