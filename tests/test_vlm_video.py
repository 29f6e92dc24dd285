"""Videos through a whole Qwen2-VL / Qwen2.5-VL checkpoint's one vision tower.

- M-RoPE positions of samples mixing text, images and videos equal the published checkpoints'
  own (``published_positions``): each item placed as transformers' ``get_rope_index`` of each
  family places it (Qwen2.5-VL's time positions scaled by its ``tokens_per_second`` and the
  seconds each temporal patch spans, ``second_per_grid_ts``, computed here from the clip's
  frame count, frame rate and the processor's sampling rule), each run of text starting at the
  largest position before it plus one, as Qwen's own code and transformers up to 5.2 did
  (transformers from 5.3 starts the text after a clip at the clip's start plus its grid's
  larger side, which the corpus clips' time positions pass: both are asserted);
- the tower mimo builds from the checkpoint encodes a video as transformers'
  ``get_video_features`` does, with the image weights (one module serves both);
- a module serving images and videos returns their rows in placeholder order, and the
  language model sees one placeholder id per module;
- end to end (shards of video, image + video, two-video and text-only conversations from the
  corpus clips), the logits of the model mimo builds from each checkpoint equal transformers'
  own class (fp32, 1e-4), colocated; the non-colocated step (the tower on its own rank, its
  rows through the bridge) gives the colocated step's loss and gradients, and so does
  Qwen2.5-VL's language model under context parallelism (cp2 padded, cp4 packed, with pp2,
  with tp2 and sequence parallelism);
- what the checkpoint does not take is refused: another video token, wrap or time scaling, a
  module serving video whose encoder cannot encode it, a tower cut into other patches.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from mimo_data.modalities.video import VideoConfig, normalize_video_pixels
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor, media_item
from mimo_train.families.registry import preprocessing_for
from mimo_train.training.step import _shared_placeholders

from conftest import REPO, build_dataset
from support.runs import compare
from support.vlm_runs import TOLERANCE, colocated as run_colocated, layout_step, video_processor

MODELS = REPO / "assets" / "models"
CHECKPOINTS = {"qwen2-vl": MODELS / "tiny-qwen2-vl", "qwen2.5-vl": MODELS / "tiny-qwen2.5-vl"}
PIXELS = {"min_pixels": 3136, "max_pixels": 12544}      # small frames: a fast tower


def _turns(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(texts)]


def config_data(checkpoint) -> dict:
    """The checkpoint's preprocessing config (``preprocessing_for``), smaller frames, as YAML
    data."""
    data = preprocessing_for(str(checkpoint))
    for name in ("image", "video"):
        data["modalities"][name].update(PIXELS)
    data["modalities"]["video"].update(fps=4.0)
    return {**data, "seq_length": 1024}


def config_for(checkpoint) -> PreprocessConfig:
    return PreprocessConfig.from_dict(config_data(checkpoint))


@pytest.fixture(scope="module")
def media(corpus, corpus_videos) -> dict[str, bytes]:
    return {"cat": (corpus / "images" / "chelsea.jpg").read_bytes(),
            "pan": corpus_videos["pan_h264_24"].data, "zoom": corpus_videos["zoom_mpeg4_10"].data}


def _records(media: dict[str, bytes]) -> list[tuple[dict, dict]]:
    """(record, member bytes): a video question, an image then a video, two videos."""
    def record(key, messages, names):
        items = [media_item("image" if name == "cat" else "video", media[name], i)
                 for i, name in enumerate(names)]
        return ({"key": key, "messages": messages, "media": items},
                {item["member"]: media[name] for item, name in zip(items, names)})
    return [
        record("video", _turns("<video>\nWhat moves?", "The camera pans across a person."),
               ["pan"]),
        record("mixed", _turns("<image> A cat. Now <video> what is shown?", "A cat, closer."),
               ["cat", "zoom"]),
        record("two", _turns("First <video> then <video>: same scene?", "No."),
               ["zoom", "pan"]),
    ]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def family(request, media) -> dict:
    checkpoint = CHECKPOINTS[request.param]
    config = config_for(checkpoint)
    preprocessor = Preprocessor(config)         # one: its tokenizer takes seconds to load
    samples = [preprocessor(record, member_bytes) for record, member_bytes in _records(media)]
    return {"name": request.param, "checkpoint": checkpoint, "config": config,
            "batch": Collator(preprocessor)(samples)[0],
            "tokens": preprocessor.text.modality_token_ids}


@pytest.fixture(scope="module")
def reference(family):
    """transformers' own class for the family's checkpoint (fp32), loaded once for the tower
    and the logits checks."""
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(family["checkpoint"],
                                                       dtype=torch.float32).eval()


def second_per_grid(frames: int, fps: float, config: VideoConfig) -> float:
    """The processor's ``temporal_patch_size / sampled_fps``, its sampled count by its rule:
    ``frames / fps * config.fps`` within [min_frames, frames], down to a multiple of the
    temporal patch."""
    patch = config.temporal_patch_size
    wanted = min(max(frames / fps * config.fps, config.min_frames), frames)
    sampled = math.floor(wanted / patch) * patch
    return patch / (sampled / frames * fps)


def published_positions(positions: torch.Tensor, kinds: torch.Tensor, mask: torch.Tensor
                        ) -> torch.Tensor:
    """``positions`` (transformers' ``get_rope_index``, ``[3, B, S]``) as Qwen's own
    ``get_rope_index`` continues them: ``st_idx = llm_pos_ids_list[-1].max() + 1`` before each
    run of text and each item (``kinds``: ``mm_token_type_ids``), the items' own layout kept."""
    import itertools
    out = torch.zeros_like(positions)
    for row in range(positions.size(1)):
        real = mask[row].bool()
        given, placed, at = positions[:, row, real], [], 0
        for kind, run in itertools.groupby(kinds[row, real].tolist()):
            length = len(list(run))
            st_idx = int(placed[-1].max()) + 1 if placed else 0
            block = given[:, at:at + length]
            placed.append(torch.arange(length).expand(3, -1) + st_idx if kind == 0 else
                          block - block[:, :1].min() + st_idx)
            at += length
        out[:, row, real] = torch.cat(placed, dim=1)
    return out


def time_passes_side(grids: torch.Tensor, merge: int, intervals: list[float]) -> bool:
    """Whether some clip's last time position (its temporal patches at ``intervals``) passes
    its merged grid's larger side: where the published rule and transformers 5.3+'s place the
    text after it apart."""
    return any(int((t - 1) * interval) + 1 > max(h, w) // merge
               for (t, h, w), interval in zip(grids.tolist(), intervals))


def test_mrope_positions_equal_the_familys_get_rope_index(family, corpus_videos):
    from transformers import AutoConfig, Qwen2_5_VLModel, Qwen2VLModel
    config = AutoConfig.from_pretrained(family["checkpoint"])
    model = (Qwen2_5_VLModel if family["name"] == "qwen2.5-vl" else Qwen2VLModel)(config)
    batch, tokens = family["batch"], family["tokens"]
    inputs = batch["modality_inputs"]
    ids = batch["input_ids"]
    kinds = ((ids == tokens["image"]).int() + 2 * (ids == tokens["video"]).int())
    video = family["config"].modalities["video"]
    clips = [corpus_videos[name] for name in ("pan_h264_24", "zoom_mpeg4_10", "zoom_mpeg4_10",
                                            "pan_h264_24")]
    extra = {}
    if family["name"] == "qwen2.5-vl":
        assert video.tokens_per_second == config.vision_config.tokens_per_second == 4
        extra["second_per_grid_ts"] = torch.tensor(
            [second_per_grid(c.frames, c.fps, video) for c in clips])
    theirs, _ = model.get_rope_index(
        ids, mm_token_type_ids=kinds, image_grid_thw=inputs["image"]["image"]["image_grid_thw"],
        video_grid_thw=inputs["video"]["video"]["video_grid_thw"],
        attention_mask=batch["attention_mask"].long(), **extra)
    real = batch["attention_mask"]
    expected = published_positions(theirs, kinds, real)
    assert torch.equal(batch["position_ids"][:, real], expected[:, real])
    # the clips' time positions pass their grids' side (where transformers 5.3+'s rule
    # differs): the published rule is what is checked
    assert time_passes_side(inputs["video"]["video"]["video_grid_thw"], video.merge_size,
                            [float(s * config.vision_config.tokens_per_second)
                             for s in extra["second_per_grid_ts"]]
                            if "second_per_grid_ts" in extra else [1.0] * len(clips))
    before = real & ((ids == tokens["video"]).cumsum(1) == 0)   # images too: the two agree
    assert (before & (ids == tokens["image"])).any()
    assert torch.equal(theirs[:, before], expected[:, before])
    times = batch["position_ids"][0][ids == tokens["video"]]
    steps = sorted(set(times[:times.numel() // 2].tolist()))   # the first clip's
    assert len(steps) > 1
    if family["name"] == "qwen2.5-vl":    # seconds, not patches: steps above 1 apart
        assert steps[1] - steps[0] > 1


def _clip(path: Path, rate, frames: int, width: int, height: int, steps=None) -> Path:
    """An h264 clip made with PyAV: ``frames`` frames at ``rate``, or (``steps``) at those
    millisecond gaps in turn: a variable frame rate."""
    import fractions

    import av
    import numpy as np
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if steps:
            stream.codec_context.time_base = stream.time_base = fractions.Fraction(1, 1000)
        pts = 0
        for index in range(frames):
            pixels = np.zeros((height, width, 3), np.uint8)
            pixels[..., 0] = index * 255 // frames
            pixels[(index * 3) % height:(index * 3) % height + 5] = 255
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if steps:
                frame.pts, frame.time_base = pts, fractions.Fraction(1, 1000)
                pts += steps[index % len(steps)]
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.mark.parametrize("fps", [0.5, 2.0, 7.5])
def test_clips_at_unusual_rates_are_qwen2_5_vls_processor(fps, tmp_path):
    """Clips at 7, 29.97 and 60 frames a second and one of a variable rate, frames of sizes no
    multiple of 28: ``second_per_grid_ts``, grids, pixels and input ids as
    ``Qwen2_5_VLProcessor`` (its PyAV loading, sampling at ``fps``) writes them, and the
    M-RoPE time positions its ``get_rope_index`` gives (published rule for the text after)."""
    import fractions

    from transformers import AutoConfig, AutoProcessor, Qwen2_5_VLModel
    from transformers.video_utils import load_video
    checkpoint = CHECKPOINTS["qwen2.5-vl"]
    data = config_data(checkpoint)
    data["modalities"]["video"].update(fps=fps, max_frames=64)
    config = PreprocessConfig.from_dict(data)
    video = config.modalities["video"]
    clips = [_clip(tmp_path / "r7.mp4", 7, 21, 150, 94),
             _clip(tmp_path / "ntsc.mp4", fractions.Fraction(30000, 1001), 60, 130, 70),
             _clip(tmp_path / "r60.mp4", 60, 90, 98, 160),
             _clip(tmp_path / "vfr.mp4", 30, 50, 120, 90, steps=[10, 50, 33, 100, 20])]
    processor = AutoProcessor.from_pretrained(checkpoint)
    processor.video_processor = video_processor(video)
    preprocessor = Preprocessor(config)
    model = Qwen2_5_VLModel(AutoConfig.from_pretrained(checkpoint))
    wrapped = "<|vision_start|><|video_pad|><|vision_end|>"
    for clip in clips:
        data = clip.read_bytes()
        item = media_item("video", data, 0)
        sample = preprocessor({"key": clip.stem, "media": [item], "messages": _turns(
            "<video>\nWhat moves?", "A bar.")}, {item["member"]: data})
        batch = Collator(preprocessor)([sample])[0]
        frames, metadata = load_video(str(clip), backend="pyav")
        text = processor.apply_chat_template(_turns(f"{wrapped}\nWhat moves?", "A bar."),
                                             tokenize=False).removesuffix("\n")
        theirs = processor(text=[text], videos=[frames], video_metadata=[metadata],
                           do_sample_frames=True, fps=fps, return_tensors="pt")
        ours = batch["modality_inputs"]["video"]["video"]
        real = batch["attention_mask"][0].bool()
        assert torch.equal(batch["input_ids"][:, real], theirs["input_ids"]), clip.name
        assert torch.equal(ours["video_grid_thw"], theirs["video_grid_thw"]), clip.name
        assert torch.equal(normalize_video_pixels(ours["pixel_values_videos"], video),
                           theirs["pixel_values_videos"]), clip.name
        seconds = torch.tensor(theirs["second_per_grid_ts"])
        positions, _ = model.get_rope_index(
            theirs["input_ids"], mm_token_type_ids=theirs["mm_token_type_ids"],
            video_grid_thw=theirs["video_grid_thw"], attention_mask=theirs["attention_mask"],
            second_per_grid_ts=seconds)
        expected = published_positions(positions, theirs["mm_token_type_ids"],
                                       theirs["attention_mask"])
        assert torch.equal(batch["position_ids"][:, :, real], expected), (clip.name, seconds)


def test_the_tower_encodes_videos_as_transformers(family, reference):
    """The checkpoint's one tower, built by mimo, on the batch's videos and images."""
    from mimo_train.families.registry import ENCODERS, read_vlm
    config = family["config"]
    vlm = read_vlm(str(family["checkpoint"]))
    tower = ENCODERS[vlm.encoder_kind](config.modalities["image"], 0, 0, 0, vlm).eval()
    tower.take_also("video", config.modalities["video"])
    videos = family["batch"]["modality_inputs"]["video"]["video"]
    with torch.no_grad():
        ours = tower.encode("video", **videos)
        theirs = reference.model.get_video_features(
            pixel_values_videos=normalize_video_pixels(videos["pixel_values_videos"],
                                                       config.modalities["video"]),
            video_grid_thw=videos["video_grid_thw"]).pooler_output
    theirs = torch.cat(theirs) if isinstance(theirs, (list, tuple)) else theirs
    assert len(ours) == int((family["batch"]["input_ids"] == family["tokens"]["video"]).sum())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_one_module_gets_its_placeholders_in_token_order():
    image, video, text = 7, 9, 1
    ids = torch.tensor([[text, image, image, video, text, video],
                        [video, video, text, image, text, text]])
    kinds, rewritten = _shared_placeholders(ids, [image, video])
    assert kinds.tolist() == [0, 0, 1, 1, 1, 1, 0]
    assert rewritten.tolist() == [[text, image, image, image, text, image],
                                  [image, image, text, image, text, text]]


def test_a_module_serving_images_and_videos_interleaves_their_rows():
    from mimo_train.config import EncoderConfig
    from mimo_train.families.base import Encoder
    from mimo_train.model.build import _SeededEncoder
    from mimo_train.plan.encoders import EncoderSetting
    image_config = PreprocessConfig(tokenizer=str(CHECKPOINTS["qwen2-vl"])).modalities["image"]
    video_config = dataclasses.replace(VideoConfig(), **PIXELS)
    module = _SeededEncoder(0, "image", EncoderSetting(
        "image", image_config, EncoderConfig(hidden_size=16, num_layers=1,
                                             num_attention_heads=2), "qwen2_vl",
        {"video": video_config}, 16, "none"))

    class Rows(torch.nn.Module):       # item k of a modality gives rows full of its tag
        def encode(self, modality, **inputs):
            return inputs["tag"]
        encode_together = Encoder.encode_together
    module.encoder = Rows()
    placeholders = torch.tensor([1, 0, 0, 1, 0])
    out = module(placeholders=placeholders, image={"tag": torch.tensor([[1.], [2.], [3.]])},
                 video={"tag": torch.tensor([[10.], [20.]])})
    assert out.squeeze(1).tolist() == [10., 1., 2., 20., 3.]


def test_what_encoders_read_on_the_host_stays_there():
    """``model_inputs`` for a device (``meta`` here, a GPU's stand-in): the tensors the
    encoders read on the host (the grids, the clip lengths, a shared module's placeholder
    order) stay on the host; every other tensor goes to the device."""
    from types import SimpleNamespace

    from mimo_data.loading.layout import Layout
    from mimo_train.training.step import model_inputs
    image, video = 7, 8
    ids = torch.tensor([[1, video, image, image, 2, video, 3, 0]])
    batch = {"input_ids": ids, "labels": ids.clone(), "loss_mask": torch.ones(1, 8),
             "position_ids": torch.arange(8)[None], "attention_mask": ids != 0,
             "modality_inputs": {
                 "image": {"image": {"pixel_values": torch.zeros(8, 588, dtype=torch.uint8),
                                     "image_grid_thw": torch.tensor([[1, 2, 4]])}},
                 "video": {"video": {"pixel_values_videos": torch.zeros(16, 1176),
                                     "video_grid_thw": torch.tensor([[2, 2, 4]])}},
                 "audio": {"audio": {"input_features": torch.zeros(1, 8, 30),
                                     "feature_lens": torch.tensor([30])}}}}
    infra = SimpleNamespace(layout=Layout.from_string("language=dp1;image=dp1,image,video;"
                                                      "audio=dp1,audio"))
    inputs = model_inputs(batch, infra, torch.device("meta"),
                          {"image": {"image": image, "video": video}})
    def devices(tree: dict, path: tuple = ()) -> dict:
        return {key: value for name, entry in tree.items() for key, value in (
            devices(entry, (*path, name)) if isinstance(entry, dict)
            else {(*path, name): entry.device.type}).items()}

    found = devices(inputs["modality_inputs"])
    # the module serving images and videos: its encoder's inputs by modality, and the
    # modality of each placeholder in token order
    host = {("image", "image", "image", "image_grid_thw"), ("image", "image", "placeholders"),
            ("image", "image", "video", "video_grid_thw"), ("audio", "audio", "feature_lens")}
    assert len(found) == 7 and host <= found.keys(), found
    assert found == {key: "cpu" if key in host else "meta" for key in found}, found
    assert inputs["modality_inputs"]["image"]["image"]["placeholders"].tolist() == [1, 0, 0, 1]
    assert all(inputs[key].is_meta for key in ("input_ids", "labels", "position_ids"))


@pytest.mark.parametrize("name, change, expected", [
    ("qwen2.5-vl", {"tokens_per_second": None},
     "positions videos with 4 time positions a second (its vision config's "
     "tokens_per_second): set modalities.video.tokens_per_second: 4"),
    ("qwen2-vl", {"tokens_per_second": 4.0}, "positions videos with one time position a "
     "temporal patch (no tokens_per_second): set modalities.video.tokens_per_second: null"),
    ("qwen2-vl", {"token": "<|vision_pad|>"}, "expects video tokens at 49155 "
     "('<|video_pad|>'): use it"),
    ("qwen2-vl", {"wrap": ()}, "expects each video between the tokens [49152, 49153] "
     "(['<|vision_start|>', '<|vision_end|>']): set modalities.video.wrap: ['<|vision_start|>'"),
    # what the checkpoint's video processor feeds its tower: normalization, frame sampling
    # (and Qwen3-VL's timestamps, below)
    ("qwen2.5-vl", {"mean": (0.5, 0.5, 0.5)}, "modalities.video.mean is [0.5, 0.5, 0.5], but "
     "model.pretrained"),
    ("qwen2-vl", {"sampling": "qwen3_vl"}, "modalities.video.sampling is qwen3_vl, but "
     "model.pretrained"),
    ("qwen3-vl", {"timestamps": False}, "modalities.video.timestamps is false, but "
     "model.pretrained"),
])
def test_videos_written_otherwise_than_the_checkpoint_expects_are_refused(name, change,
                                                                          expected):
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.errors import TrainConfigError
    from mimo_train.families.registry import read_vlm
    from mimo_train.families.preprocessing_fit import check_preprocessing
    checkpoint = {**CHECKPOINTS, "qwen3-vl": MODELS / "published" /
                  "Qwen--Qwen3-VL-2B-Instruct"}[name]
    config = config_for(checkpoint)
    video = dataclasses.replace(config.modalities["video"], **change)
    changed = dataclasses.replace(config, modalities={**config.modalities, "video": video})
    with pytest.raises(TrainConfigError) as error:
        check_preprocessing(read_vlm(str(checkpoint)), changed, load_tokenizer(changed),
                            ("image", "video"))
    assert expected in str(error.value)


def test_the_video_processor_is_read_from_any_file_that_gives_it(tmp_path):
    """The checkpoint's video inputs (``VLM.video_inputs``) from a video processor file that
    leaves keys to the class defaults (transformers loads it), from transformers 5's nested
    ``processor_config.json``, or from none (the family's sampling alone): never a KeyError
    that would stop every run of the checkpoint."""
    from mimo_train.families.registry import read_vlm

    def checkpoint(name: str, files: dict) -> str:          # one folder each: reads are cached
        folder = tmp_path / name
        folder.mkdir()
        source = CHECKPOINTS["qwen2-vl"]
        for each in os.listdir(source):
            if each not in ("preprocessor_config.json", "video_preprocessor_config.json"):
                os.symlink(source / each, folder / each)
        for each, data in files.items():
            (folder / each).write_text(json.dumps(data))
        return str(folder)
    family = (("sampling", "qwen2_vl"), ("timestamps", False))
    assert read_vlm(checkpoint("none", {})).video_inputs == family
    assert read_vlm(checkpoint("defaults", {"video_preprocessor_config.json": {
        "video_processor_type": "Qwen2VLVideoProcessor", "fps": 1.0}})).video_inputs == family
    nested = checkpoint("nested", {"processor_config.json": {"video_processor": {
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}})
    assert read_vlm(nested).video_inputs == (("mean", (0.5,) * 3), ("std", (0.5,) * 3),
                                             *family)
    # a nested file with the image processor's section alone: its normalization, as a
    # separate image processor file's stands in for a missing video one
    image_only = checkpoint("nested-image", {"processor_config.json": {"image_processor": {
        "image_mean": [0.25] * 3, "image_std": [0.75] * 3}}})
    assert read_vlm(image_only).video_inputs == (("mean", (0.25,) * 3), ("std", (0.75,) * 3),
                                                 *family)


def test_a_sample_too_long_for_its_videos_says_which_settings_shorten_it(media):
    """A video sample above seq_length, most of it the clip's tokens: the drop names the
    video settings that shorten it, beside raising seq_length. With Qwen3-VL's timestamps
    (a text and wraps every two frames) outweighing the clip's placeholders, fewer frames
    alone shortens it: pixels are not advised."""
    from mimo_data.preprocess.preprocessor import SampleDropped
    config = dataclasses.replace(config_for(CHECKPOINTS["qwen2-vl"]), seq_length=64)
    record, member_bytes = _records(media)[0]
    with pytest.raises(SampleDropped) as dropped:
        Preprocessor(config, with_media=False)(record)
    assert dropped.value.reason == "too_long"
    assert re.search(r"of them its videos': lower modalities.video fps \(\d.*\) or "
                     r"max_frames \(\d+\) for fewer frames, max_pixels \(\d+\) and min_pixels "
                     r"\(\d+, the floor of each frame\) for fewer tokens a frame, or cap the "
                     r"clip \(cap_pixels_per_frame with max_video_tokens\), or raise "
                     r"seq_length$", dropped.value.detail), dropped.value.detail
    timed = dataclasses.replace(config_for(MODELS / "published" / "Qwen--Qwen3-VL-2B-Instruct"),
                                seq_length=64)
    with pytest.raises(SampleDropped) as dropped:
        Preprocessor(timed, with_media=False)(record)
    assert re.search(r"of them its videos': (\d+) placeholders and (\d+) timestamp and wrap "
                     r"tokens \(a run of them every 2 frames, whatever a frame's pixels\): lower "
                     r"modalities.video fps \(\d.*\) or max_frames \(\d+\) for fewer frames, "
                     r"or raise seq_length$", dropped.value.detail), dropped.value.detail


@pytest.mark.parametrize("layout, expected", [
    ("language=dp1;video=dp1", "serves video, which no encoder takes on its own"),
    ("language=dp1;image=dp1,audio", "serves audio, image: give each its own encoder"),
])
def test_video_goes_to_a_tower_that_takes_it(layout, expected):
    from types import SimpleNamespace

    from mimo_data.loading.layout import Layout
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan.encoders import encoder_settings
    config = config_for(CHECKPOINTS["qwen2-vl"])
    config = dataclasses.replace(config, modalities={
        **config.modalities, "audio": PreprocessConfig(tokenizer=config.tokenizer
                                                       ).modalities["audio"]})
    cfg = SimpleNamespace(model=SimpleNamespace(encoders={}, pretrained=None))
    with pytest.raises(TrainConfigError, match=re.escape(expected)):
        encoder_settings(cfg, Layout.parse(layout), config, None)


def test_a_tower_refuses_video_cut_into_other_patches():
    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.qwen2_vl import Qwen2VLVision
    image = config_for(CHECKPOINTS["qwen2-vl"]).modalities["image"]
    tower = Qwen2VLVision(image, 16, 1, 2)
    with pytest.raises(EncoderBuildError, match="modalities.video temporal_patch_size 4 "
                       "differs from modalities.image's 2"):
        tower.take_also("video", dataclasses.replace(VideoConfig(), temporal_patch_size=4))


# id -> (conversation, clips, images): what the end-to-end shards hold
CONVERSATIONS = {
    "one-video": (["<video>\nWhat moves?", "The camera pans across an astronaut."],
                  ["pan_h264_24"], []),
    # a video before an image: their rows must be put back in placeholder order
    "video-then-image": (["<video> What is shown? Compare with <image>.", "The same cat."],
                         ["zoom_mpeg4_10"], ["chelsea.jpg"]),
    "two-videos": (["First <video> then <video>: the same scene?", "No: a person, then a cup."],
                   ["pan_vp9_30", "rotated_h264_24"], []),
    "text-only": (["What is a tar file?", "An archive of files."], [], []),
}
SAMPLES = len(CONVERSATIONS)


@pytest.fixture(scope="module")
def run_data(family, corpus, corpus_videos, tmp_path_factory) -> dict:
    """The family's shards of the conversations above, its preprocessing config, and the
    overrides of a run on them."""
    import yaml
    tmp = tmp_path_factory.mktemp(f"video-{family['name']}")
    records = []
    for key, (turns, clips, images) in CONVERSATIONS.items():
        record = {"id": key, "conversations": [
            {"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}
        if clips:
            record["videos"] = [str(corpus / corpus_videos[c].path) for c in clips]
        if images:
            record["image"] = [str(corpus / "images" / name) for name in images]
        records.append(record)
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump(config_data(family["checkpoint"])))
    common = [f"data.datasets=[{tmp / 'shards'}]", f"data.preprocess={preprocess}",
              f"model.pretrained={family['checkpoint']}", f"train.global_batch_size={SAMPLES}",
              "train.steps=1", "train.device=cpu", "optimizer.warmup_steps=0", "train.seed=3",
              "model.freeze=[]"]
    return {**family, "tmp": tmp, "common": common}


def _hf_logits(model, run: dict, out: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits for the run's padded batch (``model``: its own class, fp32), and
    the batch's real-token mask."""
    from mimo_data.modalities.image import normalize_pixels
    batch, config = out["batch"], run["config"]
    length = int(batch["attention_mask"].sum(1).max())
    ids, mask = batch["input_ids"][:, :length], batch["attention_mask"][:, :length]
    image = batch["modality_inputs"]["image"]["image"]
    video = batch["modality_inputs"]["video"]["video"]
    tokens = run["tokens"]
    kwargs = {}
    if run["name"] == "qwen2.5-vl":
        videos = config.modalities["video"]
        clips = [clip for key in out["keys"] for clip in out["clips"][key]]
        kwargs["second_per_grid_ts"] = torch.tensor(
            [second_per_grid(c.frames, c.fps, videos) for c in clips])
    kinds = (ids == tokens["image"]).int() + 2 * (ids == tokens["video"]).int()
    kwargs["position_ids"] = published_positions(model.model.get_rope_index(
        ids, mm_token_type_ids=kinds, image_grid_thw=image["image_grid_thw"],
        video_grid_thw=video["video_grid_thw"], attention_mask=mask.long(), **kwargs)[0],
        kinds, mask)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask.long(),
            pixel_values=normalize_pixels(image["pixel_values"], config.modalities["image"]),
            image_grid_thw=image["image_grid_thw"],
            pixel_values_videos=normalize_video_pixels(video["pixel_values_videos"],
                                                       config.modalities["video"]),
            video_grid_thw=video["video_grid_thw"], mm_token_type_ids=kinds, **kwargs).logits
    return logits, mask


@pytest.fixture(scope="module")
def colocated(ranks, run_data) -> tuple[dict, dict, str]:
    """One colocated job: the model's logits on its first micro-batch (the four conversations,
    padded), the step's loss and gradients on it, and the imported model's checkpoint (step 0)
    the other runs start from."""
    return run_colocated(ranks, run_data["tmp"], "language=dp1;image=dp1,off0,video",
                         run_data["common"], micro_batch=SAMPLES)


def test_logits_match_transformers_on_videos_and_images(run_data, colocated, reference,
                                                        corpus_videos):
    """Colocated, one process: a batch of the four conversations, padded."""
    tmp = run_data["tmp"]
    out = dict(colocated[0])
    ids_of = _ids_by_key(tmp / "shards")
    # loader keys are "<dataset index>/<shard key>"
    out["clips"] = {key: [corpus_videos[c] for c in
                          CONVERSATIONS[ids_of[key.split("/")[-1]]][1]] for key in out["keys"]}
    batch = out["batch"]
    assert len(batch["modality_inputs"]["video"]["video"]["video_grid_thw"]) == 4
    assert set(batch["input_ids"].unique().tolist()) >= {run_data["tokens"]["image"],
                                                         run_data["tokens"]["video"]}
    expected, mask = _hf_logits(reference, run_data, out)
    ours = out["logits"][:, :mask.size(1), :expected.size(-1)]
    assert (ours - expected)[mask].abs().max() <= TOLERANCE


def test_the_step_flops_count_each_image_and_video_slice(run_data, colocated):
    """The tower's model FLOPs in the step's record (its one micro-batch): the grids the tower
    got, each video's temporal slices attending on their own (Qwen2.5-VL: in windows but
    in its full-attention layers), counted from the loader's metadata."""
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.planning.dims import from_plan
    from mimo_train.planning.flops import tower_flops
    out, step, _ = colocated
    inputs = out["batch"]["modality_inputs"]
    grids = [*inputs["image"]["image"]["image_grid_thw"].tolist(),
             *inputs["video"]["video"]["video_grid_thw"].tolist()]
    assert any(t > 1 for t, _, _ in grids)
    cfg = TrainConfig.load(None, [*run_data["common"], "layout=language=dp1;image=dp1,off0,video"])
    module = from_plan(resolve(cfg)).encoders["image"]
    assert module.projection == () and module.modalities == ("image", "video")
    assert step["flops"]["image"] == pytest.approx(tower_flops(module.tower, grids), rel=1e-12)


def _ids_by_key(shards: Path) -> dict[str, str]:
    import pyarrow.parquet as pq
    table = pq.read_table(shards / "samples.parquet", columns=["key", "id"]).to_pydict()
    return dict(zip(table["key"], table["id"]))


@pytest.fixture(scope="module")
def colocated_step(colocated) -> tuple[dict, str]:
    """The colocated job's step (loss and gradients), and the imported model's checkpoint."""
    return colocated[1], colocated[2]


def test_the_plan_counts_a_towers_images_and_videos(run_data, capsys):
    """``mimo-inspect plan`` of a tower serving images and videos, over two data-parallel
    ranks: its ranks' tokens of the step sum to the image and video placeholders of the
    language rank's batch (its real loader's), not the images' alone."""
    from mimo_data.inspect.cli import main
    from mimo_data.loading.loader import build_loader
    layout = "image=dp2,video;language=dp1"
    preprocess = run_data["tmp"] / "preprocess.yaml"
    capsys.readouterr()
    assert main(["plan", str(run_data["tmp"] / "shards"), "--config", str(preprocess),
                 "--layout", layout, "--global-batch-size", str(SAMPLES),
                 "--micro-batch-size", "2", "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)["plan"]
    planned = sum(row["steps"][0]["tokens"] for row in plan["ranks"]
                  if row["module"] == "image")
    loader = build_loader([str(run_data["tmp"] / "shards")], preprocess, layout, 2, 3,
                          SAMPLES, 2, seed=0)
    tokens = run_data["tokens"]
    placed = sum(int(sum((batch["input_ids"] == tokens[m]).sum() for m in ("image", "video")))
                 for batch, metadata in loader if metadata["step"] == 0)
    loader.close()
    assert placed > 0 and planned == placed, (planned, placed)


def test_the_non_colocated_step_equals_the_colocated_one(ranks, run_data, colocated_step):
    """The tower (images and videos) on rank 0, the language model on rank 1, from the
    colocated run's initial weights: the same loss, and the same gradients for every
    weight, the tower's included."""
    reference, init = colocated_step
    apart = layout_step(ranks, run_data["tmp"], "non-colocated", 2,
                        "image=dp1,video;language=dp1", 2, run_data["common"], init)
    compare(reference, apart, "image+video dp1 -> language dp1, non-colocated")


@pytest.mark.parametrize("language, towers, micro, how", [
    ("cp2", 1, SAMPLES, "data.packing=false"),
    ("cp4", 2, 1, "data.packing=true model.attention=sdpa data.split_media=true"),
    ("pp2,cp2", 1, SAMPLES, "data.packing=true"),
    ("tp2,cp2", 1, SAMPLES, "model.language.sequence_parallel=true"),
    ("tp2,cp2", 1, SAMPLES, "model.language.sequence_parallel=true data.packing=true")])
def test_context_parallel_gives_the_colocated_step(ranks, run_data, colocated_step, language,
                                                   towers, micro, how):
    """Qwen2.5-VL (Qwen2-VL: the same language model, its M-RoPE time unscaled): the language
    model's sequence over two context-parallel ranks (the four conversations padded), over
    four (one sample a micro-batch, as one long clip would be, packed; SDPA under the row's
    block-diagonal mask, the reference's the local attention; each sample's images and clips
    cut over two tower ranks, ``data.split_media``, whose dp need not divide the micro-batch:
    a long video's whole path; a text-only sample leaves both tower ranks nothing), over two
    in each of two pipeline stages (the four samples packed: the shard edges fall inside
    samples), and over two in each of two tensor-parallel groups with sequence parallelism
    (padded: each rank a quarter of the sequence between the TP regions), the tower (images
    and videos) on ranks of its own, padded or packed (a packed row padded to cp x tp, its
    last sample's bounds taking the padding): the colocated step's loss and every gradient,
    the tower's included (its rows' gradient summed over the context-parallel ranks)."""
    if run_data["name"] != "qwen2.5-vl":
        return
    reference, init = colocated_step
    ranks_of = {"tp": 1, "pp": 1, "cp": 1}
    for dim in language.split(","):
        ranks_of[dim[:2]] = int(dim[2:])
    nproc = towers + ranks_of["tp"] * ranks_of["pp"] * ranks_of["cp"]
    sharded = layout_step(ranks, run_data["tmp"], language, nproc,
                          f"image=dp{towers},video;language={language}", micro,
                          [*run_data["common"], *how.split()], init)
    compare(reference, sharded, f"image+video dp{towers} -> language {language}, {how}")


def test_transformers_generate_on_the_export_equals_mimo_generate_on_a_video(
        run_data, colocated_step, corpus, corpus_videos, capsys):
    """``mimo-export`` of the imported model, then ``mimo-generate --video``: its prompt and
    greedy tokens are transformers' (its PyAV video loading, its video processor sampling the
    clip at the config's fps, the chat template) through the exported class."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.video_utils import load_video

    from mimo_train.hf.export import main as export
    from mimo_train.hf.generate import main as generate
    out = run_data["tmp"] / "export"
    assert export(["--checkpoint", colocated_step[1], "--output", str(out)]) == 0
    clip = corpus_videos["zoom_mpeg4_10"]
    video = run_data["config"].modalities["video"]
    frames, metadata = load_video(str(corpus / clip.path), backend="pyav")
    processed = video_processor(video)(videos=[frames], video_metadata=[metadata],
                                       return_tensors="pt")
    grid = processed["video_grid_thw"]
    # the export's own processor files give transformers that processor: the run's sampling
    # and pixel budget (the published Qwen2-VL / Qwen2.5-VL ship no video processor file)
    from transformers import AutoProcessor
    exported = AutoProcessor.from_pretrained(out).video_processor(
        videos=[frames], video_metadata=[metadata], return_tensors="pt")
    assert torch.equal(exported["video_grid_thw"], grid)
    assert torch.equal(exported["pixel_values_videos"], processed["pixel_values_videos"])
    tokens = int(grid.prod()) // video.merge_size ** 2
    text = "<|vision_start|>" + "<|video_pad|>" * tokens + "<|vision_end|>\nWhat is shown?"
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False)])
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    theirs_index = model.model.get_rope_index    # the positions the checkpoint trained with

    def get_rope_index(input_ids, mm_token_type_ids, *args, attention_mask=None, **kwargs):
        positions, _ = theirs_index(input_ids, mm_token_type_ids, *args,
                                    attention_mask=attention_mask, **kwargs)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        published = published_positions(positions, mm_token_type_ids, mask)
        return published, (published.amax(dim=(0, 2)) + 1 - mask.sum(1)).unsqueeze(1)
    model.model.get_rope_index = get_rope_index
    extra = {}
    if run_data["name"] == "qwen2.5-vl":
        extra["second_per_grid_ts"] = torch.tensor([second_per_grid(clip.frames, clip.fps,
                                                                    video)])
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=8, pixel_values_videos=processed["pixel_values_videos"],
            video_grid_thw=grid, mm_token_type_ids=2 * (ids == model.config.video_token_id),
            **extra)
    from mimo_train.hf.generate import Generator
    generator = Generator(str(out))
    ours = generator.generate("What is shown?", videos=[str(corpus / clip.path)],
                              max_new_tokens=8)
    # its model positions the prompt as training did: the text after the clip as published
    kinds, ones = 2 * (ids == model.config.video_token_id), torch.ones_like(ids)
    positions, deltas = generator.vlm.model.get_rope_index(
        ids, kinds, video_grid_thw=grid, attention_mask=ones, **extra)
    given = theirs_index(ids, kinds, video_grid_thw=grid, attention_mask=ones, **extra)[0]
    assert torch.equal(positions, published_positions(given, kinds, ones))
    assert time_passes_side(grid, video.merge_size, [float(
        extra["second_per_grid_ts"][0] * model.config.vision_config.tokens_per_second)]
        if extra else [1.0])
    assert deltas.tolist() == [[int(positions.max()) + 1 - ids.size(1)]]
    assert ours.prompt_ids == ids[0].tolist() and ours.spliced == {"video": tokens}
    assert ours.token_ids == theirs[0, ids.size(1):].tolist()
    assert len(ours.token_ids) == 8
    # the command line: the same answer
    assert generate(["--model", str(out), "--video", str(corpus / clip.path), "--prompt",
                     "What is shown?", "--max-new-tokens", "8"]) == 0
    # the clip's frames as a folder of JPEGs (a frames dataset's form): one clip of them at
    # --frames-fps, its tokens what the video processor makes of them; without it, said
    import io

    import numpy as np
    from PIL import Image
    folder = run_data["tmp"] / "frames"
    folder.mkdir(exist_ok=True)
    for number, frame in enumerate(frames):
        Image.fromarray(frame).save(folder / f"{number:04d}.jpg", quality=95)
    decoded = np.stack([np.asarray(Image.open(io.BytesIO((folder / f"{n:04d}.jpg").read_bytes()))
                                   .convert("RGB")) for n in range(len(frames))])
    reference = video_processor(video)(
        videos=[decoded], video_metadata=[{"total_num_frames": len(frames), "fps": 4.0}],
        return_tensors="pt")
    from_folder = generator.generate("What is shown?", videos=[str(folder)], max_new_tokens=2,
                                     frames_fps=4.0)
    assert from_folder.spliced == {"video": int(reference["video_grid_thw"].prod())
                                   // video.merge_size ** 2}
    capsys.readouterr()
    assert generate(["--model", str(out), "--video", str(folder), "--prompt", "Why?"]) == 2
    assert f"--video {folder} is a folder: give a file (a folder of JPEG frames: give " \
        "--frames-fps R" in capsys.readouterr().err
    assert generate(["--model", str(out), "--video", str(folder), "--frames-fps", "4",
                     "--prompt", "Why?", "--max-new-tokens", "2"]) == 0
    # a clip the video processor cannot sample is named as the user gave it
    still = corpus / corpus_videos["still_h264_10"].path
    capsys.readouterr()
    assert generate(["--model", str(out), "--video", str(still), "--prompt", "Why?"]) == 1
    err = capsys.readouterr().err
    assert f"video_too_short: --video {still}: " in err and "vid0" not in err, err

