"""``mimo-export --checkpoint CKPT --output OUT``: a mimo_train checkpoint as transformers models.

``OUT`` holds::

    language/                  the language model as a transformers causal LM: weights,
                               config.json, generation_config.json and the tokenizer with the
                               modality tokens (AutoModelForCausalLM / AutoTokenizer load it)
    <module>/                  each encoder's transformers model (``save_pretrained`` of its
                               ``.model``; ``model.encoders.<module>.pretrained`` takes it back)
    projections.safetensors    each encoder module's projection: ``<module>.<index>.<param>``
                               (``<index>``: the layer in Linear or Linear-GELU-Linear)
    preprocess.yaml            the run's preprocessing config, its tokenizer ``./language``
    manifest.json              step, modules, encoder kinds, projection, modality tokens and ids

A run from a whole VLM (``model.pretrained``, ``families``) is written back as that VLM, in
``OUT`` itself: its transformers class (the checkpoint's ``config.json`` in its own layout,
flat or nested, its keys exactly, with the new vocabulary size and dtype values, the trained
weights under the checkpoint's own names), the tokenizer, the checkpoint's processor config
files with the run's pixel budgets and frame sampling and generation config, plus
``preprocess.yaml`` (tokenizer ``.``) and ``manifest.json`` (``"vlm": family``). A chat
template of the run's own is in every template file. It must hold the tower, the family's
projection and the language model only (no other encoder module).

Dtype: ``--dtype``, else the base checkpoint's (its config's, ``text_config``'s where only it
names one; a spliced run's language model and each encoder their own ``pretrained``'s,
the projections the language model's), else the trained one; a tensor the base stores in
float32 in a 16-bit checkpoint stays float32. ``--adapters``: the trained dtype, or ``--dtype``.

A LoRA run (``model.lora``) is written with its adapters merged into the weights
(``model.lora.merged``); ``--adapters`` writes a whole VLM's adapters alone in PEFT's format
instead (``hf.adapters``).

The checkpoint is read only through ``components.checkpoint.load_weights`` (module name -> whole
tensors, global layer numbers) and its ``meta.json`` config. The language weights are mapped back
with ``families.causal_lm.to_hf``; the language model must come from ``model.language.pretrained``
(its config.json is copied, the vocabulary size set to the exported rows): a randomly initialized
one uses megatron-core's LayerNorm/GELU layers with biases, which no Llama config reproduces.

Vocabulary: megatron's embedding (and output layer) has the pretrained vocabulary or the
tokenizer's tokens (modality tokens included), padded to ``model.language.vocab_multiple``.
Rows up to ``len(tokenizer)`` (or the pretrained checkpoint's vocabulary, when larger) are
exported: the modality-token rows are kept and the saved tokenizer has those tokens, at the
same ids; the padding rows past them, which no token id reaches, are dropped. The pretrained
rows come back bit for bit when the language model was frozen (``model.freeze: [language]``).

Everything is written to a staging directory beside ``OUT`` and renamed to ``OUT`` once
complete: an interrupted export leaves no ``OUT``. Its files and folders get the modes new ones
get under the process umask (safetensors writes its files private, 0600). Exit codes: 0
written; 1 the checkpoint's data failed a check (rank files or weights missing, shapes that do
not fit); 2 usage or config error (no such checkpoint, ``OUT`` in the way, a config that cannot
be rebuilt). Nothing heavy is imported before the arguments are parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

from mimo_data.errors import listed
from mimo_data.arguments import Parser, user_path
from mimo_data.hub import cache_only
from mimo_data.interrupts import Terminated, sigterm_as_interrupt
from mimo_data.stdout import quiet_when_stdout_closes
from mimo_train.errors import CheckpointError, ExportError, IntegrityError
from mimo_train.hf.processor_files import (PROCESSOR_FILES, copy_processor, name_processor,
                                           save_tokenizer, write_generation_config,
                                           write_tokenizer)

PREFIX = "mimo-export: "
MANIFEST = "manifest.json"
PREPROCESS = "preprocess.yaml"
PROJECTIONS = "projections.safetensors"
LANGUAGE_DIR = "language"
# weights of the checkpoint no mimo module holds, written back as the checkpoint has them
NOT_BUILT = ("mtp.",)
DTYPES = ("float32", "bfloat16", "float16")
# the names train.precision and mimo-generate use
SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mimo-export", description="Write a mimo_train checkpoint as transformers models: "
        "the language model with its tokenizer, each encoder, the projections, the "
        "preprocessing config and a manifest (mimo-generate runs the result).",
        epilog="Exit codes: 0 written, 1 the checkpoint's data failed a check, 2 usage or "
        "config error, 130 Ctrl-C and 143 SIGTERM (nothing written).")
    parser.add_argument("--checkpoint", type=user_path, required=True, metavar="CKPT_DIR",
                        help="a step_* directory written by mimo_train, or a checkpoint.dir "
                        "(its latest checkpoint is exported)")
    parser.add_argument("--output", type=user_path, required=True, metavar="OUT",
                        help="directory to create (it must not exist); written in a staging "
                        "directory beside it and renamed when complete")
    parser.add_argument("--adapters", action="store_true",
                        help="a LoRA run of a whole VLM: write its adapters alone in PEFT's "
                        "format (peft.PeftModel.from_pretrained(base, OUT)) instead of the "
                        "model with the adapters merged into its weights")
    parser.add_argument("--dtype",                    # export() checks it, either spelling
                        help="the weights' dtype, float32|bfloat16|float16 (or fp32|bf16|fp16, "
                        "as train.precision and mimo-generate name them; default: the base "
                        "checkpoint's, as its config.json names it; a LoRA run's --adapters: "
                        "the trained one)")
    parser.add_argument("--base", type=user_path, metavar="DIR",
                        help="where the run's model.pretrained is now, moved since the run "
                        "(its tokenizer too where the run read it there); checked as the "
                        "recorded one: its weights' digest for --adapters, its weights' names "
                        "and shapes for a merged export")
    return parser


@quiet_when_stdout_closes
def main(argv=None) -> int:
    cache_only()
    args = _parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():         # the staging folder removed either way
            written = export(args.checkpoint, args.output, adapters=args.adapters,
                             dtype=args.dtype, log=lambda line: print(f"{PREFIX}{line}"),
                             base=args.base)
    except ExportError as error:
        print(f"{PREFIX}{error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt as stop:        # one line, not the traceback of where it was
        terminated = isinstance(stop, Terminated)
        print(f"{PREFIX}{'terminated' if terminated else 'interrupted'}: " + (
            f"after {args.output} was written" if os.path.isdir(args.output) else
            f"nothing written to {args.output}; run it again"), file=sys.stderr)
        return 143 if terminated else 130
    print(f"{PREFIX}wrote {written}")
    return 0


def step_directory(path: str) -> str:
    """The checkpoint directory ``path`` names: itself (a step_* directory) or the latest one
    of a checkpoint.dir."""
    from mimo_train.checkpoint_folders import META, STEP_NAME, step_of
    if os.path.isfile(os.path.join(path, META)):
        return path
    try:
        found = step_of(path) if os.path.isdir(path) else path
    except CheckpointError as error:        # a latest that is empty or cannot be read
        raise ExportError(f"--checkpoint {path}: {error}{_steps_in(path)}",
                          exit_code=1) from None
    if found == path and os.path.isdir(path) and re.fullmatch(STEP_NAME, _name(path)):
        raise ExportError(f"--checkpoint {path} holds no meta.json: its save did not finish "
                          "(or is still under way: meta.json and integrity.json are written "
                          f"last); {_export_earlier(path)}", exit_code=1)
    if found == path:
        if os.path.isdir(path):
            _no_latest(path)
        what = ("is not there" if not os.path.exists(path) else "is not a directory"
                if not os.path.isdir(path) else "holds no meta.json nor latest")
        raise ExportError(f"--checkpoint {path} {what}: give a step_* directory or the "
                          f"checkpoint.dir of a mimo_train run{_steps_beside(path)}")
    if not os.path.isdir(found):
        raise ExportError(f"{path}'s latest file names {_name(found)}, which is not there (a "
                          f"folder copied without it, or a step removed){_steps_in(path)}",
                          exit_code=1)
    if not os.path.isfile(os.path.join(found, META)):
        from mimo_train.checkpoint_folders import damaged
        raise _damaged(found, damaged(found, f"it holds no {META} (it is the latest of {path})"))
    return found


def _steps_in(root: str) -> str:
    """``; it holds step_... (export the newest with --checkpoint ...)``: the complete steps
    of the checkpoint.dir ``root``, for a message; empty where it holds none."""
    from mimo_train.checkpoint_folders import complete_steps
    steps = complete_steps(root) if os.path.isdir(root) else []
    if not steps:
        return ""
    return (f"; {root} holds {', '.join(steps[-3:])}{' (the last three)' if len(steps) > 3 else ''}"
            f": export the newest with --checkpoint {os.path.join(root, steps[-1])}")


def _steps_beside(path: str) -> str:
    """For a ``--checkpoint`` that is not there (a misspelt step): the complete steps of the
    checkpoint.dir that holds it, for a message; empty where there is none."""
    parent = os.path.dirname(os.path.normpath(path)) or "."
    return "" if os.path.exists(path) else _steps_in(parent)


def _no_latest(root: str) -> None:
    """ExportError for a run's checkpoint.dir ``root`` without ``latest``: its complete steps
    (a folder copied without it) named, the newest to export; or, in a run's folder
    (``checkpoint_owner.OWNER``) without one, that no checkpoint is saved there yet."""
    from mimo_train.checkpoint_folders import complete_steps
    from mimo_train.components.checkpoint_owner import OWNER
    steps = complete_steps(root)
    if steps:
        newest = os.path.join(root, steps[-1])
        raise ExportError(f"--checkpoint {root} holds {', '.join(steps[-3:])} but no 'latest' "
                          "file, which names the checkpoint a checkpoint.dir stands for: "
                          f"export the newest with --checkpoint {newest}, or another step_* "
                          "directory")
    if os.path.exists(os.path.join(root, OWNER)):
        raise ExportError(f"--checkpoint {root} is a run's checkpoint.dir with no checkpoint "
                          "saved yet (the first is saved at checkpoint.interval, and when the "
                          "run stops on a signal or at its end): export once one is saved")


def _refuse_a_step_folder(output: str) -> None:
    """ExportError where ``output``, or a folder above it, is a step of a checkpoint.dir (as
    given, or through the links on its way): a run saving that step replaces it, and
    checkpoint.keep_last's pruning removes it with the step, unsaid."""
    from mimo_train.checkpoint_folders import LATEST, STEP_NAME, complete_steps
    for given in dict.fromkeys([output, os.path.realpath(output)]):
        step = given
        while os.path.dirname(step) != step:
            root = os.path.dirname(step)
            if re.fullmatch(STEP_NAME, os.path.basename(step)) and os.path.isdir(root) and (
                    os.path.lexists(os.path.join(root, LATEST)) or complete_steps(root)):
                raise ExportError(
                    f"--output {output} " + (
                        f"is a step's name in the checkpoint.dir {root}: a run saving that "
                        "step there would replace the export" if step == given else
                        f"is inside {step}, a step of the checkpoint.dir {root}: a run's "
                        "checkpoint.keep_last removes it with the step") +
                    "; export to a folder of its own")
            step = root


def export(checkpoint: str, output: str, adapters: bool = False, dtype: str | None = None,
           log=None, base: str | None = None) -> str:
    """Write ``checkpoint`` (see ``step_directory``) to the new directory ``output``, a LoRA
    run's adapters merged into its weights (``adapters``: the adapters alone, in PEFT's
    format), in ``dtype`` (None: the base checkpoint's, see ``_export_dtype``); ``log``
    takes the line saying which dtype was written; ``base``: where the run's model.pretrained
    is now. Returns ``output``."""
    dtype = SHORT.get(dtype, dtype) if dtype is not None else None
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: give one of {', '.join(DTYPES)} (or "
                          f"{', '.join(SHORT)})")
    output = os.path.abspath(output)
    if os.path.islink(output) and not os.path.exists(output):
        raise ExportError(f"--output {output} is a link to {os.readlink(output)}, which is "
                          "not there: remove the link, or give the path of a directory to "
                          "create (the export's)")
    if os.path.lexists(output) and not os.path.isdir(output):    # a file of the user's
        raise ExportError(f"--output {output} is a file: give the path of a directory to "
                          "create (the export's)")
    if os.path.lexists(output):
        raise ExportError(f"--output {output} exists: remove it (even an empty folder: the "
                          "export is renamed into place when complete) or choose another "
                          "directory")
    directory = step_directory(checkpoint)
    parent = os.path.dirname(output)
    _refuse_a_step_folder(output)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        from mimo_data.files import file_in_the_way
        in_the_way = file_in_the_way(parent)
        raise ExportError(f"--output {output}: " + (
            f"{in_the_way} is a file, not a folder; give another path" if in_the_way else
            f"its folder {parent} cannot be made: {error}")) from None
    if log is not None:
        for left in _unfinished(output):
            log(f"note: {left} is left by an export to {output} that did not finish (killed, "
                "or the machine stopped): remove it (rm -r) unless one runs now")
    with _gone_said(directory, checkpoint):
        plan, meta = _run_plan(directory, base)
    cfg = plan.config
    if adapters and not (cfg.model.lora and cfg.model.pretrained):
        raise ExportError(f"--adapters: {directory} is not a LoRA run of a whole VLM "
                          "(model.lora and model.pretrained): export it without --adapters")
    base_digest = _adapters_base(cfg, meta, directory, log, base is not None) if adapters \
        else None
    with _gone_said(directory, checkpoint):
        _check_saved(directory)
        weights = _weights(directory)
    if cfg.model.lora and not adapters:
        from mimo_train.model.lora import merged
        weights = {name: merged(name, state, plan.adapted) for name, state in weights.items()}
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging
    disable_progress_bars()                              # a bar per saved model otherwise
    transformers_logging.disable_progress_bar()
    from mimo_data.errors import ConfigError
    from mimo_train.errors import TrainConfigError
    from mimo_train.errors import EncoderBuildError
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.", dir=parent)
    try:
        written = _write(staging, plan, weights, meta["step"], directory, adapters, dtype,
                         base_digest, base is not None)
        _as_created(staging)
        try:
            os.rename(staging, output)
        except OSError:
            if not os.path.lexists(output):
                raise
            raise ExportError(f"--output {output} was made while this export was written "
                              "(another mimo-export to the same --output?); this export is "
                              "removed and what is there left as it is: look at what it holds, "
                              "or export to another --output") from None
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, (ConfigError, TrainConfigError, EncoderBuildError)):
            raise ExportError(f"{directory}/meta.json: the run's model cannot be rebuilt "
                              f"({error}); make the paths its config names exist again"
                              ) from None
        raise
    if log is not None:
        log(f"weights in {written}")
        if plan.vlm is not None and not any(os.path.isfile(os.path.join(output, name))
                                            for name in PROCESSOR_FILES):
            files = " or ".join(PROCESSOR_FILES)
            log(f"note: the base {plan.vlm.path} has no processor file ({files}), so neither "
                f"has {output}: AutoProcessor.from_pretrained fails on it; copy the processor "
                "files of the model the base was made from into it (the run preprocessed as "
                "its preprocessing config says)")
    return output


def _weights(directory: str) -> dict:
    """The step's saved weights; ExportError naming what is wrong with a damaged step."""
    from mimo_train.components.checkpoint import load_weights
    try:
        return load_weights(directory)
    except CheckpointError as error:
        if not error.what:
            raise ExportError(f"{directory}: {error}", exit_code=1) from None
        raise _damaged(directory, error) from None
    except OSError as error:
        raise ExportError(f"{directory}: {error}", exit_code=1) from None


def _damaged(directory: str, error: CheckpointError) -> ExportError:
    """A damaged step (``checkpoint_folders.damaged``'s error) said with the step to export
    instead."""
    return ExportError(f"checkpoint {directory} is damaged: {error.what}; " + (
        f"export the newest {_beside(directory)} instead: mimo-export --checkpoint "
        f"{error.earlier}" if error.earlier else "no earlier checkpoint is beside it to "
        "export: restore it from a copy"), exit_code=1)


def _beside(directory: str) -> str:
    """What the newest readable step beside ``directory`` is to it."""
    from mimo_train.checkpoint_folders import STEP_NAME
    return "earlier one" if re.fullmatch(STEP_NAME, _name(directory)) else "one beside it"


def _export_earlier(directory: str) -> str:
    """What to export instead of a step whose save did not finish: the newest complete one
    beside it, or this one once saved."""
    from mimo_train.checkpoint_folders import earlier_steps
    earlier = earlier_steps(directory)
    return (f"export the newest {_beside(directory)}: mimo-export --checkpoint {earlier[0]}, or "
            "this one once its run has saved it" if earlier else
            "export it once its run has saved it (no complete step is beside it)")


def _check_saved(directory: str) -> None:
    """ExportError where the step's save has not finished: its manifest is its last file."""
    from mimo_train.checkpoint_folders import MANIFEST as LAST
    if not os.path.isfile(os.path.join(directory, LAST)):
        raise ExportError(f"{directory} holds no {LAST}: its save did not finish (or is still "
                          f"under way: {LAST} is written last, once every file is hashed); "
                          f"{_export_earlier(directory)}", exit_code=1)


def _name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


@contextlib.contextmanager
def _gone_said(directory: str, given: str) -> Iterator[None]:
    """Whatever reading the step ``directory`` (of ``--checkpoint given``) raises becomes an
    ExportError saying so where the step was removed meanwhile: a run still saving there
    removes older steps (``checkpoint.keep_last``). Torch's CheckpointException of a file
    gone is a BaseException."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        if os.path.isdir(directory):
            raise
        latest = given if os.path.normpath(given) != os.path.normpath(directory) else \
            os.path.dirname(os.path.normpath(directory))
        raise ExportError(f"{directory} was removed while it was exported (a run still saving "
                          "to its checkpoint.dir, whose checkpoint.keep_last removes older "
                          f"steps?): export again (--checkpoint {latest} takes the latest), or "
                          "a step that run keeps", exit_code=1) from None


def _adapters_base(cfg, meta: dict, directory: str, log, base_given: bool) -> str | None:
    """The digest of ``model.pretrained``'s weights, which the adapters alone are exported
    onto, once checked to be those the run trained on (its meta.json's ``lora_base``); None
    for a checkpoint saved before runs recorded it (``log`` says so). The adapters alone are
    the trained model only on that base: a run whose fixed weights came from elsewhere
    (``model.init_from``, another ``pretrained``), or a base changed since, is refused
    (``base_given``: as ``--base``, which moved it)."""
    from mimo_train.components.digests import weights_digest
    from mimo_train.model.lora import bases
    others = [(key, path) for key, path in bases(cfg) if key != "model.pretrained"]
    if others:
        key, path = others[0]
        raise ExportError(f"--adapters: the run's fixed weights came from {key} {path}, not "
                          f"only from model.pretrained {cfg.model.pretrained}, which the "
                          "adapters alone would be loaded onto: export it merged (without "
                          "--adapters)")
    recorded = next((base for base in meta.get("lora_base") or ()
                     if base.get("key") == "model.pretrained"), None)
    try:
        digest = weights_digest(cfg.model.pretrained)
    except (OSError, ValueError) as error:
        raise ExportError(f"--adapters: the base model.pretrained {cfg.model.pretrained} "
                          f"cannot be read ({error}): restore it, or export the run merged "
                          "(without --adapters)", exit_code=1) from None
    if recorded is None:
        if log is not None:
            log(f"note: {directory}/meta.json records no digest of the base (saved before "
                "runs did): the base's weights were not checked against the trained ones")
        return digest
    if digest != recorded["sha256"]:
        named = _base_named(cfg.model.pretrained, base_given)
        raise ExportError(f"--adapters: {named if base_given else 'the base ' + named} "
                          f"is not the one the run trained on (its weights' sha256 is "
                          f"{digest[:12]}…, meta.json's lora_base recorded "
                          f"{recorded['sha256'][:12]}…): the adapters alone would give another "
                          "model. " + (
                              "Give --base the model the run started from" if base_given else
                              "Restore that base (a hub name's cache may now hold another "
                              "revision of it), or give where it is now with --base DIR") +
                          ". A merged export (without --adapters) takes the trained weights "
                          "from the checkpoint and only the config from the base: another "
                          "revision of the base (the same weights' names and shapes) does for "
                          "it", exit_code=1)
    return digest


def _as_created(top: str) -> None:
    """``top`` and everything under it with the mode a new file or folder gets under the
    process umask: mkdtemp's folder and safetensors' files are private (0700, 0600), which
    would hide the export from the other users a shared output folder is for."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(top, 0o777 & ~umask)
    for folder, folders, files in os.walk(top):
        for name in folders:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _run_plan(directory: str, base: str | None = None):
    """The run's plan (its config resolved with its preprocessing config) and meta.json;
    ``base``: where its model.pretrained is now."""
    from mimo_train.checkpoint_folders import META, damaged
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import resolve
    path = os.path.join(directory, META)
    try:
        with open(path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise ValueError("not the JSON object saved, with the run's config")
    except ValueError as error:                 # cut short or changed since the save
        raise _damaged(directory, damaged(directory, _meta_damage(directory) or
                                          f"{path} is unreadable ({error})")) from None
    except OSError as error:
        raise ExportError(f"{path}: {error}", exit_code=1) from None
    try:
        saved = copy.deepcopy(meta.get("preprocess"))    # before --base moves it
        if base is not None:
            _moved(meta, base, path)
        cfg = TrainConfig.from_dict(meta["config"])
        return resolve(cfg, _preprocess_config(cfg, directory, meta.get("preprocess"),
                                               saved)), meta
    except (OSError, ValueError, KeyError) as error:
        code = 2 if isinstance(error, TrainConfigError) else 1
        raise ExportError(f"{path}: cannot rebuild the run's config ({error}); " + (
            f"--base {base} is not the run's model.pretrained, moved: give the folder it is "
            "now (the same model, its files as the run read them)" if code == 2 and base
            else "make the paths it names exist again (a model.pretrained moved since: give "
            "where it is now with --base DIR)" if code == 2 else
            "the checkpoint is damaged: export another step"), exit_code=code) from None


def _meta_damage(directory: str) -> str | None:
    """What the step's manifest says is wrong with its meta.json (truncated, changed), None
    where it says nothing (no manifest, or none that reads)."""
    from mimo_train.checkpoint_folders import META
    from mimo_train.components.digests import mismatches, read_manifest
    try:
        expected, sizes = read_manifest(directory)
    except IntegrityError:
        return None
    found = mismatches(directory, [META], expected, sizes) if META in expected else []
    return found[0] if found else None


def _moved(meta: dict, base: str, path: str) -> None:
    """``meta``'s config with model.pretrained at ``base``, and each setting that named the
    same folder (the language model's, the preprocessing's tokenizer) with it."""
    model = meta["config"].get("model") or {}
    before = model.get("pretrained")
    if not before:
        raise ExportError(f"--base: {path}'s run has no model.pretrained (a whole VLM) to "
                          "move: leave --base out")
    same = os.path.abspath(before)
    model["pretrained"] = base
    language = model.get("language") or {}
    if language.get("pretrained") and os.path.abspath(language["pretrained"]) == same:
        language["pretrained"] = base
    trained = meta.get("preprocess") or {}
    if trained.get("tokenizer") and os.path.abspath(trained["tokenizer"]) == same:
        trained["tokenizer"] = base


def _preprocess_config(cfg, directory: str, trained: dict | None, saved: dict | None):
    """The run's preprocessing config: as it trained (meta.json's copy, ``trained``, its
    tokenizer moved with ``--base``; the YAML may have changed or moved since the run saved
    it as ``saved``, which is said), else, for checkpoints saved before the copy, its YAML as
    it is now."""
    from mimo_data.errors import ConfigError, UnreadableConfig
    from mimo_data.preprocess.config import PreprocessConfig
    path = cfg.data.preprocess
    if trained is not None and saved is not None:      # both or neither: meta.json's copy
        config = PreprocessConfig.from_dict(trained)
        try:          # a tokenizer moved with --base is gone from where the YAML names it
            before = PreprocessConfig.from_dict(saved)
            changed = _as_saved(PreprocessConfig.from_yaml(path, paths_exist=False), path,
                                before) != before
        except ConfigError:
            changed = True
        if changed:
            print(f"mimo-export: {path} is not as the run trained with it (changed or gone "
                  f"since): the export takes the run's own copy, from {directory}/meta.json",
                  file=sys.stderr)
        return config
    try:
        return PreprocessConfig.from_yaml(path)
    except UnreadableConfig as error:
        raise ExportError(f"the preprocessing config {path} of {directory}/meta.json cannot be "
                          f"read ({error}): the export copies it; restore it") from None
    except ConfigError as error:
        raise ExportError(f"the preprocessing config {path} of {directory}/meta.json is not "
                          f"one this mimo reads ({error}): the export copies it; fix it where "
                          "it is") from None


def _as_saved(config, path: str, saved):
    """``config`` (read from the YAML ``path`` without its paths checked) with a tokenizer or
    chat_template read as the run read it, ``saved``'s path, where the YAML's value is that
    path against its folder: gone, a ``models/tok`` cannot be told from a hub name."""
    folder = os.path.dirname(os.path.abspath(path))
    same = {key: getattr(saved, key) for key in ("tokenizer", "chat_template")
            if isinstance(value := getattr(config, key), str) and "\n" not in value
            and os.path.normpath(os.path.join(folder, os.path.expanduser(value)))
            == getattr(saved, key)}
    return dataclasses.replace(config, **same)


def _write(out: str, plan, weights: dict, step: int, directory: str, adapters: bool,
           dtype: str | None, base_digest: str | None = None, base_given: bool = False) -> str:
    """The export in ``out`` (``base_digest``: the adapters' base's, for the manifest;
    ``base_given``: model.pretrained moved by ``--base``); returns which dtype its weights
    were written in."""
    from mimo_data.loading.layout import LANGUAGE
    from mimo_data.preprocess.chat_tokens import load_tokenizer

    cfg, preprocess = plan.config, plan.preprocess

    tokenizer = load_tokenizer(preprocess, shared=False)       # its template is set below
    template = _run_template(plan, tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    for name in [LANGUAGE, *plan.encoders]:
        if name not in weights:
            raise ExportError(f"{directory} has no weights for module {name!r} (it has "
                              f"{listed(sorted(weights))}): the checkpoint is incomplete",
                              exit_code=1)
    manifest: dict = {"step": step, "checkpoint": os.path.abspath(directory),
                      "preprocess": PREPROCESS}
    if cfg.model.pretrained:                # a whole VLM, written back as its own class
        family, written = _write_vlm(out, plan, tokenizer, weights, directory, adapters,
                                     dtype, template, base_given)
        if adapters:
            manifest["adapters"] = {"base": cfg.model.pretrained,
                                    **({"sha256": base_digest} if base_digest else {})}
        _write_preprocess(os.path.join(out, PREPROCESS), preprocess, ".")
        manifest.update(vlm=family, modules={}, language=".")
    else:
        language = _write_language(os.path.join(out, LANGUAGE_DIR), plan, tokenizer,
                                   weights[LANGUAGE], directory, dtype)
        modules, encoders = _write_encoders(out, plan, weights, directory, dtype, language)
        written = f"language {_described(language)}; " + "; ".join(
            f"{name} {_described(chosen)}" for name, chosen in encoders.items()) + (
            f"; projections {str(language[0]).removeprefix('torch.')}" if encoders else "")
        _write_preprocess(os.path.join(out, PREPROCESS), preprocess, f"./{LANGUAGE_DIR}")
        kinds = {module["projection"] for module in modules.values()}
        # (one kind for all: also at the top, where a mimo-generate before per-module kinds
        # reads it)
        manifest.update(language=LANGUAGE_DIR, projections=PROJECTIONS, modules=modules,
                        **({"projection": kinds.pop()} if len(kinds) == 1 else {}))
    manifest["modality_tokens"] = {name: {"token": m.token,
                                          "id": tokenizer.convert_tokens_to_ids(m.token)}
                                   for name, m in preprocess.modalities.items()}
    manifest["files"] = written_files(out)
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return written


def written_files(out: str) -> dict[str, int]:
    """Every file of the export ``out`` but its manifest, by path relative to it: its size in
    bytes, which ``mimo-generate`` checks before loading (a file lost or cut short in a copy is
    named, not a loader's traceback)."""
    files = {}
    for folder, _, names in os.walk(out):
        for name in names:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, out)
            if relative != MANIFEST:
                files[relative] = os.path.getsize(path)
    return dict(sorted(files.items()))


def _run_template(plan, tokenizer) -> str | None:
    """The chat template the run trained with where it is its own (``chat_template:`` in
    its preprocessing config), None where it is the base's: the tokenizer's, its
    processor's, or the base's with mimo's generation blocks (``templates.copy_of``)."""
    from mimo_data.preprocess.tokenizer_loading import chat_template
    preprocess = plan.preprocess
    if preprocess.mode != "chat" or not preprocess.chat_template:
        return None
    template = chat_template(preprocess, tokenizer)
    if plan.vlm is not None:
        from mimo_train.families.base import model_directory
        from mimo_data.preprocess.templates import copy_of
        bases = [tokenizer.chat_template]
        if (copy := copy_of(tokenizer.chat_template)) is not None:
            bases.append(copy.read_text())
        directory = model_directory(plan.vlm.path)
        for name in ("chat_template.jinja", "chat_template.json"):
            if os.path.isfile(os.path.join(directory, name)):
                with open(os.path.join(directory, name)) as f:
                    text = f.read()
                bases.append(text if name.endswith(".jinja")
                             else json.loads(text).get("chat_template"))
        if template in bases:
            return None
    return template


def _config_dtype(pretrained: str | None) -> str | None:
    """The dtype a checkpoint's ``config.json`` names: at its top level, else in its
    ``text_config`` (Qwen3-VL's, Qwen3.5's); None where it names none."""
    if not pretrained:
        return None
    from mimo_train.families.base import model_directory
    try:
        with open(os.path.join(model_directory(pretrained), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if section.get(key) in DTYPES:
                return section[key]
    return None


def _export_dtype(chosen: str | None, pretrained: str | None, trained) -> tuple:
    """The dtype to write and why: ``--dtype``, else the base checkpoint's, else the trained
    weights' (a base naming none)."""
    import torch
    if chosen:
        return getattr(torch, chosen), "--dtype"
    base = _config_dtype(pretrained)
    if base:
        dtype = getattr(torch, base)
        trained_name = str(trained).removeprefix("torch.")
        narrower = dtype.itemsize < trained.itemsize      # a trained update may round away
        return dtype, "the base checkpoint's" + (
            f"; trained in {trained_name}: --dtype {trained_name} keeps it" if narrower else "")
    return trained, "the trained weights', the base names none"


def _described(chosen: tuple) -> str:
    return f"{str(chosen[0]).removeprefix('torch.')} ({chosen[1]})"


def _cast(hf: dict, dtype, checkpoint=None) -> list[str]:
    """``hf``'s floating tensors in ``dtype``, but those ``checkpoint`` stores in float32
    while ``dtype`` is 16-bit (Qwen3.5's ``A_log``, kept in float32 as published); returns
    the names kept so."""
    import torch
    kept = []
    for name, tensor in hf.items():
        if not tensor.is_floating_point():
            continue
        target = dtype
        if (checkpoint is not None and name in checkpoint and dtype.itemsize == 2
                and checkpoint.files[name].get_slice(name).get_dtype() == "F32"):
            target = torch.float32
            kept.append(name)
        hf[name] = tensor.to(target)
    return kept


def _language_weights(plan, tokenizer, state: dict, directory: str,
                      base_given: bool = False) -> tuple[dict, int]:
    """The language model's transformers weights (the checkpoint's names) and vocabulary
    (``base_given``: its config read from ``--base``)."""
    from mimo_train.families.causal_lm import to_hf
    from mimo_train.families.registry import language_arch
    pretrained = plan.language.pretrained
    if not pretrained:
        raise ExportError(f"{directory}: the language model was initialized at random "
                          "(no model.language.pretrained): its megatron-core layers (LayerNorm, "
                          "GELU, biases) have no transformers Llama equivalent; export a run "
                          "that starts from a transformers checkpoint")
    arch = language_arch(pretrained)
    if plan.language.mrope_section and plan.vlm is None:
        raise ExportError(f"{directory}: the language model takes M-RoPE positions "
                          "(model.language.mrope_section), which the exported causal LM "
                          f"({arch.family}) would drop: start from a whole VLM "
                          "(model.pretrained), which is exported as one")
    rows = max(arch.vocab_size, len(tokenizer))
    embedding = state.get("embedding.word_embeddings.weight")
    movable = plan.vlm is not None     # --base moves a whole VLM's folder, not a causal LM's
    named = _base_named(pretrained, base_given) if movable else \
        f"model.language.pretrained {pretrained}"
    if embedding is not None and len(tokenizer) <= embedding.size(0) < arch.vocab_size:
        raise ExportError(
            f"{directory}: {named} holds another model than the run trained (its config's "
            f"vocab_size {arch.vocab_size}, the run's embedding {embedding.size(0)} rows): the "
            f"export takes its config from there: {_put_back(base_given, movable)}",
            exit_code=1)
    if embedding is None or embedding.size(0) < rows:
        raise ExportError(f"{directory}: the language embedding has "
                          f"{None if embedding is None else embedding.size(0)} rows, fewer than "
                          f"the {rows} tokens to export", exit_code=1)
    try:
        return to_hf([state], arch, vocab_rows=rows), rows
    except KeyError as error:        # the config read now asks for weights the run never had
        raise ExportError(
            f"{directory}: the run's language weights have no {error}, which the config of "
            f"{named} ({arch.family}) calls for: that path holds another model than the run "
            f"trained{'' if base_given else ' (replaced since the run?)'}. The export takes its "
            f"config from there: {_put_back(base_given, movable)}", exit_code=1) from None


def _write_vlm(out: str, plan, tokenizer, weights: dict, directory: str, adapters: bool,
               dtype: str | None, template: str | None,
               base_given: bool = False) -> tuple[str, str]:
    """The whole VLM of ``model.pretrained`` with the trained weights, as its transformers
    class (config, weights in the checkpoint's names, in ``dtype`` or the checkpoint's,
    tokenizer, processor config, generation config), or (``adapters``) its LoRA adapters in
    PEFT's format (in ``dtype`` or the trained one) beside the tokenizer and processor files;
    returns its family and which dtype was written."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    from mimo_data.loading.layout import LANGUAGE
    from mimo_train.families.registry import ENCODERS
    vlm, layout = plan.vlm, plan.layout
    tower = {"image", *ENCODERS[vlm.encoder_kind].also_takes}    # what its one tower takes
    others = [m.name for m in layout.encoders
              if "image" not in layout.modalities_of(m.name)
              or not set(layout.modalities_of(m.name)) <= tower]
    if others:
        raise ExportError(f"{directory}: a {vlm.family} checkpoint holds its vision tower, "
                          f"{vlm.projection} projection and language model only, but the run "
                          f"has {others}: it cannot be written back as one")
    if adapters:
        from mimo_train.families.registry import language_arch
        from mimo_train.hf.adapters import write_adapters
        arch = language_arch(plan.language.pretrained)
        rows = max(arch.vocab_size, len(tokenizer))       # the rows a merged export writes
        if rows != arch.vocab_size:
            raise ExportError(f"--adapters: the run's vocabulary has {rows} rows, the base "
                              f"checkpoint's {arch.vocab_size}: the adapters alone do not give "
                              "the trained model; export it merged (without --adapters)")
        image = next(m.name for m in layout.encoders if "image" in layout.modalities_of(m.name))
        import torch
        chosen = (getattr(torch, dtype), "--dtype") if dtype else (
            next(v.dtype for v in weights["language"].values() if v.is_floating_point()),
            "the trained weights'")
        write_adapters(out, plan, weights, arch, image, directory, chosen[0])
        write_tokenizer(tokenizer, out, vlm.path, plan.preprocess)
        copy_processor(vlm.path, out, plan.preprocess, template)
        name_processor(out, vlm.path)
        return vlm.family, f"{_described(chosen)}: the adapters alone"
    checkpoint = vlm.weights()
    renames = vlm.checkpoint_names(checkpoint)
    towers = {theirs + key[len(ours):]: value for module in layout.encoders
              for key, value in weights[module.name].items()
              for ours, theirs in renames if key.startswith(ours)}
    # the tower first: a model of another size there fails on its projection, not on the
    # language embedding's rows
    _check_base(towers, checkpoint, vlm.path, base_given, directory)
    hf, rows = _language_weights(plan, tokenizer, weights[LANGUAGE], directory, base_given)
    # fused experts in the layout the checkpoint holds them (Qwen3-VL-MoE publishes them
    # transposed from transformers 5's in-memory layout, which causal_lm.to_hf gives)
    for name in [n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        if name in checkpoint and tuple(hf[name].shape) != checkpoint.shape(name):
            hf[name] = hf[name].transpose(1, 2).contiguous()
    _check_base(hf, checkpoint, vlm.path, base_given, directory)
    hf.update(towers)
    # the tower's weights the run did not hold (a LLaVA tower's layers past the one it reads),
    # as the checkpoint has them; the layers mimo does not build (Qwen3.5's multi-token
    # prediction, ``mtp.*``) bit for bit
    chosen = _export_dtype(dtype, vlm.path, hf[next(iter(hf))].dtype)
    hf.update({name: checkpoint(name) for name in checkpoint.files
               if name.startswith(renames[0][1]) and name not in hf})
    hf.update({name: checkpoint(name) for name in checkpoint.files
               if name.startswith(NOT_BUILT) and name not in hf})
    kept = _cast(hf, chosen[0], checkpoint)
    os.makedirs(out, exist_ok=True)
    save_torch_state_dict({k: v.clone() for k, v in hf.items()}, out)   # own storage
    _write_config_as_published(vlm.path, out, rows, str(chosen[0]).removeprefix("torch."))
    config = AutoConfig.from_pretrained(out)
    write_tokenizer(tokenizer, out, vlm.path, plan.preprocess)
    copy_processor(vlm.path, out, plan.preprocess, template)
    write_generation_config(out, vlm.path, config, tokenizer)
    return vlm.family, _described(chosen) + (
        f", {len(kept)} tensors in float32 as the base stores them" if kept else "")


def _unfinished(output: str) -> list[str]:
    """The staging folders of exports to ``output`` beside it (``export`` writes into one and
    renames it; one killed outright, SIGKILL or out of memory, leaves it, hidden)."""
    parent, name = os.path.split(output)
    staged = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}")
    return sorted(os.path.join(parent, entry) for entry in os.listdir(parent)
                  if staged.fullmatch(entry) and os.path.isdir(os.path.join(parent, entry)))


def _base_named(path: str, given: bool) -> str:
    """The export's base as the user gave it: ``--base PATH``, or the run's
    ``model.pretrained PATH``."""
    return f"--base {path}" if given else f"model.pretrained {path}"


def _put_back(base_given: bool, movable: bool) -> str:
    """What to do about a base that holds another model than the run trained: give the right
    one (``base_given``: with ``--base``; ``movable``: the folder is model.pretrained's, which
    ``--base`` moves)."""
    if base_given:
        return "give --base the model the run started from"
    return "put the model the run started from back at that path" + (
        ", or give where it is now with --base DIR" if movable else "")


def _check_base(hf: dict, checkpoint, base: str, base_given: bool, directory: str) -> None:
    """ExportError (exit 1) where the run's weights do not fit ``model.pretrained`` as it is
    now (``checkpoint``, at ``base``; ``base_given``: moved there by ``--base``): the export
    takes its config, and the weights the run did not hold, from there, so another model
    there (replaced since the run) would be mixed into it. A vocabulary the run grew is its
    embedding's and output layer's extra rows."""
    differ = []
    for name, value in hf.items():
        ours = tuple(value.shape)
        theirs = checkpoint.shape(name) if name in checkpoint else None
        grown = theirs is not None and name.endswith(("embed_tokens.weight", "lm_head.weight")) \
            and ours[1:] == theirs[1:] and ours[0] >= theirs[0]
        if theirs is None or (ours != theirs and not grown):
            differ.append(f"{name} {'not there' if theirs is None else f'{theirs} there'}, "
                          f"{ours} trained")
    if differ:
        raise ExportError(
            f"{directory}: {_base_named(base, base_given)} holds another model than the run "
            f"trained ({len(differ)} of its weights differ, e.g. {'; '.join(differ[:2])}): the "
            "export takes its config and the weights the run did not hold from there, and "
            f"would mix the two: {_put_back(base_given, movable=True)}", exit_code=1)


def _write_config_as_published(pretrained: str, out: str, vocab_rows: int, dtype: str) -> None:
    """The checkpoint's ``config.json`` in the layout it came in (flat as Qwen2-VL publishes
    it stays flat, nested stays nested, its keys exactly), the vocabulary size and dtype set
    where it keeps them. transformers' ``save_pretrained`` would write its own layout."""
    from mimo_train.families.base import model_directory
    with open(os.path.join(model_directory(pretrained), "config.json")) as f:
        config = json.load(f)
    sections = [config, *([config["text_config"]] if config.get("text_config") else [])]
    holders = [section for section in sections if "vocab_size" in section] or [sections[-1]]
    for section in holders:
        section["vocab_size"] = vocab_rows
    stored = next((section[key] for section in sections for key in ("torch_dtype", "dtype")
                   if key in section), dtype)
    if dtype != stored:     # every part's weights are in it: each sub-config says so too
        sections += [value for key, value in config.items()
                     if key.endswith("_config") and isinstance(value, dict)
                     and value is not config.get("text_config")]
    for section in sections:
        for key in ("torch_dtype", "dtype"):
            if key in section:
                section[key] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _write_language(out: str, plan, tokenizer, state: dict, directory: str,
                    dtype: str | None) -> tuple:
    """The language model as a causal LM in ``dtype`` (None: its base checkpoint's); returns
    the dtype written and why."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig

    hf, rows = _language_weights(plan, tokenizer, state, directory)
    pretrained = plan.language.pretrained
    chosen = _export_dtype(dtype, pretrained, state["embedding.word_embeddings.weight"].dtype)
    _cast(hf, chosen[0])
    config = AutoConfig.from_pretrained(pretrained)
    config.vocab_size = rows
    config.dtype = str(chosen[0]).removeprefix("torch.")
    os.makedirs(out)
    save_torch_state_dict({k: v.clone() for k, v in hf.items()}, out)   # own storage
    config.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    write_generation_config(out, pretrained, config, tokenizer)
    return chosen


def _write_encoders(out: str, plan, weights: dict, directory: str, dtype: str | None,
                    language: tuple) -> tuple[dict, dict]:
    """Each encoder module's transformers model, in ``dtype`` (None: its base checkpoint's),
    and projection, in the language model's dtype (``language``); the manifest's modules and
    each module's dtype written and why."""
    from safetensors.torch import save_file

    from mimo_train.families.registry import build_encoder
    from mimo_train.precision import cast
    modules, projections, written = {}, {}, {}
    for name, setting in plan.encoders.items():
        modality, kind, spec = setting.modality, setting.kind, setting.spec
        hidden, layers, heads = setting.dims
        encoder = build_encoder(kind, setting.config, hidden, layers, heads, spec.pretrained)
        state, prefix = weights[name], f"encoders.{modality}.encoder."
        written[name] = _export_dtype(dtype, spec.pretrained, next(
            v.dtype for k, v in state.items() if k.startswith(prefix)))
        cast(encoder, written[name][0])
        try:
            encoder.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                     if k.startswith(prefix)})
        except RuntimeError as error:
            raise ExportError(f"{directory}: the {name} encoder weights do not fit a {kind} "
                              f"encoder built from the run's config ({error})",
                              exit_code=1) from None
        encoder.model.save_pretrained(os.path.join(out, name))
        projection = "input_projections.0."
        projections.update({f"{name}.{k[len(projection):]}": v.to(language[0]).contiguous()
                            for k, v in state.items() if k.startswith(projection)})
        modules[name] = {"modality": modality, "also": list(setting.also), "kind": kind,
                         "path": name, "output_size": encoder.output_size,
                         "projection": setting.projection}
    save_file(projections, os.path.join(out, PROJECTIONS))
    return modules, written


def _write_preprocess(path: str, preprocess, tokenizer: str) -> None:
    """The preprocessing config with the exported ``tokenizer`` (which holds the chat
    template)."""
    import yaml
    data = json.loads(json.dumps(preprocess.to_dict()))        # tuples -> lists
    data.update(tokenizer=tokenizer, chat_template=None)
    with open(path, "w") as f:
        f.write("# Written by mimo-export: the run's preprocessing config, its tokenizer the "
                "exported one.\n")
        yaml.safe_dump(data, f, sort_keys=False)


if __name__ == "__main__":
    sys.exit(main())
