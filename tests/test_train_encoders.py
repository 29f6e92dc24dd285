"""mimo_train encoders emit exactly the rows the data pipeline counted, item by item.

The contract (docs/architecture.md, "One sample"): every ``<image>``/``<audio>`` marker is
expanded into N placeholder tokens, N computed from shard metadata alone
(``token_counts``), and the encoder's output, ordered item by item, has exactly N rows for that
item. Here the encoders run on the real corpus media, decoded and featurized by mimo_data's own
functions, and the row counts are compared with the metadata-only counts. Each item's rows must
also not depend on the other items of the batch: the batched output, split by those counts,
equals each item run alone. ``pretrained=`` is checked against the saved transformers model
run directly; geometry that would break the counts must be refused at build time.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mimo_data.modalities.audio import audio_encoder_inputs, decode_audio
from mimo_data.modalities.image import decode_image, image_encoder_inputs, normalize_pixels
from mimo_data.modalities.audio import probe_audio
from mimo_data.modalities.image import probe_image
from mimo_data.modalities.audio import AudioConfig
from mimo_data.modalities.image import ImageConfig
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.modalities.audio import audio_tokens, audio_tokens_from_frames
from mimo_data.modalities.image import image_tokens
from mimo_train.families.registry import build_encoder, default_kind
from mimo_train.errors import EncoderBuildError
from mimo_train.families.qwen2_5_vl import Qwen2_5VLVision
from mimo_train.families.qwen2_vl import Qwen2VLVision
from mimo_train.families.siglip import SiglipVision
from mimo_train.families.whisper import WhisperAudio

from conftest import REPO

HIDDEN = 16
AUDIO = AudioConfig(max_duration=8.0)        # 800 frames: a small Whisper window
FIXED = ImageConfig(policy="fixed", image_size=56, patch_size=14)
# The repository's preprocessing config (the one the demo trains with) and a 16 px patch geometry
# with a lower pixel cap, so that the corpus images are resized differently.
REPO_IMAGE = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess.yaml")).modalities[
    "image"]
DYNAMIC = {"repo-config": REPO_IMAGE,
           "p16": ImageConfig(patch_size=16, merge_size=2, min_pixels=16 * 32 * 32,
                              max_pixels=64 * 32 * 32)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ------------------------------------------------------------------------------ corpus media

@pytest.fixture(scope="module")
def corpus_images(corpus):
    """Every corpus image: (name, bytes, shard metadata as mimo-shard records it)."""
    entries = []
    for path in sorted((corpus / "images").iterdir()):
        data = path.read_bytes()
        entries.append((path.name, data, probe_image(data)))
    sizes = {(meta["width"], meta["height"]) for _, _, meta in entries}
    assert len(sizes) >= 5, f"the corpus should have images of several sizes, has {sizes}"
    assert any(meta["orientation"] != 1 for _, _, meta in entries), "need an EXIF-rotated image"
    return entries


@pytest.fixture(scope="module")
def corpus_clips(corpus):
    """Every corpus clip shorter than AUDIO.max_duration: (name, shard metadata, waveform)."""
    entries = []
    for path in sorted((corpus / "audio").iterdir()):
        data = path.read_bytes()
        meta = probe_audio(data)
        if meta["duration"] < AUDIO.max_duration:
            entries.append((path.name, meta, decode_audio(data, AUDIO)))
    assert len(entries) >= 5, "the corpus should have several clips shorter than 8 s"
    assert len({meta["sample_rate"] for _, meta, _ in entries}) > 1, "need resampled clips too"
    return entries


def decoded_images(entries, cfg: ImageConfig):
    return [decode_image(data, meta["orientation"], cfg) for _, data, meta in entries]


def dynamic_inputs_alone(images, cfg):
    return [image_encoder_inputs([image], cfg) for image in images]


def assert_rows_match_items(batched: torch.Tensor, counts: list[int], alone: list[torch.Tensor],
                            names: list[str]) -> None:
    """``batched`` split by ``counts`` equals each item's own output (same shape, atol 1e-5)."""
    assert batched.shape[0] == sum(counts)
    for name, part, own, count in zip(names, torch.split(batched, counts), alone, counts):
        assert own.shape == (count, batched.shape[1]), name
        torch.testing.assert_close(part, own, rtol=0, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------- Qwen2-VL (dynamic)

@pytest.mark.parametrize("cfg", DYNAMIC.values(), ids=DYNAMIC.keys())
@pytest.mark.parametrize("tower, layers", [(Qwen2VLVision, 1), (Qwen2_5VLVision, 2)],
                         ids=["qwen2_vl", "qwen2_5_vl"])
def test_qwen2vl_rows_equal_metadata_token_counts_image_by_image(corpus_images, cfg, tower,
                                                                  layers):
    """Qwen2.5-VL's tower with a windowed block then a full one: windows stay in each image."""
    encoder = tower(cfg, hidden_size=HIDDEN, num_layers=layers, num_attention_heads=2)
    names = [name for name, _, _ in corpus_images]
    counts = [image_tokens(meta["width"], meta["height"], cfg) for _, _, meta in corpus_images]
    assert len(set(counts)) >= 4, f"the corpus images should give different counts: {counts}"
    images = decoded_images(corpus_images, cfg)
    with torch.no_grad():
        batched = encoder(**image_encoder_inputs(images, cfg))
        alone = [encoder(**inputs) for inputs in dynamic_inputs_alone(images, cfg)]
    assert batched.shape == (sum(counts), HIDDEN) and encoder.output_size == HIDDEN
    assert torch.isfinite(batched).all()
    assert_rows_match_items(batched, counts, alone, names)


def test_qwen2vl_output_depends_on_the_image(corpus_images):
    """Two different images of the same size give different rows (the rows carry pixels)."""
    cfg = REPO_IMAGE
    by_size = {}
    for entry in corpus_images:
        by_size.setdefault((entry[2]["width"], entry[2]["height"]), []).append(entry)
    pair = next(entries[:2] for entries in by_size.values() if len(entries) >= 2)
    encoder = Qwen2VLVision(cfg, hidden_size=HIDDEN, num_layers=1, num_attention_heads=2)
    with torch.no_grad():
        first, second = (encoder(**image_encoder_inputs([image], cfg))
                         for image in decoded_images(pair, cfg))
    assert first.shape == second.shape
    assert (first - second).abs().max() > 1e-3


# ------------------------------------------------------------------------- SigLIP (fixed)

def test_siglip_rows_are_fixed_per_image_and_independent(corpus_images):
    entries = corpus_images[::3]
    encoder = SiglipVision(FIXED, hidden_size=HIDDEN, num_layers=1, num_attention_heads=2)
    images = decoded_images(entries, FIXED)
    inputs = image_encoder_inputs(images, FIXED)
    assert inputs["pixel_values"].shape == (len(images), 3, 56, 56)
    per_image = (56 // 14) ** 2
    counts = [image_tokens(meta["width"], meta["height"], FIXED) for _, _, meta in entries]
    assert counts == [per_image] * len(entries)
    with torch.no_grad():
        batched = encoder(**inputs)
        alone = [encoder(pixel_values=pixels[None]) for pixels in inputs["pixel_values"]]
    assert batched.shape == (len(images) * per_image, HIDDEN)
    assert_rows_match_items(batched, counts, alone, [name for name, _, _ in entries])


# --------------------------------------------------------------------------------- Whisper

@pytest.mark.parametrize("reductions", [(2, 2), (2,), (2, 3)], ids=str)
def test_whisper_rows_equal_metadata_token_counts_clip_by_clip(corpus_clips, reductions):
    cfg = replace(AUDIO, reductions=reductions)
    encoder = WhisperAudio(cfg, hidden_size=HIDDEN, num_layers=1, num_attention_heads=2)
    names = [name for name, _, _ in corpus_clips]
    inputs = audio_encoder_inputs([clip for _, _, clip in corpus_clips], cfg)
    frames = inputs["feature_lens"].tolist()
    assert any(f % 2 for f in frames), f"need a clip with an odd frame count: {frames}"
    counts = [audio_tokens_from_frames(f, cfg) for f in frames]
    # What language ranks compute from shard metadata alone, without decoding.
    assert counts == [audio_tokens(meta["frames"], meta["sample_rate"], cfg)
                      for _, meta, _ in corpus_clips]
    with torch.no_grad():
        batched = encoder(**inputs)
        alone = [encoder(**audio_encoder_inputs([clip], cfg)) for _, _, clip in corpus_clips]
    assert batched.shape == (sum(counts), HIDDEN)
    assert torch.isfinite(batched).all()
    assert_rows_match_items(batched, counts, alone, names)


# ------------------------------------------------------------------------------ pretrained

def tiny_qwen2vl(**geometry):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)
    config = dict(depth=1, embed_dim=16, hidden_size=24, num_heads=2, mlp_ratio=2, in_channels=3,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VisionTransformerPretrainedModel._from_config(
        Qwen2VLVisionConfig(**{**config, **geometry})).eval()


def tiny_siglip(**geometry):
    from transformers import SiglipVisionConfig, SiglipVisionModel
    config = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=56, patch_size=14)
    return SiglipVisionModel._from_config(SiglipVisionConfig(**{**config, **geometry})).eval()


def tiny_whisper(**overrides):
    """A whole tiny WhisperModel (encoder + decoder), as a hub checkpoint is saved."""
    from transformers import WhisperConfig, WhisperModel
    config = dict(num_mel_bins=80, d_model=24, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=48,
                  decoder_ffn_dim=48, max_source_positions=500, max_target_positions=16,
                  vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
    return WhisperModel(WhisperConfig(**{**config, **overrides})).eval()


def saved(model, directory) -> str:
    model.save_pretrained(directory)
    return str(directory)


def assert_same_weights(loaded: torch.nn.Module, original: torch.nn.Module,
                        left_out: str | None = None) -> None:
    """Equal weights; keys under the submodule ``left_out`` exist only in the original."""
    ours, theirs = loaded.state_dict(), original.state_dict()
    if left_out is not None:
        assert any(left_out in key.split(".") for key in theirs)
        theirs = {k: v for k, v in theirs.items() if left_out not in k.split(".")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_qwen2vl_pretrained_loads_the_saved_weights(tmp_path, corpus_images):
    cfg = REPO_IMAGE
    original = tiny_qwen2vl()
    # The size arguments are the random-init recipe; a pretrained model brings its own.
    encoder = Qwen2VLVision(cfg, hidden_size=64, num_layers=3, num_attention_heads=4,
                            pretrained=saved(original, tmp_path / "qwen2vl"))
    assert_same_weights(encoder.model, original)
    assert encoder.output_size == 24
    inputs = image_encoder_inputs(decoded_images(corpus_images[:4], cfg), cfg)
    with torch.no_grad():
        ours = encoder(**inputs)
        reference = original(hidden_states=normalize_pixels(inputs["pixel_values"], cfg),
                             grid_thw=inputs["image_grid_thw"]).pooler_output
    assert ours.shape == (sum(image_tokens(m["width"], m["height"], cfg)
                              for _, _, m in corpus_images[:4]), 24)
    assert torch.equal(ours, reference)


def test_siglip_pretrained_loads_the_saved_weights(tmp_path, corpus_images):
    original = tiny_siglip()
    encoder = SiglipVision(FIXED, hidden_size=64, num_layers=3, num_attention_heads=4,
                           pretrained=saved(original, tmp_path / "siglip"))
    # one row per patch: the pooling head of the checkpoint is not loaded
    assert_same_weights(encoder.model, original, left_out="head")
    assert encoder.output_size == 24
    pixels = image_encoder_inputs(decoded_images(corpus_images[:3], FIXED), FIXED)["pixel_values"]
    with torch.no_grad():
        ours = encoder(pixel_values=pixels)
        reference = original(pixel_values=normalize_pixels(pixels, FIXED)).last_hidden_state
    assert reference.shape == (3, 16, 24)
    assert torch.equal(ours, reference.reshape(48, 24))


def test_whisper_pretrained_loads_an_encoder_saved_alone(tmp_path):
    """mimo-export saves the Whisper encoder without its decoder; it loads back as is."""
    original = tiny_whisper().encoder
    encoder = WhisperAudio(AUDIO, hidden_size=64, num_layers=3, num_attention_heads=4,
                           pretrained=saved(original, tmp_path / "encoder"))
    assert_same_weights(encoder.model, original)
    assert encoder.output_size == 24


def test_whisper_pretrained_loads_the_saved_encoder(tmp_path, corpus_clips):
    original = tiny_whisper()           # 1000-frame window, longer than AUDIO's 800 frames
    encoder = WhisperAudio(AUDIO, hidden_size=64, num_layers=3, num_attention_heads=4,
                           pretrained=saved(original, tmp_path / "whisper"))
    assert_same_weights(encoder.model, original.encoder)
    assert encoder.output_size == 24
    clips = [clip for _, _, clip in corpus_clips[:3]]
    inputs = audio_encoder_inputs(clips, AUDIO)
    with torch.no_grad():
        ours = encoder(**inputs)
        # Reference: each clip's log-mels padded to the model's 1000 frames with the clip's
        # floor value, the saved encoder run directly, rows past the clip dropped, then pairs
        # of rows averaged (the second reduction, a last odd row kept as is).
        expected = []
        for features in torch.split(inputs["input_features"], inputs["feature_lens"].tolist()):
            padded = torch.full((1, 80, 1000), features.min().item())
            padded[0, :, :len(features)] = features.T
            states = original.encoder(padded).last_hidden_state[0][:(len(features) + 1) // 2]
            expected += [states[i:i + 2].mean(0) for i in range(0, len(states), 2)]
    assert ours.shape == (len(expected), 24)
    assert len(expected) == sum(audio_tokens_from_frames(f, AUDIO)
                                for f in inputs["feature_lens"].tolist())
    torch.testing.assert_close(ours, torch.stack(expected), rtol=0, atol=1e-6)


# ------------------------------------------------------------------- refused geometry

def assert_refused_naming(build, names) -> None:
    """``build()`` raises EncoderBuildError whose message names every one of ``names``."""
    with pytest.raises(EncoderBuildError) as error:
        build()
    message = str(error.value)
    for name in names:
        assert name in message, message


@pytest.mark.parametrize("geometry, names", [
    ({"patch_size": 16}, ("patch_size", "16", "14")),
    ({"spatial_merge_size": 1}, ("spatial_merge_size", "1", "2")),
], ids=["patch", "merge"])
def test_qwen2vl_pretrained_with_other_geometry_is_refused(tmp_path, geometry, names):
    directory = saved(tiny_qwen2vl(**geometry), tmp_path / "qwen2vl")
    assert_refused_naming(
        lambda: Qwen2VLVision(REPO_IMAGE, HIDDEN, 1, 2, pretrained=directory), names)


@pytest.mark.parametrize("geometry, names", [
    ({"image_size": 112}, ("112", "56")),
    ({"image_size": 64, "patch_size": 16}, ("64", "16", "56", "14")),
], ids=["image_size", "patch_size"])
def test_siglip_pretrained_with_other_geometry_is_refused(tmp_path, geometry, names):
    directory = saved(tiny_siglip(**geometry), tmp_path / "siglip")
    assert_refused_naming(lambda: SiglipVision(FIXED, HIDDEN, 1, 2, pretrained=directory), names)


@pytest.mark.parametrize("overrides, names", [
    ({"num_mel_bins": 128}, ("128", "80")),
    ({"max_source_positions": 100}, ("200 frames", "800 frames", "max_duration")),
], ids=["n_mels", "window"])
def test_whisper_pretrained_with_other_geometry_is_refused(tmp_path, overrides, names):
    directory = saved(tiny_whisper(**overrides), tmp_path / "whisper")
    assert_refused_naming(lambda: WhisperAudio(AUDIO, HIDDEN, 1, 2, pretrained=directory), names)


@pytest.mark.parametrize("reductions", [(4,), (), (3, 2)], ids=str)
def test_whisper_reductions_must_start_with_the_stride_2_conv(reductions):
    with pytest.raises(EncoderBuildError, match="reductions") as error:
        WhisperAudio(replace(AUDIO, reductions=reductions), HIDDEN, 1, 2)
    assert str(list(reductions)) in str(error.value)


def test_build_encoder_by_kind_and_default_kinds():
    assert default_kind("audio", AUDIO) == "whisper"
    assert default_kind("image", REPO_IMAGE) == "qwen2_vl"
    assert default_kind("image", FIXED) == "siglip"
    built = {kind: build_encoder(kind, config, HIDDEN, 1, 2, None)
             for kind, config in (("qwen2_vl", REPO_IMAGE), ("siglip", FIXED),
                                  ("whisper", AUDIO))}
    assert [type(e) for e in built.values()] == [Qwen2VLVision, SiglipVision, WhisperAudio]
    with pytest.raises(EncoderBuildError, match="'clip'"):
        build_encoder("clip", FIXED, HIDDEN, 1, 2, None)
