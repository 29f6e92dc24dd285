"""Encoder inputs and token counts against transformers' reference processors, on real assets.

The uint8 fast path (Pillow resize + reshape patchify, float normalization on the device) must
give the reference processors' float32 output up to float rounding (README, Benchmarks), and
the token counts computed from metadata alone must equal what the encoder inputs produce
(docs/architecture.md, "One sample").
"""

from __future__ import annotations

import gzip
import io
import re
from dataclasses import replace

import av
import numpy as np
import pytest
import soundfile
import torch
import torchaudio.functional
from PIL import Image, ImageOps
from transformers import WhisperFeatureExtractor
from transformers.image_transforms import convert_to_rgb
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil, smart_resize)
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from mimo_data.modalities.audio import (AUDIO, MIN_AUDIO_SAMPLES, audio_encoder_inputs,
                                        audio_features,
                                    audio_rows_to_tokens, decode_audio)
from mimo_data.modalities.image import (IMAGE, decode_image, image_encoder_inputs,
                                        image_rows_to_tokens, normalize_pixels)
from mimo_data.modalities.base import MediaError
from mimo_data.modalities.audio import probe_audio
from mimo_data.modalities.image import probe_image
from mimo_data.modalities.audio import AudioConfig
from mimo_data.modalities.image import ImageConfig
from mimo_data.modalities.audio import audio_frames, audio_tokens, audio_too_long, resampled_length
from mimo_data.modalities.audio import resampler
from mimo_data.modalities.image import image_resized_size, image_tokens

# (min_pixels, max_pixels, patch, merge, temporal): downscale hard, the default cap, upscale
# small images through min_pixels, and a Qwen2.5/3-VL-like 16 px patch.
DYNAMIC_SETTINGS = [
    (4 * 28 * 28, 64 * 28 * 28, 14, 2, 2),
    (56 * 56, 256 * 28 * 28, 14, 2, 2),
    (512 * 28 * 28, 1024 * 28 * 28, 14, 2, 2),
    (64 * 32 * 32, 256 * 32 * 32, 16, 2, 2),
]
ORIENTATION_TAG = 0x0112


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def images(corpus_photos):
    """Every corpus image (conftest's ``corpus_photos``), in each mode the corpus stores."""
    assert {"L", "RGB", "RGBA"} <= {meta["mode"] for _, _, meta, _ in corpus_photos}
    return corpus_photos


@pytest.fixture(scope="module")
def clips(corpus):
    """Every corpus audio clip: (name, bytes, shard metadata)."""
    entries = [(p.name, p.read_bytes()) for p in sorted((corpus / "audio").iterdir())]
    entries = [(name, data, probe_audio(data)) for name, data in entries]
    assert len({meta["sample_rate"] for _, _, meta in entries}) > 1, "need several rates"
    return entries


def dynamic_config(setting) -> ImageConfig:
    min_pixels, max_pixels, patch, merge, temporal = setting
    return ImageConfig(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch,
                       merge_size=merge, temporal_patch_size=temporal)


@pytest.fixture(scope="module", params=DYNAMIC_SETTINGS, ids=lambda s: f"{s[0]}-{s[1]}-p{s[2]}")
def dynamic_run(request, images):
    """Our inputs and Qwen2VLImageProcessorPil's output for all corpus images at one setting."""
    cfg = dynamic_config(request.param)
    reference = Qwen2VLImageProcessorPil(
        min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=cfg.patch_size,
        merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size)
    expected = reference([ref for *_, ref in images], return_tensors="pt")
    decoded = [decode_image(data, meta["orientation"], cfg) for _, data, meta, _ in images]
    return cfg, image_encoder_inputs(decoded, cfg), expected


def image_named(images, name):
    return next(entry for entry in images if entry[0] == name)


def stored_orientation(data: bytes) -> int:
    with Image.open(io.BytesIO(data)) as image:
        return int(image.getexif().get(ORIENTATION_TAG, 1))


# ------------------------------------------------------------------------------- images

def test_dynamic_inputs_equal_qwen2vl_processor(dynamic_run):
    cfg, ours, expected = dynamic_run
    assert ours["pixel_values"].dtype == torch.uint8
    # one frame per patch: the reference's temporal repeat happens in normalize_pixels
    assert ours["pixel_values"].shape == (len(expected["pixel_values"]), 3 * cfg.patch_size ** 2)
    assert expected["pixel_values"].shape[1] == \
        3 * cfg.temporal_patch_size * cfg.patch_size ** 2
    assert ours["image_grid_thw"].dtype == torch.int64
    assert torch.equal(ours["image_grid_thw"], expected["image_grid_thw"])
    normalized = normalize_pixels(ours["pixel_values"], cfg)
    assert normalized.dtype == torch.float32
    torch.testing.assert_close(normalized, expected["pixel_values"], rtol=0, atol=1e-5)


def test_dynamic_token_counts_agree_with_inputs_and_reference(dynamic_run, images):
    cfg, ours, expected = dynamic_run
    from_reference = [int(t * h * w) // cfg.merge_size ** 2
                      for t, h, w in expected["image_grid_thw"].tolist()]
    from_metadata = [image_tokens(meta["width"], meta["height"], cfg)
                     for _, _, meta, _ in images]
    assert image_rows_to_tokens(ours, cfg) == from_reference == from_metadata
    sizes = [image_resized_size(meta["width"], meta["height"], cfg) for _, _, meta, _ in images]
    assert [(w // cfg.patch_size, h // cfg.patch_size) for w, h in sizes] == \
        [(w, h) for _, h, w in expected["image_grid_thw"].tolist()]
    rows = [h * w for _, h, w in expected["image_grid_thw"].tolist()]
    assert len(ours["pixel_values"]) == sum(rows)


def test_settings_change_the_token_counts(images):
    """The settings above really exercise downscaling and upscaling of the corpus images."""
    counts = [[image_tokens(meta["width"], meta["height"], dynamic_config(setting))
               for _, _, meta, _ in images] for setting in DYNAMIC_SETTINGS[:3]]
    assert max(counts[0]) <= 64 < max(counts[1]) <= 256 < min(counts[2])


def test_a_pixel_range_upside_down_is_refused_with_its_values():
    from mimo_data.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape("modalities.image.min_pixels (401408) is "
                                                    "above max_pixels (200704)")):
        ImageConfig(min_pixels=401408, max_pixels=200704).validate()
    # crop and pad shape the fixed policy's square: refused on the dynamic policy
    for key in ("crop", "pad"):
        with pytest.raises(ConfigError, match=re.escape(f"modalities.image.{key} applies to the "
                                                        "fixed policy only")):
            ImageConfig(**{key: True}).validate()
        ImageConfig(policy="fixed", **{key: True}).validate()


@pytest.mark.parametrize("size", [224, 112])
def test_fixed_inputs_equal_siglip_processor(images, size):
    cfg = ImageConfig(policy="fixed", image_size=size)
    reference = SiglipImageProcessorPil(size={"height": size, "width": size},
                                        image_mean=list(cfg.mean), image_std=list(cfg.std))
    expected = reference([ref for *_, ref in images], return_tensors="pt")["pixel_values"]
    decoded = [decode_image(data, meta["orientation"], cfg) for _, data, meta, _ in images]
    ours = image_encoder_inputs(decoded, cfg)
    assert ours["pixel_values"].dtype == torch.uint8
    assert ours["pixel_values"].shape == expected.shape == (len(images), 3, size, size)
    torch.testing.assert_close(normalize_pixels(ours["pixel_values"], cfg), expected,
                               rtol=0, atol=1e-5)
    tokens = (expected.shape[-1] // cfg.patch_size) ** 2
    assert image_rows_to_tokens(ours, cfg) == [tokens] * len(images)
    assert {image_tokens(meta["width"], meta["height"], cfg)
            for _, _, meta, _ in images} == {tokens}


def test_image_above_pillows_memory_block_equals_siglip_processor(images):
    # Pillow lends the pixels of an image held in one memory block; a larger image is copied.
    size = 2100
    assert size * size * 4 > Image.core.get_block_size()
    cfg = ImageConfig(policy="fixed", image_size=size)
    reference = SiglipImageProcessorPil(size={"height": size, "width": size},
                                        image_mean=list(cfg.mean), image_std=list(cfg.std))
    name, data, meta, original = next(entry for entry in images if entry[2]["mode"] == "RGB")
    expected = reference([original], return_tensors="pt")["pixel_values"]
    ours = image_encoder_inputs([decode_image(data, meta["orientation"], cfg)], cfg)
    torch.testing.assert_close(normalize_pixels(ours["pixel_values"], cfg), expected,
                               rtol=0, atol=1e-5)


def test_image_above_pillows_memory_block_equals_qwen2vl_processor(images):
    """The copied pixels of a large image go through the same patchify as lent ones."""
    pixels = 2100 * 2100
    assert pixels * 4 > Image.core.get_block_size()
    cfg = ImageConfig(min_pixels=pixels, max_pixels=pixels)
    reference = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                         patch_size=cfg.patch_size, merge_size=cfg.merge_size,
                                         temporal_patch_size=cfg.temporal_patch_size)
    _, data, meta, original = next(entry for entry in images if entry[2]["mode"] == "RGB")
    expected = reference([original], return_tensors="pt")
    ours = image_encoder_inputs([decode_image(data, meta["orientation"], cfg)], cfg)
    width, height = image_resized_size(meta["width"], meta["height"], cfg)
    assert width * height * 4 > Image.core.get_block_size()
    assert torch.equal(ours["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(normalize_pixels(ours["pixel_values"], cfg),
                               expected["pixel_values"], rtol=0, atol=1e-5)


def test_empty_image_list_gives_empty_inputs():
    cfg = ImageConfig()
    inputs = image_encoder_inputs([], cfg)
    assert inputs["pixel_values"].shape == (0, 3 * 14 * 14)
    assert inputs["image_grid_thw"].shape == (0, 3)
    assert image_rows_to_tokens(inputs, cfg) == []
    assert normalize_pixels(inputs["pixel_values"], cfg).shape == (0, 3 * 2 * 14 * 14)


def test_normalize_refuses_pixels_of_another_layout():
    cfg = ImageConfig()
    with pytest.raises(ValueError, match=r"expects \[patches, 588\]"):
        normalize_pixels(torch.zeros(4, 3 * 2 * 14 * 14, dtype=torch.uint8), cfg)


def test_rocket_is_turned_upright_as_its_metadata_says(images):
    name, data, meta, _ = image_named(images, "rocket.jpg")
    with Image.open(io.BytesIO(data)) as stored:
        stored_size = stored.size
        upright = np.asarray(ImageOps.exif_transpose(stored).convert("RGB"))
    assert meta["orientation"] == stored_orientation(data) == 6
    assert (meta["width"], meta["height"]) == stored_size[::-1] != stored_size
    decoded = decode_image(data, meta["orientation"], ImageConfig())
    assert decoded.mode == "RGB"
    assert decoded.size == (meta["width"], meta["height"])
    assert np.array_equal(np.asarray(decoded), upright)


def test_an_image_whose_pixels_disagree_with_its_metadata_is_refused(images):
    """A sample whose metadata states another size than the image decodes to (upright, as
    its EXIF orientation turns it): decoding raises, naming both sizes, rather than hand the
    encoder a grid its tokens were not counted for."""
    _, data, meta, _ = image_named(images, "rocket.jpg")           # EXIF-rotated
    width, height = meta["width"], meta["height"]
    item = {"modality": "image", "member": "img0.jpg", **meta}
    assert IMAGE.decode(data, item, ImageConfig()).size == (width, height)
    for stated in ((width + 1, height), (width, height - 1), (height, width)):
        with pytest.raises(ValueError) as caught:
            IMAGE.decode(data, {**item, "width": stated[0], "height": stated[1]}, ImageConfig())
        assert str(caught.value) == (f"decodes to {width}x{height}, the metadata says "
                                     f"{stated[0]}x{stated[1]}")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_matches_pillow(images, orientation):
    """The rocket's pixels saved losslessly with each EXIF orientation tag."""
    _, data, _, _ = image_named(images, "rocket.jpg")
    with Image.open(io.BytesIO(data)) as stored:
        exif = Image.Exif()
        exif[ORIENTATION_TAG] = orientation
        buffer = io.BytesIO()
        stored.save(buffer, format="PNG", exif=exif)
    tagged = buffer.getvalue()
    meta = probe_image(tagged)
    assert meta["orientation"] == orientation
    with Image.open(io.BytesIO(tagged)) as image:
        expected = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    decoded = decode_image(tagged, meta["orientation"], ImageConfig())
    assert decoded.size == (meta["width"], meta["height"])
    assert np.array_equal(np.asarray(decoded), expected)


def png_bytes(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def test_transparency_is_composited_on_white_like_transformers(images):
    """The corpus logo's alpha is opaque everywhere, so the horse silhouette serves as the
    alpha of a photo (RGBA) and as the transparent key of a grayscale PNG (tRNS)."""
    cfg = ImageConfig()
    _, _, _, logo = image_named(images, "logo.png")
    _, _, _, horse = image_named(images, "horse.png")
    _, _, _, photo = image_named(images, "astronaut.jpg")
    mask = np.asarray(horse)
    assert logo.mode == "RGBA" and horse.mode == "L"
    assert (mask == 0).any() and (mask == 255).any()

    rgba = photo.crop((0, 0, *horse.size)).convert("RGBA")
    rgba.putalpha(horse)
    keyed = png_bytes(horse, transparency=0)
    for data, covered in ((png_bytes(rgba), np.asarray(rgba)[..., :3]), (keyed, mask[..., None])):
        with Image.open(io.BytesIO(data)) as opened:
            assert "A" in opened.getbands() or opened.info.get("transparency") == 0
            expected = convert_to_rgb(opened, return_numpy=True)
        decoded = np.asarray(decode_image(data, 1, cfg))
        assert np.array_equal(decoded, expected)
        assert (decoded[mask == 0] == 255).all()                   # white, not black
        opaque = mask == 255
        assert np.array_equal(decoded[opaque], np.broadcast_to(covered, decoded.shape)[opaque])


def test_grayscale_becomes_three_equal_channels(images):
    _, camera, meta, reference = image_named(images, "camera.png")
    assert meta["mode"] == "L"
    decoded = np.asarray(decode_image(camera, 1, ImageConfig()))
    assert decoded.shape == (meta["height"], meta["width"], 3)
    assert all(np.array_equal(decoded[..., c], np.asarray(reference)) for c in range(3))


def test_image_above_the_pixel_limit_is_refused(images):
    _, data, meta, _ = image_named(images, "retina.jpg")
    pixels = meta["width"] * meta["height"]
    limit = f"{pixels} pixels.*max_image_pixels = {pixels - 1}"
    with pytest.raises(MediaError, match=limit) as info:
        decode_image(data, 1, ImageConfig(max_image_pixels=pixels - 1))
    assert info.value.reason == "image_too_large"
    assert decode_image(data, 1, ImageConfig(max_image_pixels=pixels)).size == (
        meta["width"], meta["height"])


@pytest.mark.parametrize("name", ["coffee.jpg", "horse.png"])
def test_corrupt_image_bytes_raise_a_clear_error(images, name):
    _, data, _, _ = image_named(images, name)
    for broken in (data[:len(data) // 2], b"not an image at all", b""):
        with pytest.raises(MediaError, match="cannot decode image") as info:
            decode_image(broken, 1, ImageConfig())
        assert info.value.reason == "corrupt_image"
        assert " at 0x" not in info.value.detail                 # no BytesIO's address
    with pytest.raises(MediaError, match="not a readable image"):
        decode_image(b"root:x:0:0:root:/root:/bin/bash\n", 1, ImageConfig())


def test_heic_photos_and_svg_drawings_are_named_as_formats_to_convert(corpus):
    """An iPhone's HEIC photo (an ISO base media file of brand heic or mif1) and an SVG drawing
    (after a BOM or a doctype, or gzipped) are no format Pillow reads: the build names them as
    such, to convert, not as corrupt bytes; an AVIF file (brand avif), which Pillow reads, is
    not taken for HEIC, nor other gzipped bytes for an SVG. A video or speech clip given as an
    image is named as what it is."""
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)
    heif = b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00mif1heic" + bytes(64)
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>'
    doctype = b'\xef\xbb\xbf<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN">\n<svg/>'  # a BOM
    svgz = gzip.compress(svg)
    for data, kind in ((heic, "HEIC/HEIF"), (heif, "HEIC/HEIF"), (svg, "SVG"),
                       (b"  <svg width='1'/>", "SVG"), (doctype, "SVG"), (svgz, "SVG")):
        with pytest.raises(MediaError, match=f"{kind}.*which Pillow does not read") as info:
            probe_image(data)
        assert info.value.reason == "unsupported_format"
    for other in (gzip.compress(b"not an image"), b"\x1f\x8b not gzip at all"):
        with pytest.raises(MediaError, match="not a readable image"):
            probe_image(other)
    # a corpus video or speech clip given as an image is named as what it is
    for name, kind in (("videos/pan_h264_24.mp4", "MP4/MOV video"),
                       ("videos/pan_vp9_30.webm", "WebM/Matroska video"),
                       ("audio/cards-001.wav", "WAV audio"), ("audio/cards-003.flac", "FLAC")):
        with pytest.raises(MediaError, match=f"{kind}.*not an image: give it as a video or "):
            probe_image((corpus / name).read_bytes())
    # an ISO base media file of an image brand (a Canon CR3 raw photo) is no video
    with pytest.raises(MediaError, match="not a readable image"):
        probe_image(b"\x00\x00\x00\x18ftypcrx \x00\x00\x00\x01crx isom" + bytes(64))
    with pytest.raises(MediaError, match="not a readable image") as info:
        probe_image(b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf" + bytes(64))
    assert info.value.reason == "corrupt_image"


def test_a_one_channel_image_wider_than_8_bits_is_refused_where_rgb_would_clip_it():
    """A 16-bit grayscale PNG or TIFF (medical and scientific images) converted to RGB, as
    transformers' ``convert_to_rgb`` does, is clipped to 0-255: near-white, silently. Where its
    values pass 255 the build refuses it, saying to scale it to 8 bits, under both checks;
    where they do not, it is read, and decodes as transformers' conversion gives it."""
    from transformers.image_transforms import convert_to_rgb
    wide = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    clipped = np.asarray(convert_to_rgb(Image.fromarray(wide)))
    assert clipped.mean() > 250 > wide.mean() / 257 + 100        # what training would see
    for fmt in ("PNG", "TIFF"):
        for values, refused in ((wide, True), (wide // 257, False)):
            buffer = io.BytesIO()
            Image.fromarray(values).save(buffer, format=fmt)
            data = buffer.getvalue()
            for check in ("decode", "header"):
                if refused:
                    with pytest.raises(MediaError, match="scale it to 8 bits") as info:
                        probe_image(data, check=check)
                    assert info.value.reason == "unsupported_format"
                else:
                    assert probe_image(data, check=check)["mode"] == "I;16"
            if not refused:
                assert np.array_equal(np.asarray(decode_image(data, 1, ImageConfig())),
                                      np.asarray(convert_to_rgb(Image.open(io.BytesIO(data)))))
    # a float image scaled to 0-1 (black once clipped) and negative integers, as TIFFs
    ramp = np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    for image, refused in ((Image.fromarray(ramp, mode="F"), "fractional values"),
                           (Image.fromarray(np.round(ramp * 255), mode="F"), None),
                           (Image.fromarray((ramp * 100 - 5).astype(np.int32), mode="I"),
                            "values from -5 to 95")):
        buffer = io.BytesIO()
        image.save(buffer, format="TIFF")
        if refused:
            with pytest.raises(MediaError, match=refused) as info:
                probe_image(buffer.getvalue())
            assert info.value.reason == "unsupported_format"
        else:
            assert probe_image(buffer.getvalue())["mode"] == "F"


def test_extreme_aspect_ratio_is_refused_like_smart_resize():
    cfg = ImageConfig()
    with pytest.raises(ValueError):
        smart_resize(40, 40 * 201, factor=28)
    with pytest.raises(ValueError, match=r"8040x40 pixels.*aspect ratio above 200"):
        image_tokens(40 * 201, 40, cfg)
    assert image_tokens(40 * 200, 40, cfg) > 0     # exactly 200:1 is accepted, as upstream
    smart_resize(40, 40 * 200, factor=28)


# -------------------------------------------------------------------------------- audio

def whisper_reference(waveform: np.ndarray, cfg: AudioConfig, **kwargs):
    extractor = WhisperFeatureExtractor(feature_size=cfg.n_mels, sampling_rate=cfg.sample_rate,
                                        hop_length=cfg.hop_length)
    return extractor(waveform, sampling_rate=cfg.sample_rate, return_attention_mask=True,
                     return_tensors="pt", **kwargs)


def reference_waveform(data: bytes, cfg: AudioConfig) -> np.ndarray:
    """soundfile + torchaudio resample, written out here independently of decode_audio."""
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    waveform = torch.from_numpy(samples if samples.ndim == 1 else samples.mean(axis=1))
    if rate != cfg.sample_rate:
        waveform = torchaudio.functional.resample(waveform, rate, cfg.sample_rate)
    return waveform.numpy()


@pytest.mark.parametrize("n_mels", [80, 128])
def test_audio_features_and_tokens_match_whisper(clips, n_mels):
    cfg = AudioConfig(n_mels=n_mels)
    waveforms = [decode_audio(data, cfg) for _, data, _ in clips]
    inputs = audio_encoder_inputs(waveforms, cfg)
    assert inputs["input_features"].dtype == torch.float32
    assert inputs["input_features"].shape == (int(inputs["feature_lens"].sum()), n_mels)
    start = 0
    for (name, data, _), waveform, frames in zip(clips, waveforms,
                                                    inputs["feature_lens"].tolist()):
        assert np.array_equal(waveform, reference_waveform(data, cfg)), name
        unpadded = whisper_reference(waveform, cfg, padding="longest", truncation=False)
        assert frames == int(unpadded["attention_mask"].sum()) == audio_frames(len(waveform), cfg)
        # the extractor's own 30 s features over the clip: its last frames included, which see
        # the zeros it pads the clip with
        padded = whisper_reference(waveform, cfg)["input_features"][0, :, :frames]
        torch.testing.assert_close(inputs["input_features"][start:start + frames], padded.T,
                                   rtol=0, atol=1e-6)
        start += frames
    from_metadata = [audio_tokens(meta["frames"], meta["sample_rate"], cfg)
                     for _, _, meta in clips]
    assert audio_rows_to_tokens(inputs, cfg) == from_metadata


def test_opus_written_by_ffmpeg_decodes_from_its_first_sample(clips):
    """An Ogg Opus clip from ffmpeg's libopus (a pre-skip of 312 samples at 48 kHz, which
    soundfile's own writer leaves out): decoded as soundfile.read and ffmpeg decode it, from
    the clip's first sample, not from the encoder's warm-up 6.5 ms early."""
    cfg = AudioConfig()
    speech = reference_waveform(clips[0][1], AudioConfig(sample_rate=48_000))
    out = io.BytesIO()
    with av.open(out, "w", format="ogg") as container:
        stream = container.add_stream("libopus", rate=48_000)
        frame = av.AudioFrame.from_ndarray(speech[None], format="flt", layout="mono")
        frame.sample_rate = 48_000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    data = out.getvalue()
    waveform = decode_audio(data, cfg)
    assert probe_audio(data)["frames"] == len(speech)
    assert np.array_equal(waveform, reference_waveform(data, cfg))
    with av.open(io.BytesIO(data)) as container:                # ffmpeg's own decode
        decoded = np.concatenate([f.to_ndarray().mean(axis=0) for f in container.decode(audio=0)])
    ffmpeg = torchaudio.functional.resample(torch.from_numpy(decoded[:len(speech)]), 48_000,
                                            cfg.sample_rate).numpy()
    assert np.abs(waveform - ffmpeg).max() < 1e-3


def test_audio_tokens_are_the_encoder_convolutions_output_length(clips):
    """ceil(frames / 2) per reduction is the output length of Whisper's stride-2 convolution."""
    cfg = AudioConfig()
    assert cfg.reductions == (2, 2)
    inputs = audio_encoder_inputs([decode_audio(data, cfg) for _, data, _ in clips], cfg)
    lengths = inputs["feature_lens"].tolist()
    assert len({frames % 4 for frames in lengths}) > 1
    conv = torch.nn.Conv1d(cfg.n_mels, cfg.n_mels, kernel_size=3, stride=2, padding=1)
    expected = []
    with torch.no_grad():
        for features in inputs["input_features"].split(lengths):
            hidden = features.T[None]
            for _ in cfg.reductions:
                hidden = conv(hidden)
            expected.append(hidden.shape[-1])
    assert audio_rows_to_tokens(inputs, cfg) == expected


def test_resampled_length_is_torchaudios(clips):
    """Including lengths where torchaudio's float32 ceil is one below the exact ceiling."""
    _, data, meta = next(c for c in clips if c[2]["sample_rate"] == 22050)
    samples, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    exact_is_off = 0
    for frames in (meta["frames"], 99_830, 300_044, 441 * 1000 + 1, 1):
        audio = torch.from_numpy(np.resize(samples, frames))
        produced = len(torchaudio.functional.resample(audio, 22050, 16000))
        assert resampled_length(frames, 22050, 16000) == produced, frames
        exact_is_off += produced != -(-frames * 16000 // 22050)
    assert exact_is_off >= 2
    assert resampled_length(meta["frames"], 16000, 16000) == meta["frames"]


def test_truncate_policy_cuts_long_clips(clips, monkeypatch):
    """The cut clip's samples are the whole clip's resampled, cut: a long clip decoded up to
    the cut and a margin only (a 20-minute clip whole took seconds for 30 s kept)."""
    cfg = AudioConfig(max_duration=1.5, long_audio="truncate")
    limit = int(1.5 * cfg.sample_rate)
    read, frames_read = soundfile.SoundFile.read, []

    def counted(self, *args, **kwargs):
        frames_read.append(len(samples := read(self, *args, **kwargs)))
        return samples
    monkeypatch.setattr(soundfile.SoundFile, "read", counted)
    waveforms = [decode_audio(data, cfg) for _, data, _ in clips]
    monkeypatch.undo()
    full = [reference_waveform(data, cfg) for _, data, _ in clips]
    assert any(len(f) > limit for f in full) and any(len(f) <= limit for f in full)
    for waveform, reference in zip(waveforms, full):
        assert np.array_equal(waveform, reference[:limit])
    longest = max(range(len(clips)), key=lambda i: clips[i][2]["duration"])
    assert clips[longest][2]["duration"] > 3 and \
        frames_read[longest] < clips[longest][2]["frames"] / 2, frames_read
    inputs = audio_encoder_inputs(waveforms, cfg)
    assert max(inputs["feature_lens"].tolist()) == limit // cfg.hop_length
    assert audio_rows_to_tokens(inputs, cfg) == [
        audio_tokens(meta["frames"], meta["sample_rate"], cfg) for _, _, meta in clips]
    assert not any(audio_too_long(meta["frames"], meta["sample_rate"], cfg)
                   for _, _, meta in clips)


def test_drop_policy_refuses_exactly_the_long_clips(clips):
    cfg = AudioConfig(max_duration=2.0, long_audio="drop")
    kept = 0
    for name, data, meta in clips:
        too_long = audio_too_long(meta["frames"], meta["sample_rate"], cfg)
        assert too_long == (len(reference_waveform(data, cfg)) > 2 * cfg.sample_rate), name
        if too_long:
            with pytest.raises(MediaError, match="longer than max_duration = 2.0 s") as info:
                decode_audio(data, cfg)
            assert info.value.reason == "audio_too_long"
        else:
            kept += 1
            assert len(decode_audio(data, cfg)) == len(reference_waveform(data, cfg))
    assert 0 < kept < len(clips)


def test_max_duration_boundary_is_inclusive(clips):
    _, data, meta = next(c for c in clips if c[2]["sample_rate"] == 16000)
    exact = AudioConfig(max_duration=meta["frames"] / 16000)
    shorter = AudioConfig(max_duration=(meta["frames"] - 1) / 16000)
    assert not audio_too_long(meta["frames"], 16000, exact)
    assert len(decode_audio(data, exact)) == meta["frames"]
    assert audio_too_long(meta["frames"], 16000, shorter)
    with pytest.raises(MediaError):
        decode_audio(data, shorter)


def test_stereo_is_downmixed_then_resampled(clips):
    cfg = AudioConfig()
    pair = [c for c in clips if c[2]["sample_rate"] == 22050][:2]
    left, right = (soundfile.read(io.BytesIO(data), dtype="float32")[0] for _, data, _ in pair)
    frames = min(len(left), len(right))
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([left[:frames], right[:frames]], axis=1), 22050,
                    format="WAV", subtype="FLOAT")
    stereo = buffer.getvalue()
    assert probe_audio(stereo)["channels"] == 2
    mono = (left[:frames] + right[:frames]) / 2
    expected = torchaudio.functional.resample(torch.from_numpy(mono), 22050, 16000).numpy()
    decoded = decode_audio(stereo, cfg)
    np.testing.assert_allclose(decoded, expected, rtol=0, atol=1e-6)
    assert audio_rows_to_tokens(audio_encoder_inputs([decoded], cfg), cfg) == [
        audio_tokens(frames, 22050, cfg)]


def encoded(samples: np.ndarray, rate: int, format: str = "WAV", **kwargs) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=format, **kwargs)
    return buffer.getvalue()


def test_corrupt_and_too_short_audio_raise_clear_errors(clips):
    cfg = AudioConfig()
    _, data, _ = next(c for c in clips if c[0].endswith(".flac"))
    for broken in (data[:40], b"RIFF\x00\x00not audio", b""):
        with pytest.raises(MediaError, match="soundfile cannot decode") as info:
            decode_audio(broken, cfg)
        assert info.value.reason == "corrupt_audio"
        assert "0x" not in info.value.detail, "no memory address: report.json is stable"
    waveform = decode_audio(data, cfg)
    with pytest.raises(MediaError, match=f"shorter than the {MIN_AUDIO_SAMPLES} samples") as info:
        audio_features(waveform[:MIN_AUDIO_SAMPLES - 1], cfg)
    assert info.value.reason == "audio_too_short"
    assert audio_features(waveform[:MIN_AUDIO_SAMPLES], cfg).shape == (1, cfg.n_mels)


def test_truncated_audio_is_corrupt_not_a_shorter_clip(clips):
    """An MP3 cut in half keeps its header's (Xing) frame count but decodes half of them: the
    build refuses it, and training drops it rather than count tokens for frames it lacks. A
    WAV cut after the build decodes fewer frames than its shard metadata."""
    cfg = AudioConfig()
    name, wav, meta = next(c for c in clips if c[2]["frames"] > 100_000)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    mp3 = encoded(samples, rate, format="MP3")
    assert probe_audio(mp3)["frames"] == len(samples)
    cut = mp3[:len(mp3) // 2]
    stated = probe_audio(cut, "header")["frames"]
    assert stated == len(samples)
    header = f"of the {stated} frames its header states"
    for decode, message in ((lambda: probe_audio(cut), header),
                            (lambda: decode_audio(cut, cfg), header),
                            (lambda: AUDIO.decode(cut, {"frames": stated}, cfg),
                             f"the shard metadata says {stated}"),
                            (lambda: AUDIO.decode(wav[:len(wav) // 2], meta | {"member": name},
                                                  cfg),
                             f"the shard metadata says {meta['frames']}")):
        with pytest.raises(MediaError, match=message) as info:
            decode()
        assert info.value.reason == "corrupt_audio"


def test_an_mp3_that_states_no_length_is_counted_as_it_decodes(clips):
    """An MP3 without a Xing, Info or VBRI header (FFmpeg's ``write_xing=0``: a stream written to
    a pipe) states no length: libsndfile estimates one from the file's size and first bitrate,
    a leading ID3 tag (cover art) counted as audio. Its frames are the ones that decode, under
    both build checks and when training decodes it; an MP3 that states its length still has its
    truncation found."""
    _, wav, _ = next(c for c in clips if c[2]["frames"] > 100_000)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp3", options={"write_xing": "0"}) as container:
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    # a VBRI header (Fraunhofer's), which libsndfile's mpg123 does not read, states no length
    plain = bytearray(buffer.getvalue())
    first = 10 + sum(byte << 7 * (3 - k) for k, byte in enumerate(plain[6:10])) \
        if plain[:3] == b"ID3" else 0                          # FFmpeg's tag: syncsafe size
    first = plain.index(b"\xff", first)
    plain[first + 36:first + 40] = b"VBRI"
    vbri = bytes(plain)
    size = 300_000
    cover = b"ID3\x04\x00\x00" + bytes((size >> shift) & 0x7F for shift in (21, 14, 7, 0)) + \
        bytes(size)
    cfg = AudioConfig()
    for data in (buffer.getvalue(), cover + buffer.getvalue(), vbri):
        decoded = len(soundfile.read(io.BytesIO(data), dtype="float32")[0])
        assert soundfile.info(io.BytesIO(data)).frames != decoded     # libsndfile's estimate
        for check in ("decode", "header"):
            assert probe_audio(data, check)["frames"] == decoded
        assert len(decode_audio(data, cfg)) == resampled_length(decoded, rate, cfg.sample_rate)
    stated = encoded(samples, rate, format="MP3")      # libsndfile's LAME writes a Xing header
    with pytest.raises(MediaError, match="frames its header states decode"):
        probe_audio(stated[:len(stated) // 2])


def test_wav_and_ogg_files_cut_short_are_corrupt_not_shorter_clips(clips):
    """libsndfile reads a WAV (RIFF, WAVEX, RF64, Wave64) or an Ogg (Vorbis, Opus) file cut
    short to where its bytes end, and two chained Ogg streams to the first's end, and states
    that as the length: the build would pair the transcript with part of the clip. Each is
    refused, under both build checks: cut in half, one byte short (a WAV; an Ogg page), an Ogg
    cut between two pages, chained Ogg streams (``cat a.ogg b.ogg``). Whole files, streaming
    writers' WAVs (data sizes of 0xFFFFFFFF, arecord's 0x80000000 and 0x7fffff00, sox's
    0x7ffff000) and an Ogg file with a tagger's ID3v1 tag after its last page are read in
    full."""
    name, wav, meta = next(c for c in clips if c[2]["frames"] > 100_000)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    files = [(fmt, encoded(samples, 48_000 if subtype == "OPUS" else rate, format=fmt,
                           subtype=subtype))
             for fmt, subtype in (("WAV", "PCM_16"), ("WAVEX", "PCM_24"), ("RF64", "PCM_16"),
                                  ("W64", "PCM_16"), ("OGG", "VORBIS"), ("OGG", "OPUS"))]
    streamed = bytearray(wav)
    at = streamed.index(b"data")
    for placeholder in (0xFFFFFFFF, 0x80000000, 0x7FFFFF00, 0x7FFFF000):
        streamed[at + 4:at + 8] = placeholder.to_bytes(4, "little")
        assert probe_audio(bytes(streamed))["frames"] == meta["frames"]
    for fmt, data in files:
        assert probe_audio(data)["frames"] == len(samples), fmt
        if fmt == "OGG":
            assert probe_audio(data + b"TAG" + bytes(125))["frames"] == len(samples)
        # each with the frames recorded in it
        cuts = [(data[:len(data) // 2], len(samples)), (data[:-1], len(samples))]
        if fmt == "OGG":
            cuts += [(data[:data.rindex(b"OggS", 0, len(data) // 2)], len(samples)),
                     (data + data, 2 * len(samples))]
        for cut, recorded in cuts:
            assert soundfile.info(io.BytesIO(cut)).frames < recorded, "libsndfile reads less"
            for check in ("decode", "header"):
                with pytest.raises(MediaError, match="a shorter clip than was recorded") as info:
                    probe_audio(cut, check)
                assert info.value.reason == "corrupt_audio", (fmt, check)


def test_float_wav_with_nan_or_inf_samples_is_corrupt(clips):
    """A float WAV (32- or 64-bit) holding NaN or infinite samples decodes to
    NaN log-mels, and every step it is in trains a NaN loss (skipped). It is refused at build
    under both checks, as a Parquet array holding NaN is; a finite float WAV past 1 is kept."""
    _, wav, _ = next(c for c in clips if c[2]["frames"] > 10_000)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    loud = encoded(samples * 5, rate, format="WAV", subtype="FLOAT")
    assert probe_audio(loud)["frames"] == len(samples)
    for bad in (np.nan, np.inf):
        broken = samples.copy()
        broken[len(samples) // 2] = bad
        for subtype in ("FLOAT", "DOUBLE"):
            data = encoded(broken, rate, format="WAV", subtype=subtype)
            for check in ("decode", "header"):
                with pytest.raises(MediaError, match="NaN or infinite") as info:
                    probe_audio(data, check)
                assert info.value.reason == "corrupt_audio"


def test_a_flac_written_to_a_pipe_is_refused_under_either_check():
    """A FLAC whose header states no length (FFmpeg's `-f flac pipe:`; here PyAV writing a
    second of a tone to a stream it cannot seek): libsndfile counts 2^63 - 1 frames and cannot
    read it; refused with the way to write it again, not kept under --check header with a
    5.8e14 s duration."""
    rate = 16000
    samples = (np.sin(np.arange(rate) / 10) * 0.3).astype(np.float32)

    class Pipe(io.RawIOBase):
        def __init__(self):
            self.written = bytearray()

        def writable(self):
            return True

        def write(self, data):
            self.written += data
            return len(data)

    pipe = Pipe()
    with av.open(pipe, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):     # muxed before the flush: the header is
            container.mux(packet)               # written not knowing the length
        for packet in stream.encode(None):
            container.mux(packet)
    with soundfile.SoundFile(io.BytesIO(bytes(pipe.written))) as sound:
        assert sound.frames == 2 ** 63 - 1          # what it is made to show
    for check in ("header", "decode"):
        with pytest.raises(MediaError, match="header states no length .* ffmpeg -i IN "
                           "OUT.flac") as refused:
            probe_audio(bytes(pipe.written), check)
        assert refused.value.reason == "unsupported_format"


def test_wav_variants_and_other_containers(clips, corpus_photos, corpus_videos):
    """FFmpeg writes 24-bit PCM as WAVE_FORMAT_EXTENSIBLE (soundfile's WAVEX); RF64 and W64
    are WAV's 64-bit variants: all decode as the WAV. AAC in an .m4a (FFmpeg opens it, libsndfile
    does not) is an unsupported format, named with what to do; so are a photo and a video
    without sound given as audio (the mix-up named, not corrupt bytes)."""
    cfg = AudioConfig()
    _, wav, meta = next(c for c in clips if c[2]["sample_rate"] == 22050)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    expected = decode_audio(wav, cfg)
    for fmt, extension in (("WAVEX", "wav"), ("RF64", "wav"), ("W64", "w64")):
        data = encoded(samples, rate, format=fmt, subtype="PCM_24")
        found = probe_audio(data)
        assert (found["format"], found["frames"]) == (fmt.lower(), meta["frames"])
        assert AUDIO.member(0, found["format"]) == f"aud0.{extension}"
        np.testing.assert_allclose(decode_audio(data, cfg), expected, rtol=0, atol=1e-4)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    for check in ("decode", "header"):
        with pytest.raises(MediaError, match=r"the audio, aac in mov,mp4.*, is not a format "
                           r"mimo reads \(WAV, FLAC, .*\): convert it first, e.g. `ffmpeg") as info:
            probe_audio(buffer.getvalue(), check)
        assert info.value.reason == "unsupported_format"
    photo = next(data for name, data, *_ in corpus_photos if name.endswith(".jpg"))
    silent = next(clip for clip in corpus_videos.values() if not clip.has_audio)
    for data, said in ((photo, "a JPEG image, not audio: give it as an image"),
                       (silent.data, rf"a video without sound \({silent.codec} in .*\), not "
                                     "audio: give it as a video")):
        with pytest.raises(MediaError, match=said) as info:
            probe_audio(data)
        assert info.value.reason == "unsupported_format"


def test_rates_with_a_huge_sinc_kernel_resample_with_ffmpeg(clips, monkeypatch):
    """torchaudio's kernel for 16001 or 44056 -> 16000 Hz is 256M or 11M floats (its rates
    share no large factor); the usual rates keep torchaudio (the tests above: bit for bit).
    Decoding such a clip never calls torchaudio; at 44056 Hz it gives torchaudio's length and
    samples within 5e-3 (FFmpeg's and torchaudio's windowed-sinc filters differ slightly:
    ~1e-3 on speech)."""
    cfg = AudioConfig()
    for rate in (8000, 11025, 22050, 24000, 32000, 44100, 48000, 96000):
        assert resampler(rate, 16000) == "torchaudio", rate
    for rate in (16001, 11127, 22254, 44056):
        assert resampler(rate, 16000) == "ffmpeg", rate
    _, wav, _ = next(c for c in clips if c[2]["frames"] > 100_000)
    speech = soundfile.read(io.BytesIO(wav), dtype="float32")[0][:3 * 16000]
    relabelled = encoded(speech, 16001, subtype="FLOAT")
    odd = torchaudio.functional.resample(torch.from_numpy(speech), 16000, 44100).numpy()
    odd_rate = encoded(odd, 44056, subtype="FLOAT")             # the same samples, 44056 Hz
    reference = torchaudio.functional.resample(torch.from_numpy(odd), 44056, 16000).numpy()

    def refused(*args):
        raise AssertionError("torchaudio's resample called for an odd rate")
    monkeypatch.setattr(torchaudio.functional, "resample", refused)
    assert len(decode_audio(relabelled, cfg)) == resampled_length(len(speech), 16001, 16000)
    decoded = decode_audio(odd_rate, cfg)
    assert len(decoded) == len(reference) == resampled_length(len(odd), 44056, 16000)
    np.testing.assert_allclose(decoded, reference, rtol=0, atol=5e-3)


def test_empty_clip_list_gives_empty_inputs():
    cfg = replace(AudioConfig(), n_mels=128)
    inputs = audio_encoder_inputs([], cfg)
    assert inputs["input_features"].shape == (0, 128)
    assert inputs["feature_lens"].shape == (0,)
    assert audio_rows_to_tokens(inputs, cfg) == []


@pytest.mark.parametrize("long_audio", ["drop", "truncate"])
def test_audio_metadata_tokens_equal_decoded_rows_at_odd_rates_and_window_edges(long_audio):
    """Around the smallest clip and the 30 s window, at a low rate, a rate that resamples with
    FFmpeg and a high one: the count from the probed metadata (what the placeholders get) is
    the decoded clip's row count, or both are the same drop."""
    cfg, modality = AudioConfig(long_audio=long_audio), AUDIO
    rng = np.random.default_rng(0)
    for rate in (4000, 16001, 96000):
        for seconds in (0.0126, 0.02, 29.999, 30.0, 30.01):
            out = io.BytesIO()
            soundfile.write(out, 0.1 * rng.standard_normal(round(seconds * rate)).astype(
                np.float32), rate, format="WAV", subtype="PCM_16")
            data = out.getvalue()
            item = probe_audio(data) | {"member": "aud0.wav"}
            outcomes = []
            for count in (lambda item=item: modality.item_tokens(item, cfg),
                          lambda data=data, item=item: audio_rows_to_tokens(
                              audio_encoder_inputs([modality.decode(data, item, cfg)], cfg),
                              cfg)[0]):
                try:
                    outcomes.append(count())
                except MediaError as exc:
                    outcomes.append(exc.reason)
            assert outcomes[0] == outcomes[1], (rate, seconds, outcomes)
            if seconds == 30.01:
                assert outcomes[0] == (750 if long_audio == "truncate" else "audio_too_long")
