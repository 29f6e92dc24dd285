"""Each encoder module of a run: the modality its encoder takes, the others it also serves, its
kind, its checkpoint, the width of the rows it emits and the projection after it, decided from
the layout, the preprocessing config, ``model.encoders`` and ``model.projection`` (a whole
VLM's tower: the VLM's own kind, weights and projector). What ``model.build`` builds and
``planning.dims`` counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from mimo_data.errors import listed
from mimo_data.loading.layout import Layout, LayoutError
from mimo_train.config import ENCODER_DEFAULTS, EncoderConfig, TrainConfig
from mimo_train.errors import EncoderBuildError, TrainConfigError
from mimo_train.families.base import VLM, input_form
from mimo_train.families.registry import ENCODERS, OWN_MODALITIES, checkpoint_config, default_kind


class EncoderSetting(NamedTuple):
    """What an encoder module is built from."""
    modality: str                  # the modality its encoder ``takes``
    config: Any                    # that modality's preprocessing config
    spec: EncoderConfig            # a whole VLM's tower: its kind and pretrained filled in
    kind: str
    also: dict[str, Any]           # further modalities it serves (``Encoder.also_takes``)
    output_size: int               # the width of its rows, before the projection
    projection: str                # the projection after it: linear | mlp | none

    @property
    def deepstack(self) -> bool:
        """Whether its rows carry deepstack features beside the main ones."""
        return ENCODERS[self.kind].deepstack

    @property
    def frame_independent(self) -> bool:
        """Whether its tower encodes each temporal patch of a clip on its own."""
        return ENCODERS[self.kind].frame_independent

    @property
    def dims(self) -> tuple[int, int, int]:
        """A randomly initialized tower's (hidden_size, num_layers, num_attention_heads)
        (a pretrained one's are its checkpoint's: these are then the unused defaults)."""
        return tower_dims(self.spec)


def tower_dims(spec: EncoderConfig) -> tuple[int, int, int]:
    """``spec``'s (hidden_size, num_layers, num_attention_heads), ``ENCODER_DEFAULTS`` where
    unset."""
    hidden, layers, heads = (getattr(spec, key) or ENCODER_DEFAULTS[key]
                             for key in ("hidden_size", "num_layers", "num_attention_heads"))
    return hidden, layers, heads


def check_processors(encoders: Mapping[str, EncoderSetting]) -> None:
    """TrainConfigError where the processor saved beside a pretrained encoder's checkpoint
    preprocesses otherwise than the run (``Encoder.check_processor``: normalization, an audio
    encoder's sampling rate and features): at start-up, on every rank, before any is built."""
    for name, encoder in encoders.items():
        try:
            ENCODERS[encoder.kind].check_processor(encoder.spec.pretrained, encoder.config)
        except EncoderBuildError as error:
            raise TrainConfigError(f"encoder module {name!r}: {error}") from None


def encoder_settings(cfg: TrainConfig, layout: Layout, preprocess, vlm: VLM | None
                     ) -> dict[str, EncoderSetting]:
    """module name -> its ``EncoderSetting``, validated; ``vlm``: ``model.pretrained``'s."""
    settings = {}
    try:
        layout.check_expanded(preprocess.modalities)
    except LayoutError as error:
        raise TrainConfigError(f"layout {error}") from None
    for module in layout.encoders:
        served = layout.modalities_of(module.name)
        spec = cfg.model.encoders.get(module.name) or EncoderConfig()
        own = [m for m in served if m in OWN_MODALITIES]
        if len(own) > 1:
            raise TrainConfigError(f"encoder module {module.name!r} serves {listed(own)}: give "
                                   "each its own encoder module")
        if not own:
            raise TrainConfigError(
                f"encoder module {module.name!r} serves {listed(served)}, which no encoder takes "
                "on its own: serve them from the module of an encoder that also takes them (the "
                "Qwen2-VL towers take video beside images: image=dp1,video)")
        modality = own[0]
        modality_config = preprocess.modalities[modality]
        form = input_form(modality, modality_config)
        if modality == "image" and vlm is not None and spec.pretrained is None:
            spec = _vlm_tower(module.name, spec, vlm, form)
        kind = spec.kind or default_kind(modality, modality_config)
        if kind not in ENCODERS or ENCODERS[kind].takes != form:
            raise TrainConfigError(
                f"model.encoders.{module.name}.kind is {kind!r}, but the preprocessing config "
                f"gives {form[1]} {modality} inputs, for "
                f"{default_kind(modality, modality_config)!r}")
        also = [m for m in served if m != modality]
        refused = [m for m in also if m not in ENCODERS[kind].also_takes]
        if refused:
            takes = [modality, *ENCODERS[kind].also_takes]
            raise TrainConfigError(
                f"encoder module {module.name!r} serves {served}, but " + (
                    f"model.pretrained {vlm.path}'s tower encodes {takes} only (the model "
                    f"takes no {' or '.join(refused)}): drop "
                    f"{', '.join(f'modalities.{m}' for m in refused)} from the preprocessing "
                    f"config and {', '.join(refused)} from module {module.name!r} of the "
                    "layout (those samples are then dropped as unconfigured_modality), or "
                    "serve them from an encoder module of their own"
                    if vlm is not None and spec.pretrained == vlm.path else
                    f"its {kind} encoder encodes {takes} only: give {refused} their own "
                    "encoder module"))
        spec = _tower_dims(module.name, spec, kind, vlm)
        settings[module.name] = EncoderSetting(
            modality, modality_config, spec, kind, {m: preprocess.modalities[m] for m in also},
            _output_size(module.name, spec, kind), _projection(spec, cfg, vlm))
    return settings


def _tower_dims(name: str, spec: EncoderConfig, kind: str, vlm: VLM | None) -> EncoderConfig:
    """``spec`` with a randomly initialized tower's dims (``ENCODER_DEFAULTS`` where unset),
    checked: heads dividing the width into heads of a size the kind's positions take. A
    pretrained tower's dims are its checkpoint's: a dim set beside it is refused (it would be
    ignored)."""
    given = {key: getattr(spec, key) for key in ENCODER_DEFAULTS
             if getattr(spec, key) is not None}
    if spec.pretrained is not None:
        if given:
            key, value = next(iter(given.items()))
            source = "model.pretrained" if vlm is not None and spec.pretrained == vlm.path \
                else f"model.encoders.{name}.pretrained"
            raise TrainConfigError(
                f"model.encoders.{name}.{key} is {value}, but the tower is {source} "
                f"{spec.pretrained}'s, whose config gives its dims: drop the key")
        return spec
    dims = {**ENCODER_DEFAULTS, **given}
    hidden, heads = dims["hidden_size"], dims["num_attention_heads"]
    multiple = ENCODERS[kind].head_dim_multiple
    if hidden % heads or hidden // heads % multiple:
        fits = [n for n in range(1, hidden + 1)
                if hidden % n == 0 and hidden // n % multiple == 0][:6]
        size = f"{multiple}" if multiple > 1 else "a whole number"
        raise TrainConfigError(
            f"model.encoders.{name}: num_attention_heads {heads} over hidden_size {hidden} "
            f"makes heads of {hidden / heads:g} channels, and a {kind} tower's head size is "
            + (f"a multiple of {size} (its rotary positions)" if multiple > 1 else size) +
            (f": give heads of {', '.join(map(str, fits))}" if fits else
             f": give a hidden_size that is a multiple of {multiple}"))
    return dataclasses.replace(spec, **dims)


def _projection(spec: EncoderConfig, cfg: TrainConfig, vlm: VLM | None) -> str:
    """The projection after an encoder module's tower: ``model.encoders.<module>.projection``,
    else a whole VLM's tower's own projector (its weights), else ``model.projection``, else
    linear (``check_vlm_projections`` refuses another for a VLM's tower)."""
    if vlm is not None and spec.pretrained == vlm.path:
        return spec.projection or vlm.projection
    return spec.projection or cfg.model.projection or "linear"


def check_vlm_projections(cfg: TrainConfig, settings: Mapping[str, EncoderSetting],
                          vlm: VLM | None) -> None:
    """``TrainConfigError`` for a projection after a whole VLM's tower other than its own
    projector (a new, randomly initialized layer that ``mimo-export`` cannot write back into
    the model), and for ``model.projection`` set where every tower is the VLM's."""
    if vlm is None:
        return
    why = (f"a whole {vlm.family} model, whose own projector mimo runs as projection "
           f"{vlm.projection}: another would be a new, randomly initialized layer that "
           "mimo-export cannot write back into the model")
    for name, setting in settings.items():
        if setting.spec.pretrained == vlm.path and setting.projection != vlm.projection:
            raise TrainConfigError(
                f"model.encoders.{name}.projection is {setting.projection}, but its tower is "
                f"model.pretrained {cfg.model.pretrained}'s, {why}; drop the key")
    projection = cfg.model.projection
    if projection and projection != vlm.projection and all(
            setting.spec.pretrained == vlm.path for setting in settings.values()):
        raise TrainConfigError(
            f"model.projection is {projection}, but model.pretrained {cfg.model.pretrained} is "
            f"{why}; leave model.projection unset")


def _vlm_tower(name: str, spec: EncoderConfig, vlm: VLM, form: tuple) -> EncoderConfig:
    """``spec`` of the image module of a whole VLM: its tower's kind and checkpoint."""
    if spec.kind not in (None, vlm.encoder_kind):
        raise TrainConfigError(
            f"model.encoders.{name}.kind is {spec.kind!r}, but the tower of model.pretrained "
            f"{vlm.path} is a {vlm.encoder_kind}: drop the key")
    takes = ENCODERS[vlm.encoder_kind].takes
    if takes != form:
        raise TrainConfigError(
            f"model.pretrained {vlm.path} has a {vlm.encoder_kind} vision tower, which takes "
            f"{takes[1]} images, but the preprocessing config gives {form[1]} ones: use its "
            f"image geometry (policy: {takes[1]})")
    return dataclasses.replace(spec, kind=vlm.encoder_kind, pretrained=vlm.path)


def _output_size(name: str, spec: EncoderConfig, kind: str) -> int:
    """The width of the rows encoder module ``name`` emits: a checkpoint's (its config), else
    ``model.encoders.<name>.hidden_size``."""
    if spec.pretrained is None:
        return tower_dims(spec)[0]
    config = checkpoint_config(spec.pretrained, f"model.encoders.{name}.pretrained")
    types = ENCODERS[kind].checkpoint_types()
    vision = getattr(config, "vision_config", None) or config
    if types and config.model_type != kind and vision.model_type not in types:
        raise TrainConfigError(
            f"model.encoders.{name}.pretrained {spec.pretrained} is a "
            f"{vision.model_type!r} checkpoint, but module {name!r} builds the {kind} encoder "
            f"(from its kind, or the preprocessing's input form), which takes "
            f"{' or '.join(repr(t) for t in types)} checkpoints or a whole {kind} model: give "
            "one of those, or set its kind and preprocessing for this checkpoint")
    return ENCODERS[kind].pretrained_output_size(config)
