"""``mimo-generate --model OUT [--image PATH ...] [--video PATH ...] [--audio PATH ...] --prompt
TEXT``: answer a prompt with a model written by ``mimo-export``.

The prompt goes through training's preprocessing (``OUT/preprocess.yaml`` through
``Preprocessor.prompt``): one user turn holding the prompt, each ``<image>`` / ``<video>`` /
``<audio>`` marker in it taking the next file of its modality (files without a marker in the prompt
get one in front of it, images first, then videos), rendered with the chat template's generation
prompt, each marker expanded to as many modality tokens as its item's encoder emits, the media
decoded into the encoder inputs training uses (a video: its sampled frames only). Each encoder
(``OUT/<module>``) and its projection turn those into embeddings, which replace the language model's
input embeddings at the modality tokens, item by item (as megatron-core's ``MimoModel`` splices
them), and transformers' ``generate(inputs_embeds=...)`` of ``OUT/language`` continues: greedy
unless ``--temperature`` is given (then sampling with ``--top-p`` and ``--top-k`` from ``--seed``);
it stops at the training tokenizer's EOS, which ends every trained answer, and at the model's own
end ids. A whole VLM's export (``"vlm"`` in the manifest) runs through its own transformers class
instead, on the same prompt tokens and training's normalized pixels (videos with their grids and,
for Qwen2.5-VL, the seconds each temporal patch spans; Qwen2-VL's and Qwen2.5-VL's text after a clip
positioned as training positions it, ``families.qwen2_vl.use_published_positions``). Every part runs
in ``--dtype`` (fp32 by default, or bf16) whatever dtype the export stores: the encoders are read in
fp32 and cast (``precision.cast``: rotary frequencies stay fp32), the language model is loaded in
it.

Exit codes: 0 answered; 1 a media file failed a check (a clip longer than the config allows,
one that does not decode: corrupt, or no stream of its kind); 2 usage or config error (not an
export, a file that does not exist or is a folder, a file of another kind than its flag's, a
modality the model has no encoder for). Nothing heavy is imported before the arguments are parsed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mimo_data.arguments import SEED, Parser, user_path
from mimo_data.hub import cache_only
from mimo_data.stdout import quiet_when_stdout_closes
from mimo_train.hf.export import MANIFEST
from mimo_train.checkpoint_folders import LATEST, META
from mimo_train.errors import GenerateError
from mimo_train.runtime import console

if TYPE_CHECKING:
    from mimo_data.shards.format import Message

PREFIX = "mimo-generate: "
# a frames rate given where no video is a folder of frames
_NO_FRAMES = ("--frames-fps is the rate of a --video folder of JPEG frames, and no --video "
              "given is one: a video file's frames are sampled as training samples them "
              "(modalities.video.fps of its preprocessing); leave --frames-fps out")
_MARKER = re.compile(r"<(image|video|audio)>")
# what to do about a medium the preprocessing refuses (the reason training counts it under)
_REMEDIES = {
    "audio_too_long": "cut the clip to max_duration, or set long_audio: truncate in "
                      "{preprocess}",
    "audio_too_short": "give a longer clip",
    "video_too_long": "cut the clip to modalities.video.max_duration (the longest clip the "
                      "run's preprocessing takes, in {preprocess}), or raise it there",
    "video_too_short": "give a longer clip",
}


@dataclass
class Generation:
    """What one ``Generator.generate`` call produced."""
    text: str                         # the new tokens, decoded without special tokens
    token_ids: list[int]              # the new tokens
    prompt_ids: list[int]             # the prompt's tokens, modality tokens expanded
    spliced: dict[str, int]           # modality -> encoder rows put in place of its tokens


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mimo-generate", description="Answer a prompt, with images, videos and audio, "
        "using a model written by mimo-export (training's preprocessing, the encoders and "
        "projections, then the language model's generate).",
        epilog="Exit codes: 0 answered, 1 a media file failed a check, 2 usage or config "
        "error, 130 Ctrl-C.")
    parser.add_argument("--model", type=user_path, required=True, metavar="OUT",
                        help="directory written by mimo-export (holds manifest.json)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="the user's message; <image>/<video>/<audio> markers place the "
                        "files, "
                        "files without a marker go in front of it")
    prompt.add_argument("--prompt-file", type=user_path, metavar="FILE",
                        help="the user's message read from FILE (UTF-8; - reads standard "
                        "input), for a long or multi-line prompt; its last newline is left out")
    parser.add_argument("--image", type=user_path, action="append", default=[], metavar="PATH",
                        help="an image file (repeatable, in marker order)")
    parser.add_argument("--video", type=user_path, action="append", default=[], metavar="PATH",
                        help="a video file (repeatable, in marker order); its frames are "
                        "sampled as training samples them")
    parser.add_argument("--frames-fps", type=float, metavar="R",
                        help="the rate a --video folder of JPEG frames was taken at (frames a "
                        "second), as mimo-shard build --frames-fps: the folder is one clip "
                        "of its frames in the order of their numbers")
    parser.add_argument("--audio", type=user_path, action="append", default=[], metavar="PATH",
                        help="an audio file (repeatable, in marker order)")
    parser.add_argument("--system", metavar="TEXT",
                        help="a system turn before the prompt, as the model's chat template "
                        "renders one (a model fine-tuned with a system prompt: the same text)")
    parser.add_argument("--history", type=user_path, metavar="FILE",
                        help="the conversation before the prompt, for a multi-turn answer: a "
                        "JSON list of turns (role/content or ShareGPT's from/value, as "
                        "training's records hold them), or a record holding them "
                        "(messages or conversations); its markers take the files first, in "
                        "order, and it ends with an answer (the prompt is the next user turn)")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="most tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, metavar="T",
                        help="sample at this temperature (default: greedy decoding)")
    parser.add_argument("--top-p", type=float, metavar="P",
                        help="nucleus sampling mass, with --temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="sample among the K likeliest tokens only, with --temperature "
                        "(default: all of them)")
    parser.add_argument("--seed", type=SEED, metavar="S",
                        help="random seed of the sampling, with --temperature (default 0)")
    parser.add_argument("--no-thinking", action="store_true",
                        help="render the generation prompt with the template's enable_thinking "
                        "false (Qwen3, Qwen3.5: the empty think block an answer without "
                        "reasoning trains after), not its default (thinking on)")
    parser.add_argument("--base", type=user_path, metavar="DIR",
                        help="an export of LoRA adapters alone (mimo-export --adapters): "
                        "where their base model is now, when it moved from where "
                        "manifest.json's adapters.base says (its weights are checked against "
                        "the digest recorded there)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run: auto (cuda when available), cpu or cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        type=lambda name: {"float32": "fp32", "bfloat16": "bf16"}.get(name, name),
                        help="precision of every part, fp32|bf16 (or float32|bfloat16, as "
                        "mimo-export names them), whatever the export stores (default fp32)")
    return parser


@quiet_when_stdout_closes
def main(argv=None) -> int:
    cache_only()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens is {args.max_new_tokens}: it must be >= 1")
    if args.temperature is not None and not 0 < args.temperature < math.inf:   # nan too
        parser.error(f"--temperature is {args.temperature}: it must be a finite number > 0 "
                     "(leave it out for greedy decoding)")
    drawn = [flag for flag, value in (("--top-p", args.top_p), ("--top-k", args.top_k),
                                      ("--seed", args.seed)) if value is not None]
    if args.temperature is None and drawn:
        given = " and ".join(drawn)
        parser.error(f"{given} go{'es' if ' and ' not in given else ''} with --temperature: "
                     "without it decoding is greedy, which draws nothing (give --temperature "
                     "T to sample)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p is {args.top_p}: it must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k is {args.top_k}: it must be >= 1 (leave it out to sample among "
                     "all tokens)")
    if args.frames_fps is not None:
        from mimo_data.modalities.video.frames import MAX_FPS, MIN_FPS
        if not MIN_FPS <= args.frames_fps <= MAX_FPS:
            parser.error(f"--frames-fps is {args.frames_fps:g}: frames are taken {MIN_FPS:g} "
                         f"to {MAX_FPS:g} a second")
        if not any(os.path.isdir(video) for video in args.video):
            parser.error(_NO_FRAMES)
    if args.prompt_file is not None:
        args.prompt = _prompt_of(args.prompt_file, parser)
    history = _history_of(args.history, parser) if args.history is not None else []
    try:
        console.quiet_third_party()     # imports torch: a Ctrl-C there is one line too
        generator = Generator(args.model, args.device, args.dtype, base=args.base)
        result = generator.generate(args.prompt, images=args.image, audios=args.audio,
                                    videos=args.video,
                                    max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature,
                                    top_p=1.0 if args.top_p is None else args.top_p,
                                    top_k=args.top_k or 0,
                                    seed=args.seed or 0, thinking=not args.no_thinking,
                                    frames_fps=args.frames_fps, system=args.system,
                                    history=history)
    except GenerateError as error:
        print(f"{PREFIX}{error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:               # Ctrl-C: one line, not the traceback of where
        print(f"{PREFIX}interrupted", file=sys.stderr)      # it was (loading, generating)
        return 130
    print(result.text)
    if not result.text.strip():             # an empty line alone reads as a broken run
        print(f"{PREFIX}note: the answer is empty: the model generated "
              f"{len(result.token_ids)} token(s), "
              f"{generator.tokenizer.decode(result.token_ids)!r}, and no text" + (
                  " (a model that ends its answer at once has often barely trained; "
                  "--temperature T samples instead of taking the likeliest token)"
                  if result.token_ids[:1] and result.token_ids[0] in generator.stop_ids()
                  else ""), file=sys.stderr)
    return 0


class Generator:
    """An exported model loaded once (language model, encoders, projections, preprocessing;
    or a whole VLM and its preprocessing)."""

    def __init__(self, model_dir: str, device: str = "auto", dtype: str = "fp32",
                 base: str | None = None):
        """``base``: where an adapters export's base is, in place of its manifest's."""
        import torch

        from mimo_data.errors import ConfigError
        from mimo_data.preprocess.config import PreprocessConfig
        from mimo_data.preprocess.preprocessor import Preprocessor
        from mimo_train.precision import run_dtype
        path = os.path.join(model_dir, MANIFEST)
        if not os.path.isfile(path) and any(os.path.isfile(os.path.join(model_dir, name))
                                            for name in (META, LATEST)):
            raise GenerateError(f"--model {model_dir} is a mimo-train checkpoint, not an export: "
                                f"mimo-export --checkpoint {model_dir} --output OUT writes one, "
                                "then mimo-generate --model OUT")
        if not os.path.isfile(path) and os.path.isfile(os.path.join(model_dir, "config.json")):
            raise GenerateError(f"--model {model_dir} is a transformers model (config.json, no "
                                f"{MANIFEST}), not a mimo-export folder (or one that lost its "
                                f"{MANIFEST}: copy it again): mimo-generate runs what "
                                "mimo-export wrote, with its run's preprocessing; generate with "
                                "this one through transformers (its model's generate)")
        if not os.path.isdir(model_dir):
            raise GenerateError(f"--model {model_dir} is " + (
                "a file" if os.path.isfile(model_dir) else "not there") + ": give the "
                "directory mimo-export wrote (it holds manifest.json)")
        try:
            with open(path) as f:
                self.manifest = json.load(f)
        except (OSError, ValueError) as error:
            raise GenerateError(f"--model {model_dir}: {error}; give a directory written by "
                                "mimo-export") from None
        _check_files(model_dir, self.manifest.get("files", {}))
        try:
            self.preprocess_path = os.path.join(model_dir, self.manifest["preprocess"])
            self.preprocessor = Preprocessor(PreprocessConfig.from_yaml(self.preprocess_path))
        except (OSError, ValueError, KeyError, ConfigError) as error:
            raise GenerateError(f"--model {model_dir}: {error}; give a directory written by "
                                "mimo-export") from None
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise GenerateError("--device cuda: no CUDA device is visible; use --device cpu")
        self.device = torch.device(device)
        self.dtype = run_dtype(dtype)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()
        self.tokenizer = self.preprocessor.text.tokenizer
        load_errors = _load_errors()
        self.vlm: Any = None
        adapters = self.manifest.get("adapters")
        if base is not None:
            if not adapters:
                raise GenerateError(f"--base goes with an export of LoRA adapters alone "
                                    f"(mimo-export --adapters); {model_dir} holds its whole "
                                    "model: leave --base out")
            adapters = {**adapters, "base": base}
        if self.manifest.get("vlm"):        # a whole VLM: its own class runs the media too
            if adapters:                    # before loading a base it would refuse
                _check_base(model_dir, adapters)
            try:
                self.vlm = AutoModelForImageTextToText.from_pretrained(
                    adapters["base"] if adapters else model_dir, dtype=self.dtype)
            except load_errors as error:
                if not adapters:
                    raise _unloadable(model_dir, error) from None
                given = "--base" if base is not None else "manifest.json's adapters.base"
                where = adapters["base"]
                # a path gone reads as a bad hub name to transformers: say it is gone
                gone = (os.path.isabs(where) or where.startswith((".", "~"))) and \
                    not os.path.exists(os.path.expanduser(where))
                raise GenerateError(
                    f"--model {model_dir} holds adapters, and their base {where} ({given}) "
                    f"cannot be loaded ({'no such directory' if gone else error}): restore "
                    "it there, or give where it is now with --base DIR") from None
            if self.vlm.config.model_type in ("qwen2_vl", "qwen2_5_vl"):   # as trained
                from mimo_train.families.qwen2_vl import use_published_positions
                use_published_positions(self.vlm)
            if adapters:                    # LoRA adapters (PEFT's files) on their base
                self.vlm = _with_adapters(self.vlm, model_dir)
            self.vlm = self.vlm.to(self.device).eval()
            self.encoders: dict[str, Any] = dict.fromkeys(self.preprocessor.config.modalities)
            return
        try:
            self.language = AutoModelForCausalLM.from_pretrained(
                os.path.join(model_dir, self.manifest["language"]), dtype=self.dtype)
            self.encoders = self._encoders(model_dir)
        except load_errors as error:
            raise _unloadable(model_dir, error) from None
        self.language = self.language.to(self.device).eval()

    def _encoders(self, model_dir: str) -> dict:
        """modality -> (encoder, projection), on the device (a module serving several
        modalities: the same pair for each)."""
        from safetensors.torch import load_file

        from mimo_train.families.registry import build_encoder
        from mimo_train.precision import cast
        projections = load_file(os.path.join(model_dir, self.manifest["projections"]))
        encoders = {}
        for name, module in self.manifest["modules"].items():
            modality = module["modality"]
            encoder = build_encoder(module["kind"], self.preprocessor.config.modalities[modality],
                                    0, 0, 0, os.path.join(model_dir, module["path"]))
            state = {k[len(name) + 1:]: v for k, v in projections.items()
                     if k.startswith(name + ".")}
            # each module's kind (an export before per-module projections: one for all)
            projection = projection_module(module.get("projection")
                                           or self.manifest["projection"], state)
            pair = (cast(encoder, self.dtype).to(self.device).eval(),
                    cast(projection, self.dtype).to(self.device).eval())
            for served in [modality, *module.get("also", [])]:   # one encoder, its modalities
                if served != modality:
                    encoder.take_also(served, self.preprocessor.config.modalities[served])
                encoders[served] = pair
        return encoders

    def generate(self, prompt: str, images: Sequence[str] = (), audios: Sequence[str] = (),
                 max_new_tokens: int = 64, temperature: float | None = None,
                 top_p: float = 1.0, seed: int = 0, videos: Sequence[str] = (),
                 thinking: bool = True, frames_fps: float | None = None,
                 system: str | None = None, top_k: int = 0,
                 history: Sequence[dict] = ()) -> Generation:
        """Answer ``prompt`` about the ``images``, ``videos`` and ``audios`` (file paths, or
        one path; a video a folder of frames taken ``frames_fps`` a second), after a
        ``system`` turn where one is given and the turns of ``history`` (role/content or
        from/value, ending with an answer; their markers take the files first);
        ``temperature`` samples (``top_p`` and ``top_k``, 0 for all tokens, with it), else
        decoding is greedy; ``thinking=False``: the template's ``enable_thinking`` false (its
        default otherwise)."""
        import torch
        drawn = f"top_p {top_p}" if top_p != 1.0 else f"top_k {top_k}" if top_k else None
        if temperature is None and drawn:
            raise GenerateError(f"{drawn} goes with temperature: without it decoding is "
                                "greedy, which draws nothing")
        if top_k < 0:
            raise GenerateError(f"top_k is {top_k}: it must be >= 1, or 0 for all tokens")
        files = {modality: [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
                 for modality, paths in (("image", images), ("video", videos),
                                         ("audio", audios))}
        if frames_fps is not None and not any(os.path.isdir(path) for path in files["video"]):
            raise GenerateError(_NO_FRAMES)
        if system is not None and (typed := _MARKER.findall(system)):
            raise GenerateError(f"the system turn holds a <{typed[0]}> marker: it takes text "
                                "alone (media go in the prompt)")
        earlier = _history_turns(history, system)
        before = "".join(turn["content"] for turn in earlier)
        has = ", ".join(sorted(self.encoders)) or "none"
        for modality, paths in files.items():
            if paths and modality not in self.encoders:
                raise GenerateError(f"--{modality} given, but the model has no {modality} "
                                    f"encoder (it has {has})")
        for modality in dict.fromkeys(_MARKER.findall(before + prompt)):
            if modality not in self.encoders:
                raise GenerateError(f"the prompt's <{modality}> marker asks for {modality} "
                                    f"input, but the model has no {modality} encoder (it has "
                                    f"{has}): remove the marker")
        content, order = _place_markers(prompt, files, before)
        if not thinking and "enable_thinking" not in (self.preprocessor.text.renderer.template
                                                      or ""):
            print("mimo-generate: --no-thinking: the model's chat template reads no "
                  "enable_thinking (it has no thinking to turn off): the prompt is the same",
                  file=sys.stderr)
        built, items = self._prompt(content, order, files,
                                    None if thinking else {"enable_thinking": False},
                                    frames_fps, system, earlier)
        ids = built.input_ids.to(self.device)
        self._say_longer(len(ids), max_new_tokens)
        sampling: dict[str, Any] = dict(
            do_sample=False, max_new_tokens=max_new_tokens,
            attention_mask=torch.ones_like(ids)[None],
            pad_token_id=self.preprocessor.text.pad_token_id, eos_token_id=self.stop_ids())
        if temperature is not None:
            torch.manual_seed(seed)
            # top_k 0 (all tokens) said, or the model's generation_config.json's would apply
            sampling.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        with torch.no_grad():
            new, spliced = (self._whole_vlm(ids, built.encoder_inputs, items, sampling)
                            if self.vlm else self._spliced(ids, built.encoder_inputs, sampling))
        return Generation(self.tokenizer.decode(new, skip_special_tokens=True), new,
                          built.input_ids.tolist(), spliced)

    def stop_ids(self) -> list[int]:
        """The ids generation stops at: the model's generation config's, the EOS of the
        training tokenizer (appended after each trained answer where the chat template writes
        no end-of-turn token: ``append_eos``) and the token the template ends answers with
        (ChatML's ``<|im_end|>``, where a base checkpoint's EOS is ``<|endoftext|>``)."""
        model = self.vlm if self.vlm is not None else self.language
        configured = model.generation_config.eos_token_id
        ids = ([] if configured is None else [configured] if isinstance(configured, int)
               else list(configured))
        turn_end = self.tokenizer.convert_tokens_to_ids(self.preprocessor.text.renderer.eot)
        for token in (self.tokenizer.eos_token_id, turn_end):
            if token is not None and token not in ids:
                ids.append(token)
        return ids

    def _spliced(self, ids, encoder_inputs: dict, sampling: dict) -> tuple[list[int], dict]:
        """Each encoder's projected rows in place of its modality tokens' embeddings, then the
        language model's generate: the new tokens and the rows spliced per modality."""
        from mimo_train.families.base import HOST_INPUTS
        embeds = self.language.get_input_embeddings()(ids)
        spliced = {}
        for modality, inputs in encoder_inputs.items():
            encoder, projection = self.encoders[modality]
            rows = projection(encoder.encode(modality, **{
                k: v if k in HOST_INPUTS else v.to(self.device) for k, v in inputs.items()}))
            at = ids == self.manifest["modality_tokens"][modality]["id"]
            if int(at.sum()) != len(rows):
                raise RuntimeError(f"the {modality} encoder emitted {len(rows)} rows for "
                                   f"{int(at.sum())} placeholders; this is a bug in mimo")
            embeds[at] = rows.to(embeds.dtype)
            spliced[modality] = len(rows)
        return self.language.generate(inputs_embeds=embeds[None], **sampling)[0].tolist(), \
            spliced

    def _whole_vlm(self, ids, encoder_inputs: dict, items: list, sampling: dict
                   ) -> tuple[list[int], dict]:
        """The whole VLM's generate on mimo's tokens and pixels (normalized as training
        normalizes them): the new tokens and the media tokens per modality."""
        import inspect

        import torch

        from mimo_data.modalities.image import normalize_pixels
        from mimo_data.modalities.video import normalize_video_pixels, seconds_per_grid
        configs, tokens = self.preprocessor.config.modalities, self.manifest["modality_tokens"]
        kwargs: dict[str, Any] = {}
        for inputs in encoder_inputs.values():
            kwargs.update({name: value.to(self.device) for name, value in inputs.items()})
        if "pixel_values" in kwargs:
            kwargs["pixel_values"] = normalize_pixels(kwargs["pixel_values"],
                                                      configs["image"]).to(self.dtype)
        model = getattr(self.vlm, "get_base_model", lambda: self.vlm)()     # under PEFT's
        parameters = inspect.signature(model.forward).parameters
        if "pixel_values_videos" in kwargs:
            video = configs["video"]
            kwargs["pixel_values_videos"] = normalize_video_pixels(
                kwargs["pixel_values_videos"], video).to(self.dtype)
            if "second_per_grid_ts" in parameters:           # Qwen2.5-VL's time scaling
                kwargs["second_per_grid_ts"] = torch.tensor(
                    [seconds_per_grid(item["frames"], item["fps"], video)
                     for item in items if item["modality"] == "video"], device=self.device)
        kinds = torch.zeros_like(ids, dtype=torch.int)
        for value, modality in ((1, "image"), (2, "video")):    # Qwen's token types
            if modality in tokens:
                kinds[ids == tokens[modality]["id"]] = value
        if "mm_token_type_ids" in parameters:
            kwargs["mm_token_type_ids"] = kinds[None]
        out = self.vlm.generate(input_ids=ids[None], **kwargs, **sampling)
        return out[0, len(ids):].tolist(), {
            modality: int((ids == tokens[modality]["id"]).sum()) for modality in encoder_inputs}

    def _say_longer(self, prompt: int, new: int) -> None:
        """A line on stderr where the prompt and its answer may run past the longest sequence
        the model trained on (``seq_length``): past it, what it answers is untested; and past
        the positions its config gives (``max_position_embeddings``), where it does."""
        trained = self.preprocessor.config.seq_length
        config = (self.vlm if self.vlm is not None else self.language).config
        positions = getattr(getattr(config, "text_config", None) or config,
                            "max_position_embeddings", None)
        if prompt + new > trained:
            print(f"mimo-generate: the prompt is {prompt} tokens (media included), up to "
                  f"{prompt + new} with --max-new-tokens {new}; the model trained on sequences "
                  f"of at most {trained} (seq_length in its preprocess.yaml): answers past that "
                  "length are outside what it learned" + (
                      f", and past {positions}, the positions its config.json gives "
                      "(max_position_embeddings), outside what its architecture was made for"
                      if isinstance(positions, int) and prompt + new > positions else ""),
                  file=sys.stderr)

    def _say_cut(self, modality: str, path: str, item) -> None:
        """A line on stderr where the model hears only the start of a clip: one longer than
        its ``max_duration`` under ``long_audio: truncate`` (as in training; ``drop`` refuses
        it instead)."""
        config = self.preprocessor.config.modalities.get(modality)
        if modality == "audio" and config is not None and config.long_audio == "truncate" \
                and item["duration"] > (limit := config.max_duration):
            print(f"mimo-generate: --audio {path} is {item['duration']:.1f} s; the model hears "
                  f"its first {limit:g} s (modalities.audio.max_duration, long_audio: "
                  "truncate)", file=sys.stderr)

    def _prompt(self, content: str, order: list[str], files: dict,
                template_options: dict | None = None, frames_fps: float | None = None,
                system: str | None = None, history: Sequence[Message] = ()):
        from mimo_data.modalities import MediaError
        from mimo_data.preprocess.chat_tokens import TextError
        from mimo_data.modalities.image import still_image, video_or_audio
        from mimo_data.modalities.video.frames import frames_clip
        from mimo_data.preprocess.preprocessor import SampleDropped, media_item
        media, seen, paths = [], dict.fromkeys(files, 0), {}
        for modality in order:
            path = files[modality][seen[modality]]
            try:
                if modality == "video" and frames_fps and os.path.isdir(path):
                    data = frames_clip(path, frames_fps)      # as the build makes it
                else:
                    with open(path, "rb") as f:
                        data = f.read()
                if modality == "image" and (kind := video_or_audio(data)):
                    raise GenerateError(     # the wrong option: a usage error, not bad data
                        f"--image {path} is {kind}, not an image: give a clip as --video, "
                        "audio as --audio")
                if modality != "image" and (kind := still_image(data)):
                    raise GenerateError(
                        f"--{modality} {path} is {kind}, not "
                        f"{'a clip' if modality == 'video' else 'audio'}: give an image as "
                        "--image")
                media.append((media_item(modality, data, seen[modality]), data))
                paths[media[-1][0]["member"]] = f"--{modality} {path}"
                self._say_cut(modality, path, media[-1][0])
            except IsADirectoryError:
                raise GenerateError(f"--{modality} {path} is a folder: give a file" + (
                    " (a folder of JPEG frames: give --frames-fps R, the rate they were taken "
                    "at, as mimo-shard build takes it)" if modality == "video" else "")
                    ) from None
            except OSError as error:
                raise GenerateError(f"--{modality} {path}: {error.strerror or error}"
                                    ) from None
            except MediaError as error:       # the file's data failed a check, as a
                remedy = (": resize it first"     # dropped clip's; no option raises the limit
                          if error.reason in ("image_too_large", "video_too_large") else "")
                raise GenerateError(f"--{modality} {path}: {error.detail}{remedy}",
                                    exit_code=1) from None
            seen[modality] += 1
        try:
            turns: list[Message] = [*history, {"role": "user", "content": content}]
            if system is not None:
                turns.insert(0, {"role": "system", "content": system})
            return (self.preprocessor.prompt(turns, media, template_options),
                    [item for item, _ in media])
        except SampleDropped as error:       # named by the user's paths, not the members'
            detail = re.sub("|".join(rf"\b{re.escape(member)}\b" for member in paths),
                            lambda found: paths[found[0]], error.detail) if paths else \
                error.detail
            remedy = _REMEDIES.get(error.reason, "").format(preprocess=self.preprocess_path)
            raise GenerateError(f"{error.reason}: {detail}" + (f": {remedy}" if remedy else ""),
                                exit_code=1) from None
        except TextError as error:
            raise GenerateError(f"the prompt cannot be tokenized: {error.detail}") from None


def _check_files(model_dir: str, files: dict[str, int]) -> None:
    """GenerateError (exit 1) naming each file of the export that is gone, and each weights
    file cut short (``manifest.json``'s ``files``; an export before that list is not checked):
    a copy interrupted, a file lost. A weights file of another size that safetensors reads
    whole (saved again in another dtype) loads; a text file (config, template, tokenizer) may
    be edited since, so only its presence is checked."""
    wrong = []
    for name, size in files.items():
        try:
            found = os.path.getsize(os.path.join(model_dir, name))
        except OSError:
            wrong.append(f"{name} is gone")
            continue
        if found != size and name.endswith(".safetensors") and \
                not _whole_safetensors(os.path.join(model_dir, name)):
            wrong.append(f"{name} is {found:,} bytes, mimo-export wrote {size:,}")
    if wrong:
        raise GenerateError(
            f"--model {model_dir} is not as mimo-export wrote it: {'; '.join(wrong[:5])}"
            f"{f' (and {len(wrong) - 5} more)' if len(wrong) > 5 else ''}. Copy it again from "
            "where it was exported, or export the checkpoint again", exit_code=1)


def _whole_safetensors(path: str) -> bool:
    """Whether safetensors opens ``path``: its header read and its tensors' extent equal to
    the file's length (safetensors checks both on open, reading no tensor)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, framework="pt"):
            return True
    except (SafetensorError, OSError):
        return False


def _load_errors() -> tuple[type[BaseException], ...]:
    """What loading a model folder raises when it cannot: OSError (a file missing),
    safetensors' error (a file that is not what its name says), ValueError (transformers: a
    config it cannot read, a model type it does not know; mimo: an encoder config that
    cannot work)."""
    from safetensors import SafetensorError
    return OSError, ValueError, SafetensorError


def _unloadable(model_dir: str, error: BaseException) -> GenerateError:
    """The GenerateError of an export whose model cannot be loaded: exit 1 with the advice
    of a damaged copy for a missing or unreadable file, else the cause (exit 2)."""
    from safetensors import SafetensorError

    import transformers

    from mimo_data.errors import ConfigError
    from mimo_train.errors import MimoTrainError
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, (OSError, SafetensorError)):
        return GenerateError(f"--model {model_dir} cannot be loaded ({detail}): the export "
                             "is damaged or incomplete; copy it again from where it was "
                             "exported, or export the checkpoint again", exit_code=1)
    if isinstance(error, (MimoTrainError, ConfigError)):
        return GenerateError(f"--model {model_dir}: {error}")
    return GenerateError(f"--model {model_dir} cannot be loaded by transformers "
                         f"{transformers.__version__} ({detail}): run mimo-generate with the "
                         "transformers version the export was made with (its config.json's "
                         "transformers_version)")


def _check_base(model_dir: str, adapters: dict) -> None:
    """The adapters' base holds the weights they were trained on: its digest is the one
    ``mimo-export --adapters`` recorded (an export without one is not checked)."""
    from mimo_train.components.digests import weights_digest
    if "sha256" not in adapters:
        return
    try:
        digest = weights_digest(adapters["base"])
    except (OSError, ValueError):          # not there: loading it says so
        return
    if digest != adapters["sha256"]:
        raise GenerateError(
            f"--model {model_dir} holds adapters trained on other weights than those of their "
            f"base {adapters['base']} now (manifest.json's adapters.sha256 differs from its "
            "weights'): the adapters alone would give another model. Restore that base, give "
            "the one they trained on with --base DIR, or export the run merged (mimo-export "
            "without --adapters)", exit_code=1)


def _with_adapters(model, model_dir: str):
    """``model`` under the PEFT adapters in ``model_dir`` (``mimo-export --adapters``)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise GenerateError(f"--model {model_dir} holds LoRA adapters, which need the peft "
                            "package: pip install 'mimo[lora]' (or export the run merged)"
                            ) from None
    import warnings
    with warnings.catch_warnings():                 # peft asks transformers' deprecated name
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return PeftModel.from_pretrained(model, model_dir)


def _history_of(path: str, parser: argparse.ArgumentParser) -> list:
    """The turns ``--history`` holds: a JSON list of turns, or a record's ``messages`` or
    ``conversations``; a usage error where it is neither."""
    try:
        with open(path, encoding="utf-8-sig") as file:
            found = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        parser.error(f"--history {path}: cannot be read as JSON ({exc})")
    from mimo_data.shards.records import RecordError, conversation_turns
    try:
        turns = conversation_turns(found) if isinstance(found, dict) else found
    except RecordError as error:
        parser.error(f"--history {path}: {error.detail}")
    if not isinstance(turns, list) or not turns:
        parser.error(f"--history {path} holds no turns: give a JSON list of turns "
                     "(role/content or from/value), or a record holding them as messages or "
                     "conversations")
    return turns


def _prompt_of(path: str, parser: argparse.ArgumentParser) -> str:
    """The prompt ``--prompt-file`` holds (standard input for ``-``), its last newline and a
    byte-order mark left out (an editor's); a usage error where it cannot be read or holds
    no text."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8-sig") as file:     # Notepad's byte-order mark
                text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--prompt-file {path}: cannot be read as UTF-8 text ({exc})")
    text = text.removesuffix("\n").removesuffix("\r")
    if not text.strip():
        parser.error(f"--prompt-file {path} holds no text: write the prompt in it")
    return text


def _history_turns(history: Sequence[dict], system: str | None) -> list[Message]:
    """The turns before the prompt as messages (``normalize_messages``: role/content or
    ShareGPT's from/value; typed parts made text, an image part its marker); GenerateError
    where the last is no answer, they are no conversation, or a system turn is given beside
    ``system`` or after the first turn."""
    from mimo_data.shards.records import ROLE_ALIASES, RecordError, normalize_messages
    if not history:
        return []
    last = history[-1]
    speaker = last.get("role", last.get("from")) if isinstance(last, dict) else None
    if ROLE_ALIASES.get(str(speaker).lower()) != "assistant":     # (said before the rest)
        raise GenerateError(f"the history ends with a {speaker} turn: it ends with the "
                            "assistant's answer, the prompt being the next user turn (put "
                            "that turn's text in the prompt)")
    try:
        turns = normalize_messages(list(history))
    except RecordError as error:
        raise GenerateError(f"the history: {error.detail}") from None
    roles = [turn["role"] for turn in turns]
    if "system" in roles[1:] or (system is not None and roles[0] == "system"):
        raise GenerateError("the history's system turn " + (
            "comes after its first turn" if "system" in roles[1:] else
            "and --system both give one: give one of them"))
    return cast("list[Message]", turns)


def _place_markers(prompt: str, files: dict, earlier: str = "") -> tuple[str, list[str]]:
    """The user turn's text (a marker in front for each file of a modality neither the
    prompt nor the turns before it, ``earlier``'s text, mark, in the order of ``files``) and
    the markers' modalities in order, the earlier turns' first; GenerateError if they mark
    some of a modality's files but not as many as were given (which file a marker meant
    would be a guess, as a partly marked record is to mimo-shard build)."""
    marked = _MARKER.findall(earlier + prompt)
    missing = {m: len(paths) - marked.count(m) for m, paths in files.items()}
    for modality, n in missing.items():
        if not files[modality] and n < 0:
            raise GenerateError(f"the prompt's <{modality}> marker(s) ask for {modality} input, "
                                f"and no --{modality} file is given: give it (--{modality} "
                                "FILE), or remove the marker")
        if n < 0 or (n and marked.count(modality)):
            raise GenerateError(
                f"the prompt has {marked.count(modality)} <{modality}> marker(s) for "
                f"{len(files[modality])} --{modality} file(s): mark each (the files take the "
                "markers in order), or none (each then goes in front of the prompt)")
    front = "".join(f"<{m}>\n" * n for m, n in missing.items())
    return front + prompt, _MARKER.findall(earlier + front + prompt)


def projection_module(kind: str, state: dict):
    """A module's projection of ``kind`` built as training builds it, with the exported
    ``state`` loaded."""
    from mimo_train.families.base import Projection
    if kind == "none":
        return Projection(0, 0, kind)           # the identity: no weights
    out_features, in_features = state["0.weight"].shape
    module = Projection(in_features, out_features, kind)
    module.load_state_dict(state)
    return module


if __name__ == "__main__":
    sys.exit(main())
