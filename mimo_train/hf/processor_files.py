"""The processor, tokenizer and generation files an export writes beside its weights: the
base checkpoint's as published, with the run's chat template, pixel budgets and frame
sampling in the keys transformers reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

VIDEO_PROCESSOR = "video_preprocessor_config.json"
# transformers 5 saves a processor as this one file, each part's settings in its own section
NESTED_PROCESSOR = "processor_config.json"
# the files transformers builds a VLM's processor from (an image processor's, or the nested)
PROCESSOR_FILES = ("preprocessor_config.json", NESTED_PROCESSOR)


# the chat template as a file of its own (transformers 5 saves a tokenizer's there)
TEMPLATE_FILE = "chat_template.jinja"
# the files a transformers tokenizer is saved as (a Hub checkpoint ships some of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


def save_tokenizer(tokenizer, out: str) -> None:
    """``tokenizer.save_pretrained(out)`` without the flags of how this process loaded it
    (``local_files_only``, ``is_local``: transformers keeps them among the settings it
    writes), which no published tokenizer_config.json holds."""
    tokenizer.save_pretrained(out)
    rewrite_json(os.path.join(out, "tokenizer_config.json"),
                 lambda data: [data.pop(flag, None) for flag in ("local_files_only", "is_local")])


def write_tokenizer(tokenizer, out: str, pretrained: str, preprocess) -> None:
    """``tokenizer`` saved into ``out``; where it is the checkpoint's own (the preprocessing
    read the checkpoint's folder and added no token), as the checkpoint's files byte for byte:
    a save by this transformers renames the class (Qwen3.5's ``Qwen3_5Tokenizer``) and drops
    keys other readers (an older transformers, a serving engine) need."""
    from transformers import AutoTokenizer

    from mimo_train.families.base import model_directory
    save_tokenizer(tokenizer, out)
    try:
        pretrained, source = (os.path.realpath(model_directory(path))
                              for path in (pretrained, preprocess.tokenizer))
        own = AutoTokenizer.from_pretrained(pretrained) if source == pretrained else None
    except Exception:                   # no tokenizer beside the weights: ours as saved
        return
    if own is None or len(own) != len(tokenizer):
        return                          # another folder's, or tokens added: as saved
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(pretrained, name)):
            shutil.copyfile(os.path.join(pretrained, name), os.path.join(out, name))
    # the save's own chat_template.jinja, a checkpoint without one keeps its template in the
    # files just copied (copy_processor writes the run's own template where it has one)
    if not os.path.isfile(os.path.join(pretrained, TEMPLATE_FILE)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, TEMPLATE_FILE))


def copy_processor(pretrained: str, out: str, preprocess, template: str | None) -> None:
    """The checkpoint's image processor (and processor) config files and the chat template a
    processor keeps (llava-hf's only copy of theirs), as they are but for the run's own
    settings: its chat ``template`` (None: the base's) in each file that holds one, and its
    image and video pixel budgets and frame sampling (``processor_budgets``)."""
    from mimo_train.families.base import model_directory
    pretrained = model_directory(pretrained)
    for name in ("preprocessor_config.json", NESTED_PROCESSOR, VIDEO_PROCESSOR,
                 "chat_template.json", TEMPLATE_FILE):
        if os.path.isfile(os.path.join(pretrained, name)):
            shutil.copyfile(os.path.join(pretrained, name), os.path.join(out, name))
    if template is not None:          # tokenizer.save_pretrained wrote chat_template.jinja
        with open(os.path.join(out, TEMPLATE_FILE), "w") as f:
            f.write(template)
        for name, always in (("chat_template.json", True), ("tokenizer_config.json", False),
                             (NESTED_PROCESSOR, False)):
            rewrite_json(os.path.join(out, name),
                          lambda data, always=always: data.update(chat_template=template)
                          if always or "chat_template" in data else None)
    _video_processor(out, preprocess)
    processor_budgets(out, preprocess)


def name_processor(out: str, pretrained: str) -> None:
    """The processor's class in the image processor's file of ``out``, where no processor
    file there names it (as the hub's do: ``"processor_class": "Qwen2VLProcessor"``), from
    the base's model type. An adapters folder has no ``config.json``, so without it
    ``AutoProcessor.from_pretrained(out)`` quietly gives the tokenizer alone."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from mimo_train.families.base import model_directory
    if any("processor_class" in (_json_section(os.path.join(out, name)) or {})
           for name in PROCESSOR_FILES):
        return
    base = _json_section(os.path.join(model_directory(pretrained), "config.json")) or {}
    named = PROCESSOR_MAPPING_NAMES.get(base.get("model_type", ""))
    if named is not None:
        rewrite_json(os.path.join(out, "preprocessor_config.json"),
                      lambda data: data.update(processor_class=named))


def _video_processor(out: str, preprocess) -> None:
    """The run's video sampling where the base says none and the run trains Qwen2-VL-style
    clips (Qwen2-VL's and Qwen2.5-VL's published checkpoints): without it transformers builds
    their video processor from the image processor's file, the images' pixel budget, and with
    no frame rate it takes every frame of a clip; with it, the run's sampling and budget (the
    video tokens the run trained with). Written as a video processor file, or into the video
    processor section of transformers 5's ``processor_config.json``, which transformers reads
    first (saved from Qwen2-VL's class, it says ``do_sample_frames: false``)."""
    video = preprocess.modalities.get("video")
    if video is None or getattr(video, "sampling", None) != "qwen2_vl":
        return
    sampling = {"size": {"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels},
                "patch_size": video.patch_size, "temporal_patch_size": video.temporal_patch_size,
                "merge_size": video.merge_size, "image_mean": list(video.mean),
                "image_std": list(video.std), "do_sample_frames": True, "fps": video.fps,
                "min_frames": video.min_frames, "max_frames": video.max_frames,
                "cap_pixels_per_frame": video.cap_pixels_per_frame,
                "max_video_tokens": video.max_video_tokens}
    nested = os.path.join(out, NESTED_PROCESSOR)
    if _json_section(nested, "video_processor") is not None:
        rewrite_json(nested, lambda data: data["video_processor"].update(sampling)
                      if data["video_processor"].get("do_sample_frames") is not True else None)
        return
    if os.path.isfile(os.path.join(out, VIDEO_PROCESSOR)):
        return
    image = _json_section(os.path.join(out, "preprocessor_config.json")) or {}
    data = {"video_processor_type": "Qwen2VLVideoProcessor",
            **({"processor_class": image["processor_class"]} if "processor_class" in image
               else {}), **sampling}
    with open(os.path.join(out, VIDEO_PROCESSOR), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _json_section(path: str, section: str | None = None) -> dict | None:
    """The JSON object in ``path`` (or its ``section``), None where there is none."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    found = data.get(section) if section is not None and isinstance(data, dict) else data
    return found if isinstance(found, dict) else None


# the run's video sampling -> the video processor's keys (fps, frames, the per-frame cap)
FRAME_KEYS = ("fps", "min_frames", "max_frames", "cap_pixels_per_frame", "max_video_tokens")


def processor_budgets(out: str, preprocess) -> None:
    """The run's image (and video) pixel budgets in the processor files' keys transformers
    reads (``min_pixels`` / ``max_pixels`` and ``size``'s ``shortest_edge`` /
    ``longest_edge``, each where the file has it), and its video frame sampling (``fps``,
    ``min_frames``, ``max_frames``, ``cap_pixels_per_frame``, ``max_video_tokens``: where the
    file has it, where the processor's class default differs or cannot be read, and
    ``cap_pixels_per_frame`` also where the class has it, its default None being one
    transformers says will change, or where the run capped); a file whose values are the
    run's stays as it is but for ``cap_pixels_per_frame``."""
    for name, section, modality in (("preprocessor_config.json", None, "image"),
                                    (VIDEO_PROCESSOR, None, "video"),
                                    (NESTED_PROCESSOR, "image_processor", "image"),
                                    (NESTED_PROCESSOR, "video_processor", "video")):
        config = preprocess.modalities.get(modality)
        if config is None or getattr(config, "policy", "dynamic") != "dynamic":
            continue

        def update(whole: dict, config=config, modality=modality, section=section) -> None:
            data = whole if section is None else whole.get(section)
            if not isinstance(data, dict):
                return
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if key in data:
                    data[key] = getattr(config, key)
                if isinstance(data.get("size"), dict) and edge in data["size"]:
                    data["size"][edge] = getattr(config, key)
            if modality == "video":
                for key in FRAME_KEYS:
                    value = getattr(config, key)
                    default = _class_default(data, key)
                    # a class default of None (cap_pixels_per_frame's, whose behaviour
                    # transformers says will change) is written out too: the run's is pinned
                    if key in data or (default is not NO_KEY and default != value) or (
                            key == "cap_pixels_per_frame" and value):
                        data[key] = value
        rewrite_json(os.path.join(out, name), update)


# a class default that cannot be read: the run's value is written out
UNREADABLE = object()
NO_KEY = object()        # no such class, or a class without the key


def _class_default(data: dict, key: str):
    """The class default of ``key`` of the video processor ``data`` names, ``NO_KEY``, or
    ``UNREADABLE`` (transformers' video processors need torchvision, which mimo does not: its
    placeholder class raises ImportError)."""
    import transformers
    kind = getattr(transformers, str(data.get("video_processor_type")), None)
    try:
        return getattr(kind, key, NO_KEY)
    except ImportError:
        return UNREADABLE


def rewrite_json(path: str, update) -> None:
    """``path`` (if it exists) with ``update`` applied to its data, rewritten in its own
    indentation only where a value changed."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        text = f.read()
    data = json.loads(text)
    changed = json.loads(text)
    update(changed)
    if changed == data:
        return
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip(" ")) if len(lines) > 1 else None
    with open(path, "w") as f:
        json.dump(changed, f, indent=indent or None, ensure_ascii=False)
        if text.endswith("\n"):
            f.write("\n")


def write_generation_config(out: str, pretrained: str, config, tokenizer) -> None:
    """The checkpoint's generation config, ending generation at the chat turn's end too."""
    from transformers import GenerationConfig
    try:
        generation = GenerationConfig.from_pretrained(pretrained)
    except OSError:                                      # no generation_config.json
        generation = GenerationConfig.from_model_config(config)
    eos = generation.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        generation.eos_token_id = [*eos, tokenizer.eos_token_id]   # ends the chat turn
    generation.save_pretrained(out)
