"""Whether a checkpoint fits this run, read from its index and ``meta.json`` alone (no
tensor, no collective: every rank checks in a start-up phase): the same modules, weights of the
same global shapes, the same global batch size, frozen parts and LoRA adapters and scale. A
refusal says in config terms what differs and what to do: resume with the checkpoint's
settings, or start a new run from its weights (``model.init_from``); a resume that fits but
reads its config otherwise than it may seem is said (``resume_notes``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mimo_data.errors import listed
from mimo_train.checkpoint_folders import damaged, read_meta
from mimo_train.errors import CheckpointError
from mimo_train.mcore import ShardedTensor, dist_checkpointing, nested_values
from mimo_train.model.lora import is_adapter
from mimo_train.plan.parts import ENCODER_PARTS


def check(directory: str, model, global_batch_size: int | None,
          freeze: Sequence[str] = (), settings: dict | None = None,
          precision: str | None = None) -> dict:
    """Checks that read no tensor and need no collective (every rank, a start-up phase): the
    checkpoint is complete, holds every weight of this rank's modules with the same global
    shape and, to resume (``global_batch_size`` given), was saved with that global batch size
    and ``precision`` (``train.precision``) by a run that froze no part this run's ``freeze``
    (``model.freeze``) trains; returns its meta. ``settings``: this run's ``model`` section
    (``TrainConfig.to_dict``), whose differences from the checkpoint's a refusal for another
    model names."""
    meta = read_meta(directory)
    if global_batch_size is not None and meta.get("global_batch_size") != global_batch_size:
        raise CheckpointError(
            f"checkpoint {directory} was saved with train.global_batch_size "
            f"{meta.get('global_batch_size')}, this run has {global_batch_size}: resuming the "
            "sample stream needs the same global batch size; to start a new run from its "
            f"weights use model.init_from={directory} and a new checkpoint.dir")
    saved_precision = ((meta.get("config") or {}).get("train") or {}).get("precision")
    if global_batch_size is not None and None not in (precision, saved_precision) and \
            saved_precision != precision:
        raise CheckpointError(
            f"checkpoint {directory} was saved by a train.precision {saved_precision} run, "
            f"this run's is {precision}: its optimizer state is kept for "
            f"{saved_precision} (bf16 keeps fp32 main weights beside the model's); resume "
            f"with train.precision {saved_precision}, or start a new run from its weights "
            f"(model.init_from={directory}) in another checkpoint.dir")
    try:
        saved = dist_checkpointing.load_tensors_metadata(directory)
    except Exception as error:        # whatever unpickling a damaged index raises
        raise damaged(directory, f"its tensor index is unreadable "
                                  f"({type(error).__name__}: {error})") from None
    sharded = list(nested_values(model.sharded_state_dict()))
    wanted = {t.key: t.global_shape for t in sharded if isinstance(t, ShardedTensor)}
    _check_modules(directory, model, saved, global_batch_size is not None)
    _check_adapters(directory, {t.key for t in sharded if hasattr(t, "key")} |
                    _numbered_layers(sharded), saved, meta, settings)
    if global_batch_size is None:          # init_from: adapters it lacks keep their init
        wanted = {k: v for k, v in wanted.items() if k in saved or not is_adapter(k)}
    _check_projections(directory, wanted, saved, meta)
    missing = sorted(set(wanted) - set(saved))
    if missing:     # before the freeze's check: LoRA newly on a part is said as itself
        raise _lacks(directory, missing, meta, sorted(_saved_modules(saved)), settings,
                     global_batch_size is not None)
    if global_batch_size is not None:
        _check_frozen(directory, meta, saved, freeze)
    for key, shape in wanted.items():
        if tuple(saved[key].global_shape) != tuple(shape):
            theirs = tuple(saved[key].global_shape)
            why = _why_shapes_differ(key, theirs, shape, meta, global_batch_size is not None)
            if why == ANOTHER:
                why += _model_changes(meta, settings, global_batch_size is not None)
            raise CheckpointError(f"checkpoint {directory} has {key} of shape {theirs}, this "
                                  f"model {tuple(shape)}: {why}")
    return meta


def check_lora_scale(directory: str, meta: dict, lora: dict, resume: bool = True) -> None:
    """A run resumed or started from a checkpoint (``resume`` false: ``model.init_from``)
    keeps its adapters' scale: its ``model.lora`` ``alpha`` of each part this run adapts
    (``lora``: part -> LoraConfig). The weights have the same shapes under another alpha, and
    ``alpha / rank * B A`` would give another model."""
    saved = ((meta.get("config") or {}).get("model") or {}).get("lora") or {}
    if not isinstance(saved, dict):
        return
    for part, spec in lora.items():
        # a part and one inside it hold the same layers' adapters (image, image.encoder)
        for other, settings in saved.items():
            theirs = settings.get("alpha") if isinstance(settings, dict) else None
            overlap = other == part or other.startswith(f"{part}.") or \
                part.startswith(f"{other}.")
            if overlap and theirs is not None and float(theirs) != float(spec.alpha):
                raise CheckpointError(
                    f"checkpoint {directory}'s adapters of {other} trained with "
                    f"model.lora.{other}.alpha {float(theirs):g}, this run's model.lora.{part}."
                    f"alpha is {spec.alpha:g}: the same weights would give another model (the "
                    f"adapters scaled by alpha / rank); " + (
                        f"resume with alpha {float(theirs):g}, or, for new adapters with "
                        "another alpha, start a new run in another checkpoint.dir from its "
                        "merged export (mimo-export) as model.pretrained (model.init_from "
                        "takes its alpha only)" if resume else
                        f"start from it with alpha {float(theirs):g}, or, for new adapters "
                        "with another alpha, from its merged export (mimo-export) as "
                        "model.pretrained"))


def _lacks(directory: str, missing: list[str], meta: dict, modules: list[str],
           settings: dict | None = None, resuming: bool = True) -> CheckpointError:
    """Why a checkpoint lacks weights this rank's modules have (``missing``), in config
    terms: adapters alone, another model.lora; else another model (``modules``: the
    checkpoint's; ``settings``: this run's model section)."""
    model = (meta.get("config") or {}).get("model", {})
    if all(is_adapter(key) for key in missing):
        saved = (f"it was saved with model.lora {model['lora']}, which adapts other parts or "
                 "targets; resume with the checkpoint's model.lora, or"
                 if model.get("lora") else "it was saved without LoRA adapters: to add them,")
        return CheckpointError(
            f"checkpoint {directory} lacks {len(missing)} LoRA adapter weight(s) of this run, "
            f"e.g. {missing[:3]}: {saved} start a new run from its weights (model.init_from) "
            "in another checkpoint.dir" + _lora_changes(meta, settings))
    added = sorted(_saved_modules(missing) - set(modules))
    if added:               # a module this run adds: no setting of the checkpoint's changed
        return _without_modules(directory, added, modules, resuming)
    pretrained = model.get("pretrained")
    changes = _model_changes(meta, settings, resuming)
    named = pretrained and "model.pretrained " not in changes     # else the changes name it
    return CheckpointError(
        f"checkpoint {directory} lacks {len(missing)} weight(s) of this rank's modules, e.g. "
        f"{listed(missing[:3])}: it was saved for another model (" + (
            f"model.pretrained {pretrained}, " if named else "") + f"its modules: {modules})"
        + changes)


def _model_changes(meta: dict, settings: dict | None, resuming: bool, shown: int = 4) -> str:
    """What a run whose model does not fit a checkpoint changed (``settings``: its model
    section; ``meta``: the checkpoint's) among the settings that make its tensors, the models
    first, and what it can do: resume (or start) with the checkpoint's settings, or train the
    other model in a checkpoint.dir of its own (from another checkpoint); "" without
    ``settings``."""
    saved = (meta.get("config") or {}).get("model")
    if settings is None or not isinstance(saved, dict):
        return ""
    theirs, ours = _flat(saved, "model."), _flat(settings, "model.")
    # keys both know (another mimo's config may have more or fewer), changed, making tensors
    changed = sorted((key for key in theirs.keys() & ours.keys()
                      if (theirs[key] or None) != (ours[key] or None)
                      and key not in _SHAPELESS and key.rpartition(".")[2] not in _SHAPELESS),
                     key=lambda key: (not key.endswith("pretrained"), key))
    then = ("resume with the settings it was saved with, or train this model in another "
            "checkpoint.dir" if resuming else "model.init_from takes a checkpoint of the same "
            "model: start with the settings it was saved with, or from another checkpoint")
    if not changed:
        return (". Its model settings are this run's: the files they name (a model folder's "
                "config.json, the tokenizer) changed since it was saved")
    said = "; ".join(f"{key} {theirs[key]!r} there, {ours[key]!r} here"
                     for key in changed[:shown])
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return f". The model settings that differ from the checkpoint's: {said}{more}: {then}"


# model settings that make no tensor of the model (whole keys, or the last part of one)
_SHAPELESS = {"model.init_from", "model.freeze", "model.attention", "recompute",
              "sequence_parallel", "moe_aux_loss", "loss_chunk_tokens", "alpha", "dropout",
              "init_lora_weights"}


def _flat(section: dict, prefix: str) -> dict[str, Any]:
    """A config section's values by dotted key (``model.language.hidden_size``)."""
    values: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, dict) and value:
            values.update(_flat(value, f"{prefix}{key}."))
        else:
            values[f"{prefix}{key}"] = value
    return values


ANOTHER = "it was saved for another model configuration"   # the reason no setting names


def _why_shapes_differ(key: str, theirs: tuple, ours, meta: dict, resuming: bool) -> str:
    """Why a checkpoint's tensor ``key`` has another shape than this model's, in config terms
    (``meta``: the checkpoint's, whose config names the part of an adapter; ``resuming``
    false: ``model.init_from``)."""
    if key.endswith(("word_embeddings.weight", "output_layer.weight")) and \
            theirs[1:] == tuple(ours)[1:]:
        return ("the vocabulary rows differ: another tokenizer, model.language.vocab_size or "
                "vocab_multiple, or a TP size that does not divide vocab_multiple; set "
                "model.language.vocab_size to the checkpoint's rows")
    if is_adapter(key):       # lora.a: ([layers,] rank, in); lora.b: ([layers,] out, rank)
        saved, wanted = (shape[-2] if ".lora.a." in key else shape[-1]
                         for shape in (theirs, tuple(ours)))
        if saved != wanted:
            module = (module_of(key) or ("",))[0]
            lora = ((meta.get("config") or {}).get("model") or {}).get("lora") or {}
            parts = [part for part, settings in lora.items() if isinstance(settings, dict)
                     and part.split(".")[0] == module and settings.get("rank") == saved]
            setting = f"model.lora.{parts[0]}.rank {saved}" if len(parts) == 1 else \
                f"{module}'s adapters at model.lora rank {saved}"
            return f"it was saved with {setting}, this run's is {wanted}: " + (
                "resume with the checkpoint's rank, or, for new adapters of another rank, "
                "start a new run in another checkpoint.dir from its merged export "
                "(mimo-export) as model.pretrained (model.init_from takes its rank only)"
                if resuming else
                f"start from it with rank {saved}, or, for new adapters of another rank, from "
                "its merged export (mimo-export) as model.pretrained, without model.init_from")
    return ANOTHER


def module_of(key: str) -> tuple[str, str] | None:
    """A checkpoint weight key's module and its key in the module
    (``language_model.module.<key>``: language, ``modality_submodules.<name>.module.<key>``:
    <name>, DDP's level); None for the optimizer's and other keys."""
    parts = key.split(".module.", 1)
    if len(parts) != 2 or key.startswith("optimizer."):
        return None
    module = parts[0].removeprefix("modality_submodules.")
    return ("language" if module == "language_model" else module), parts[1]


def _saved_modules(keys) -> set[str]:
    """The module names of a checkpoint's weight keys (``module_of``)."""
    return {found[0] for found in map(module_of, keys) if found is not None}


def _without_modules(directory: str, added: list[str], modules: list[str],
                     resuming: bool) -> CheckpointError:
    """The refusal of a checkpoint saved without this run's modules ``added`` (``modules``:
    the checkpoint's)."""
    return CheckpointError(
        f"checkpoint {directory} holds no weight of module(s) {', '.join(added)} of this "
        f"run's model (the checkpoint's modules: {', '.join(modules)}): it was saved by a "
        "run without them. " + (
            "Resume with the checkpoint's model.encoders and layout, or train this model "
            "in another checkpoint.dir" if resuming else
            "model.init_from takes a checkpoint of the same modules: start with the "
            "checkpoint's model.encoders and layout, or from another one"))


def _check_modules(directory: str, model, saved, resuming: bool) -> None:
    """To resume, the checkpoint holds the modules of this run's model and no other
    (whichever ranks hold them), said alike on every rank: a module it lacks is another
    run's checkpoint; one this run lacks would have its weights and optimizer state
    dropped."""
    config = getattr(model, "mimo_config", None)
    if not resuming or config is None:
        return
    ours = {"language", *config.modality_submodules_spec}
    theirs = _saved_modules(saved)
    if ours - theirs:
        raise _without_modules(directory, sorted(ours - theirs), sorted(theirs), resuming)
    extra = sorted(theirs - ours)
    if extra:
        raise CheckpointError(
            f"checkpoint {directory} holds module(s) {', '.join(extra)} that this run's model "
            f"lacks (the checkpoint's modules: {', '.join(sorted(theirs))}; this run's: "
            f"{', '.join(sorted(ours))}): resuming would drop their weights and optimizer "
            "state. Resume with a layout and model.encoders that have them, or start a new "
            f"run from the weights of the modules you keep: model.init_from={directory} and "
            "another checkpoint.dir")


def _check_projections(directory: str, wanted: dict, saved, meta: dict) -> None:
    """A projection the checkpoint holds for one of this rank's encoder modules that this
    run's model does not have (its kind none, or another's layers: a checkpoint saved with
    other ``model.projection`` / ``model.encoders.<module>.projection``) is refused: its
    trained weights would be dropped without a word."""
    ours = {found[0] for found in map(module_of, wanted) if found is not None}
    prefix = ENCODER_PARTS["projection"]
    extra = sorted((found[0], key) for key in saved if key not in wanted and (
        found := module_of(key)) is not None and found[0] in ours and
        found[1].startswith(prefix) and key.rpartition(".")[0] not in wanted)
    if extra:
        module = extra[0][0]
        model = (meta.get("config") or {}).get("model") or {}
        saved_with = {"model.projection": model.get("projection"),
                      f"model.encoders.{module}.projection":
                      ((model.get("encoders") or {}).get(module) or {}).get("projection")}
        raise CheckpointError(
            f"checkpoint {directory} holds projection weights of module {module!r} that this "
            f"run's model lacks, e.g. {[key for _, key in extra[:2]]}: it was saved with "
            f"another projection after that tower (its config: {saved_with}); give this run "
            f"the same projection (model.encoders.{module}.projection), or start a new run "
            f"from its weights (model.init_from={directory}) in another checkpoint.dir")


def _check_frozen(directory: str, meta: dict, saved, freeze: Sequence[str]) -> None:
    """To resume, no part the checkpoint's run froze (and holds weights of: a projection
    ``none`` has none) trains now, or is adapted: a frozen part has no optimizer state."""
    theirs = ((meta.get("config") or {}).get("model") or {}).get("freeze") or []
    held = _saved_modules(saved) | {
        f"{module}.{part}" for module, rest in filter(None, map(module_of, saved))
        for part, prefix in ENCODER_PARTS.items() if rest.startswith(prefix)}
    trained_now = [part for part in theirs if part in held and not any(
        part == ours or part.startswith(f"{ours}.") for ours in freeze)]
    if trained_now:
        raise CheckpointError(
            f"checkpoint {directory} was saved by a run with model.freeze {listed(theirs)}, "
            f"this run has {listed(freeze)}: {', '.join(trained_now)} would train (or be "
            "adapted), and a frozen part has no optimizer state to resume. Resume with that "
            f"model.freeze, or start a new run from its weights: model.init_from={directory} "
            "and another checkpoint.dir")


def resume_notes(meta: dict, settings: dict, freeze: Sequence[str]) -> list[str]:
    """What a resume that fits (``check``) takes otherwise than its config may suggest, to be
    said: a pretrained model other than the checkpoint's run had (the checkpoint's weights
    continue; the folder's config builds the model), parts frozen now that trained until the
    checkpoint (their optimizer state dropped, and no later resume trains them again), another
    LoRA dropout.
    ``settings``: this run's model section; ``meta``: the checkpoint's."""
    saved = (meta.get("config") or {}).get("model")
    if not isinstance(saved, dict):
        return []
    theirs, ours = _flat(saved, "model."), _flat(settings, "model.")
    notes = [f"{key} is {ours[key]} here, {theirs[key]} when the checkpoint was saved: the "
             "checkpoint's weights continue the run (the folder gives the model's config and "
             "files, of the same shapes)" for key in sorted(theirs.keys() & ours.keys())
             if key.rpartition(".")[2] == "pretrained" and _resolved(theirs[key]) !=
             _resolved(ours[key])]
    # a LoRA part's dropout (its weights the same): its adapters train so from here
    notes += [f"{key} is {ours[key]} here, {theirs[key]} when the checkpoint was saved: its "
              "adapters train with this dropout from here" for key in sorted(
                  theirs.keys() & ours.keys()) if key.startswith("model.lora.") and
              key.endswith(".dropout") and theirs[key] != ours[key]]
    then = saved.get("freeze") or []
    added = [part for part in freeze if not any(
        part == old or part.startswith(f"{old}.") for old in then)]
    if added:
        notes.append(f"model.freeze now holds {listed(added)}, which trained until this "
                     "checkpoint: frozen from here, their optimizer state dropped (a later "
                     "resume cannot train them again: model.init_from can)")
    return notes


def _resolved(path: Any) -> Any:
    """A model's path as the file system resolves it (a trailing slash, a link), a hub name or
    None as it is."""
    return os.path.realpath(path) if isinstance(path, str) and os.path.isabs(path) else path


def _numbered_layers(sharded: list) -> set[str]:
    """The keys of this rank's layers that megatron-core saves stacked (``decoder.layers.``
    + name, the layer the first axis), each as its own layer's (``decoder.layers.<i>.``):
    an adapter of some layers is saved so (``LoraParallelLinear.sharded_state_dict``)."""
    def stacked(key: str) -> bool:
        return ".layers." in key and not key.partition(".layers.")[2][:1].isdigit()
    # the rank's layers, read off its tensors' offsets (a factory, SwiGLU's linear_fc1, has
    # none: it is one of the same layers)
    held = {t.global_offset[0] for t in sharded if isinstance(t, ShardedTensor) and
            t.prepend_axis_num and stacked(t.key)}
    return {t.key.replace(".layers.", f".layers.{layer}.", 1) for t in sharded
            if hasattr(t, "key") and stacked(t.key) for layer in held}


def _lora_changes(meta: dict, settings: dict | None) -> str:
    """The ``model.lora`` parts and targets this run's model section (``settings``) sets
    otherwise than the checkpoint's, as '; ' + one clause each ('' where none or unknown);
    a part the checkpoint adapts and this run freezes gets the way to stop its adapters."""
    if not isinstance(settings, dict):
        return ""
    saved = ((meta.get("config") or {}).get("model") or {}).get("lora") or {}
    ours = settings.get("lora") or {}
    freeze = settings.get("freeze") or []
    said = []
    for part in sorted(set(saved) | set(ours)):
        theirs, mine = saved.get(part), ours.get(part)
        # a freeze entry taking in the part or inside it (image, image.encoder) clashes
        clash = next((entry for entry in freeze if entry == part or part.startswith(
            f"{entry}.") or entry.startswith(f"{part}.")), None)
        module = part.partition(".")[0]         # optimizer.modules takes whole modules
        if isinstance(theirs, dict) and not isinstance(mine, dict):
            said.append(f"model.lora.{part} is set in the checkpoint, not in this run" + (
                f" (model.freeze holds {clash}: a part's adapters cannot be frozen; to stop "
                f"training them drop {clash} from model.freeze, keep model.lora.{part} and set "
                f"optimizer.modules.{module}.lr=0 and optimizer.modules.{module}.min_lr=0"
                + (f", which stops all of {module}" if module != part else "") + ")"
                if clash else ""))
        elif isinstance(mine, dict) and not isinstance(theirs, dict):
            said.append(f"model.lora.{part} is set in this run, not in the checkpoint")
        elif isinstance(mine, dict) and isinstance(theirs, dict) and \
                sorted(theirs.get("targets") or []) != sorted(mine.get("targets") or []):
            said.append(f"model.lora.{part}.targets {list(theirs.get('targets') or [])} in "
                        f"the checkpoint, {list(mine.get('targets') or [])} in this run")
    return "; " + "; ".join(said) if said else ""


def _check_adapters(directory: str, wanted: set, saved, meta: dict,
                    settings: dict | None) -> None:
    """A checkpoint with LoRA adapters on layers of this rank's modules that this run does not
    adapt is refused: its weights without them are not the model it saved. ``wanted``: this
    rank's keys, its stacked layers' also each under its own number (``_numbered_layers``)."""
    for key in sorted(saved):      # (a tensor saved in sections: <wanted key>.<section>)
        if is_adapter(key) and key not in wanted and key.rpartition(".")[0] not in wanted:
            layer = key[:key.index("lora.")]
            if any(k.startswith(layer) and not is_adapter(k) for k in wanted):
                lora = (meta.get("config") or {}).get("model", {}).get("lora")
                raise CheckpointError(
                    f"checkpoint {directory} holds LoRA adapters (model.lora: {lora}) on "
                    f"layers this run does not adapt, e.g. {key}: give this run the same "
                    "model.lora, or start from its merged export (mimo-export) as "
                    "model.pretrained" + _lora_changes(meta, settings))
