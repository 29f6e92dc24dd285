"""Whether a run's preprocessing fits the whole VLM it trains (``VLM``): the checkpoint's
image and video tokens and their wrap tokens in the preprocessing tokenizer, its positions,
the tokens a tower emits per item, what its video processor feeds the tower, and a chat
template that writes every modality's marker. Each difference is said with what to set, or
with ``mimo-train --preprocessing-for`` where the config is another model's.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from mimo_train.errors import TrainConfigError
from mimo_train.families.base import VLM


def check_preprocessing(vlm: VLM, preprocess, tokenizer,
                        tower_serves: Collection[str]) -> None:
    """``TrainConfigError`` unless the preprocessing (its config and ``tokenizer``) writes an
    image as the checkpoint expects it: its image token, between its start and end tokens,
    with the positions its language model takes, and each item of the modalities its tower
    encodes (``tower_serves``) in as many tokens as the tower emits. Where it does not because
    its tokenizer is another model's, the error says that, not which token to change; where
    several settings differ (another family's config), it names them all, after how to write
    the right one."""
    problems = _preprocessing_problems(vlm, preprocess, tokenizer, tower_serves)
    if not problems:
        return
    foreign = foreign_tokenizer(vlm, preprocess, tokenizer)
    if foreign:
        raise TrainConfigError(foreign)
    if len(problems) == 1:
        raise TrainConfigError(problems[0])
    untokenized = _checkpoint_tokens(vlm) is None
    raise TrainConfigError(
        f"the preprocessing config is not the one model.pretrained {vlm.path} takes "
        f"({len(problems)} settings differ): write its own with mimo-train --preprocessing-for "
        f"{vlm.path} > preprocess.yaml (then data.preprocess=preprocess.yaml in training, "
        "--config preprocess.yaml to mimo-inspect)" + (
            ", once the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) "
            "are beside its config.json (the folder has none)" if untokenized else "")
        + ", or mend each:" + "".join(f"\n  - {problem}" for problem in problems))


def foreign_tokenizer(vlm: VLM, preprocess, tokenizer=None) -> str | None:
    """What to say when the preprocessing's ``tokenizer`` (None: loaded from its config) names
    the checkpoint's special token ids otherwise than the checkpoint's own tokenizer does
    (None: the same, or the checkpoint has none)."""
    known = _checkpoint_tokens(vlm)
    if known is None:
        return None
    if tokenizer is None:
        from mimo_data.preprocess.chat_tokens import load_tokenizer
        tokenizer = load_tokenizer(preprocess)
    for i, theirs in known.items():
        ours = tokenizer.convert_ids_to_tokens(i)
        if theirs != ours:
            said = "no token" if ours is None else repr(ours)
            return (f"the preprocessing config's tokenizer ({preprocess.tokenizer}) is not "
                    f"model.pretrained's ({vlm.path}): token id {i} is {said} in it and "
                    f"{theirs!r} in the checkpoint's. Use a preprocessing config made for this "
                    f"model: mimo-train --preprocessing-for {vlm.path} > preprocess.yaml, then "
                    "data.preprocess=preprocess.yaml in training (--config preprocess.yaml "
                    "to mimo-inspect)")
    return None


def _checkpoint_tokens(vlm: VLM) -> dict[int, str | None] | None:
    """The checkpoint's own tokenizer's tokens at the model's image, wrap and video token ids;
    None where it has no tokenizer files (transformers then makes an empty tokenizer, which
    knows none of them)."""
    from mimo_data.preprocess.tokenizer_loading import shared_tokenizer
    try:
        own = shared_tokenizer(vlm.path)
    except Exception:         # no tokenizer files beside the weights: nothing to compare
        return None
    ids = [i for i in (vlm.image_token_id, *vlm.image_wrap_ids, vlm.video_token_id)
           if i is not None]
    known = {i: own.convert_ids_to_tokens(i) for i in ids}
    return known if any(known.values()) else None


def _preprocessing_problems(vlm: VLM, preprocess, tokenizer,
                            tower_serves: Collection[str]) -> list[str]:
    """What in the preprocessing differs from what ``vlm`` takes, each with what to set."""
    problems = []
    if preprocess.positions != vlm.positions:
        problems.append(f"the preprocessing config has positions: {preprocess.positions}, but "
                        f"model.pretrained {vlm.path} (a {vlm.family}) takes {vlm.positions} "
                        f"positions: set positions: {vlm.positions}")
    problems += _video_problems(vlm, preprocess, tokenizer)
    from mimo_data.preprocess.chat_render import ChatRenderer
    problems += template_problems(preprocess, ChatRenderer(preprocess, tokenizer), vlm)
    for name in tower_serves:
        problems += _token_count_problems(vlm, name, preprocess.modalities.get(name))
    image = preprocess.modalities.get("image")
    if image is None:
        return problems
    expected = [tokenizer.convert_ids_to_tokens(i) for i in vlm.image_wrap_ids]
    ours = tokenizer.convert_tokens_to_ids(image.token)
    if ours != vlm.image_token_id:
        # the token the checkpoint's id names in this tokenizer: the token to give, where the
        # tokenizer is the checkpoint's (else its own tokenizer is what differs)
        theirs = tokenizer.convert_ids_to_tokens(vlm.image_token_id)
        problems.append(
            f"the preprocessing tokenizer gives the image token {image.token!r} the id {ours}, "
            f"but model.pretrained {vlm.path} expects image tokens at {vlm.image_token_id}: "
            + (f"set modalities.image.token: {theirs!r} (the token of that id)"
               if isinstance(theirs, str) and theirs != image.token and
               tokenizer.convert_tokens_to_ids(theirs) == vlm.image_token_id else
               f"use the checkpoint's tokenizer (tokenizer: {vlm.path})"))
    if tuple(tokenizer.convert_tokens_to_ids(list(image.wrap))) != vlm.image_wrap_ids:
        problems.append(
            f"modalities.image.wrap is {list(image.wrap)}, but model.pretrained {vlm.path} "
            f"expects each image between the tokens {list(vlm.image_wrap_ids)}" + (
                f" ({expected}): set modalities.image.wrap: {expected}"
                if _named(expected) else _not_named(vlm)))
    return problems


def template_problems(preprocess, renderer, vlm: VLM | None = None) -> list[str]:
    """The modalities of ``preprocess`` its chat template (``renderer``'s, a ``ChatRenderer``)
    writes no marker for, each as a problem: their every sample would be dropped, none trained
    (``vlm``: the whole VLM the run trains, whose tower may lack the modality)."""
    from mimo_data.modalities import MARKERS
    unwritten = renderer.unwritten_modalities()
    takes = vlm.modalities if vlm is not None else tuple(MARKERS)
    # a video the checkpoint does not take is refused as that (_video_problems)
    dropped = [m for m in preprocess.modalities if m in unwritten and
               (m != "video" or m in takes)]
    written = " and ".join([m for m in MARKERS if m not in unwritten] + ["text"])
    template = ("its chat_template" if preprocess.chat_template else
                f"the tokenizer's, {preprocess.tokenizer}")
    # a modality the checkpoint's tower does not take needs an encoder module of its own too
    return [(f"model.pretrained {vlm.path} (a {vlm.family}) has no {m} tower, and "
             if vlm is not None and m not in takes else "") +
            f"the preprocessing config's chat template ({template}) writes no {MARKERS[m]} for "
            f"{m} in a message (it writes {written} only), so every sample with {m} would be "
            f"dropped as template_mismatch and none trained: drop modalities.{m} from the "
            f"preprocessing config, or give it a chat_template that writes {MARKERS[m]} for "
            f"each {m} part" + (f" (and serve {m} from an encoder module of its own: "
                                "model.encoders, the layout)" if m not in takes else "")
            for m in dropped]


def check_template(preprocess, renderer) -> None:
    """``TrainConfigError`` for a modality whose marker the chat template (``renderer``'s)
    does not write (``template_problems``), for a run of encoder modules around a language
    model (a whole VLM's run is checked with the rest of its preprocessing:
    ``check_preprocessing``)."""
    problems = template_problems(preprocess, renderer)
    if problems:
        raise TrainConfigError("; ".join(problems))


def _named(tokens: list) -> bool:
    """Whether the preprocessing tokenizer named every token id asked of it (``None`` where
    it has no token of the id: another model's tokenizer, whose tokens are no setting)."""
    return all(isinstance(token, str) for token in tokens)


def _not_named(vlm: VLM) -> str:
    """The remedy where the preprocessing tokenizer names none of ``vlm``'s token ids."""
    return (", which the preprocessing tokenizer has no tokens for: use the checkpoint's "
            f"tokenizer (tokenizer: {vlm.path})")


def _token_count_problems(vlm: VLM, name: str, settings) -> list[str]:
    """``modalities.NAME`` settings that would count another number of tokens per item than
    the checkpoint's tower emits (``VLM.image_tokens_by``), named with the value to set."""
    if settings is None:
        return []
    wrong = [(key, value) for key, value in vlm.image_tokens_by
             if hasattr(settings, key) and getattr(settings, key) != value]
    if not wrong:
        return []
    return [f"modalities.{name} has {', '.join(f'{k}: {_yaml(getattr(settings, k))}' for k, _
                                               in wrong)}, but model.pretrained {vlm.path}'s "
            f"tower takes {', '.join(f'{k}: {_yaml(v)}' for k, v in wrong)}, so every "
            f"{name}'s token count would be wrong: set "
            f"{', '.join(f'modalities.{name}.{k}: {_yaml(v)}' for k, v in wrong)}"]


def _yaml(value) -> str:
    """A setting's value as a YAML config writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(list(value)) if isinstance(value, (tuple, list)) else str(value)


def _video_problems(vlm: VLM, preprocess, tokenizer) -> list[str]:
    """``_preprocessing_problems`` of ``modalities.video``: the checkpoint's video token and wrap
    tokens, what its video processor feeds the tower (``VLM.video_inputs``), and its M-RoPE
    time scaling (``tokens_per_second``)."""
    video = preprocess.modalities.get("video")
    if video is None:
        return []
    if vlm.video_token_id is None:
        return [f"model.pretrained {vlm.path} (a {vlm.family}) takes no video: drop "
                "modalities.video"]
    problems: list[str] = []
    if tokenizer.convert_tokens_to_ids(video.token) != vlm.video_token_id:
        token = [tokenizer.convert_ids_to_tokens(vlm.video_token_id)]
        problems.append(
            f"modalities.video.token is {video.token!r}, but model.pretrained {vlm.path} expects "
            f"video tokens at {vlm.video_token_id}" + (
                f" ({token[0]!r}): use it" if _named(token) else _not_named(vlm)))
    if tuple(tokenizer.convert_tokens_to_ids(list(video.wrap))) != vlm.image_wrap_ids:
        expected = [tokenizer.convert_ids_to_tokens(i) for i in vlm.image_wrap_ids]
        problems.append(f"modalities.video.wrap is {list(video.wrap)}, but model.pretrained "
                        f"{vlm.path} expects each video between the tokens "
                        f"{list(vlm.image_wrap_ids)}" + (
                            f" ({expected}): set modalities.video.wrap: {expected}"
                            if _named(expected) else _not_named(vlm)))
    for key, theirs in vlm.video_inputs:
        ours = getattr(video, key)
        if not (np.shape(ours) == np.shape(theirs) and (
                np.allclose(ours, theirs, rtol=0, atol=1e-6) if np.shape(theirs)
                else ours == theirs)):
            problems.append(
                f"modalities.video.{key} is {_yaml(ours)}, but model.pretrained {vlm.path}'s "
                f"video processor has {_yaml(theirs)}: the tower would see other inputs than "
                f"it was trained on, and the export would not be that model; set "
                f"modalities.video.{key}: {_yaml(theirs)} (mimo-train --preprocessing-for "
                f"{vlm.path} writes it)")
    if video.tokens_per_second != vlm.tokens_per_second:
        ours = "is not set" if video.tokens_per_second is None else \
            f"is {video.tokens_per_second:g}"
        theirs = ("one time position a temporal patch (no tokens_per_second)"
                  if vlm.tokens_per_second is None else
                  f"{vlm.tokens_per_second:g} time positions a second (its vision config's "
                  "tokens_per_second)")
        problems.append(
            f"modalities.video.tokens_per_second {ours}, but model.pretrained {vlm.path} "
            f"positions videos with {theirs}: set modalities.video.tokens_per_second: "
            f"{'null' if vlm.tokens_per_second is None else f'{vlm.tokens_per_second:g}'}")
    return problems
