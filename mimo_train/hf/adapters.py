"""``mimo-export --adapters``: a LoRA run's adapters alone, in PEFT's file format, for the whole
VLM it fine-tuned (``model.pretrained``).

``OUT`` holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's names:
``base_model.model.<layer>.lora_A.weight`` / ``lora_B.weight``, each layer named as the
transformers model has it, so ``peft.PeftModel.from_pretrained(base, OUT)`` applies them), the
tokenizer, the processor files, ``preprocess.yaml`` and ``manifest.json`` (``"adapters"``: the
base checkpoint, which ``mimo-generate --model OUT`` loads under them). Written by hand: the
adapters come from megatron-core layers PEFT does not know, so PEFT's own save cannot write them.

Layer names: a fused megatron-core layer's adapter becomes one per transformers layer it holds
(``families.causal_lm.adapters_to_hf``, a mixture of experts' shared expert's as the dense
MLP's, ``mlp.shared_expert.gate_proj`` ...); the checkpoint's names become the
model's through transformers' own conversion of checkpoint names
(``get_model_conversion_mapping``), as ``from_pretrained`` converts weights. Parts with other
ranks or alphas than the language model's go in ``rank_pattern`` / ``alpha_pattern``.

A mixture of experts' routed experts are one fused parameter per layer in transformers
(``mlp.experts.gate_up_proj`` [E, 2 I, H], ``mlp.experts.down_proj`` [E, H, I]), which PEFT
adapts as ``target_parameters``: one adapter of rank r per expert, ``lora_A`` [E r, in] (expert
e's A its rows e r on) and ``lora_B`` [out, r E] (expert e's B its columns e, e + E, ...; PEFT's
``ParamWrapper``), an expert without an adapter zero in both; two parameters of one module are
nested wrappers, PEFT naming the first it wraps (in the module's order) ``experts.base_layer``
and the last ``experts``. PEFT takes no dropout there: ``lora_dropout`` is written 0 (it only
acts in training).

Refused (use the merged export instead): a run that also trained weights outside the adapters
(a part neither frozen nor adapted), whose adapters alone are not the trained model, and a run
whose vocabulary differs from the checkpoint's.
"""

from __future__ import annotations

import json
import os

import torch

from mimo_train.config import LoraConfig
from mimo_train.errors import ExportError
from mimo_train.plan import RunPlan

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def write_adapters(out: str, plan: RunPlan, weights: dict, language_arch, image: str,
                   directory: str, dtype: torch.dtype | None = None) -> dict:
    """The adapters of ``weights`` (module name -> whole tensors, ``load_weights``) as PEFT
    files in ``out`` (``image``: the encoder module of the VLM's tower), in ``dtype`` (None:
    as trained); returns the adapter config written."""
    from safetensors.torch import save_file

    from mimo_train.families.causal_lm import adapters_to_hf
    from mimo_train.model.lora import spec_of
    vlm = plan.vlm
    assert vlm is not None
    trained = plan.parts_in_full()
    if trained:
        raise ExportError(f"{directory}: the run also trained {trained} outside its adapters "
                          "(not in model.freeze nor model.lora): adapters alone are not the "
                          "trained model; export it merged (without --adapters)")
    # layer path in the checkpoint's names -> (A, B, model.lora entry)
    language = next((a.spec for a in plan.adapted if a.part.module == "language"), None)
    found: dict[str, tuple[torch.Tensor, torch.Tensor, LoraConfig]] = {}
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}     # PEFT's target_parameters
    if language is not None:
        state = weights["language"]
        fused = _routed_expert_adapters(state, language_arch)
        found = {path: (a, b, language) for path, (a, b)
                 in adapters_to_hf(state, language_arch).items()}
    renames = vlm.checkpoint_names(vlm.weights())      # parameter names, as the merge's
    tower = weights[image]
    for key in tower:
        if not key.endswith("lora.a.weight"):
            continue
        layer = key[:-len("lora.a.weight")]
        param = layer + "weight"
        for ours, theirs in renames:
            if param.startswith(ours):
                found[(theirs + param[len(ours):]).removesuffix(".weight")] = (
                    tower[key], tower[layer + "lora.b.weight"],
                    spec_of(plan.adapted, image, key))
    if not found and not fused:
        raise ExportError(f"{directory}: the run has no LoRA adapters (model.lora) to export")
    names, parameters = _model_names(vlm.path, list(found), list(fused))
    default = language or next(s for _, _, s in found.values())
    tensors, ranks, alphas = {}, {}, {}
    for path, (a, b, spec) in found.items():
        name = names[path]
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        if spec.rank != default.rank:
            ranks[name] = spec.rank
        if spec.alpha != default.alpha:
            alphas[name] = spec.alpha
    for path, (a, b) in fused.items():
        _, wrapper = parameters[path]
        tensors[f"base_model.model.{wrapper}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{wrapper}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": vlm.path,
        "r": default.rank, "lora_alpha": default.alpha,
        "lora_dropout": 0.0 if fused else default.dropout,
        "target_modules": sorted(names.values()), "rank_pattern": ranks,
        "alpha_pattern": alphas, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True,
        **({"target_parameters": sorted(name for name, _ in parameters.values())}
           if fused else {})}
    os.makedirs(out, exist_ok=True)
    # one file, as PEFT reads it; own storage (q/k/v adapters share their A)
    save_file({k: v.to(dtype or v.dtype).clone() for k, v in tensors.items()},
              os.path.join(out, ADAPTER_WEIGHTS))
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return config


def _routed_expert_adapters(state: dict, arch) -> dict[str, tuple]:
    """The routed experts' adapters in the language model's state dict ``state`` (whole
    tensors, global layer and expert numbers) by transformers' fused parameter, as PEFT holds
    them (see the module docstring); the other layers' are ``adapters_to_hf``'s."""
    experts: dict[str, dict[int, tuple]] = {}
    for key in state:
        if not key.endswith(".lora.a.weight") or ".mlp.experts.local_experts." not in key:
            continue
        layer = key[:-len(".lora.a.weight")]
        a, b = state[key], state[layer + ".lora.b.weight"]
        head, _, inner = layer.partition(".mlp.")
        kind, _, name = inner.rpartition(".")
        fused = f"{arch.prefix}layers.{head.split('.')[2]}.mlp." + (
            "experts.gate_up_proj" if name == "linear_fc1" else "experts.down_proj")
        experts.setdefault(fused, {})[int(kind.rsplit(".", 1)[1])] = (a, b)
    parameters = {}
    for fused, held in experts.items():
        a, b = next(iter(held.values()))
        none = (torch.zeros_like(a), torch.zeros_like(b))
        pairs = [held.get(e, none) for e in range(arch.experts)]
        parameters[fused] = (torch.cat([a for a, _ in pairs]),            # [E r, in]
                             torch.stack([b for _, b in pairs], -1).flatten(1))   # [out, r E]
    return parameters


def _model_names(pretrained: str, paths: list[str], parameters: list[str]
                 ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """Layer paths in the checkpoint's names -> as the transformers model names them,
    converted as ``from_pretrained`` converts the weights' names; fused parameters (the
    routed experts') in the checkpoint's names -> the model's and the name of the PEFT wrapper
    adapting it (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 rename_source_key)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(pretrained))
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    state = model.state_dict()

    def renamed(key: str) -> tuple[str, object]:
        return rename_source_key(key, renamings, converters, model.base_model_prefix, state)

    names = {}
    for path in paths:
        key, converted = renamed(f"{path}.weight")
        if converted is not None or key not in state:
            raise ExportError(f"the adapter of {path} has no layer of its own in "
                              f"{type(model).__name__} (transformers fuses or renames it "
                              "otherwise): export the run merged")
        names[path] = key.removesuffix(".weight")
    held: dict[str, list[str]] = {}               # module -> its adapted parameters
    found = {}
    for path in parameters:
        key, _ = renamed(path)        # the fused experts' converter transposes, keeps the name
        if key not in state:
            raise ExportError(f"the adapter of {path} has no parameter of its own in "
                              f"{type(model).__name__}: export the run merged")
        found[path] = key
        module, _, name = key.rpartition(".")
        held.setdefault(module, []).append(name)
    wrappers = {}
    for module, adapted in held.items():
        # PEFT wraps a module's targeted parameters in its order, each wrapper around the last
        order = [n for n, _ in model.get_submodule(module).named_parameters(recurse=False)
                 if n in adapted]
        for depth, name in enumerate(order):
            wrappers[f"{module}.{name}"] = module + ".base_layer" * (len(order) - 1 - depth)
    return names, {path: (key, wrappers[key]) for path, key in found.items()}
