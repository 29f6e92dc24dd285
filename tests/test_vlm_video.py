"""Videos through a whole Qwen2-VL / Qwen2.5-VL checkpoint's one vision tower.

- M-RoPE positions of samples mixing text, images and videos equal transformers'
  ``get_rope_index`` of each family (Qwen2.5-VL's time positions scaled by its
  ``tokens_per_second`` and the seconds each temporal patch spans, ``second_per_grid_ts``,
  computed here from the clip's frame count, frame rate and the processor's sampling rule);
- the tower mimo builds from the checkpoint encodes a video as transformers'
  ``get_video_features`` does, with the image weights (one module serves both);
- a module serving images and videos returns their rows in placeholder order, and the
  language model sees one placeholder id per module.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from mimo_data.modalities.video import VideoConfig, normalize_video_pixels
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor, media_item
from mimo_train.families import preprocessing_for
from mimo_train.step import _shared_placeholders

from conftest import REPO

MODELS = REPO / "assets" / "models"
CHECKPOINTS = {"qwen2-vl": MODELS / "tiny-qwen2-vl", "qwen2.5-vl": MODELS / "tiny-qwen2.5-vl"}
PIXELS = {"min_pixels": 3136, "max_pixels": 12544}      # small frames: a fast tower


def _turns(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(texts)]


def config_for(checkpoint) -> PreprocessConfig:
    """The checkpoint's preprocessing config (``preprocessing_for``), smaller frames."""
    data = preprocessing_for(str(checkpoint))
    for name in ("image", "video"):
        data["modalities"][name].update(PIXELS)
    data["modalities"]["video"].update(fps=4.0)
    data["seq_length"] = 1024
    return PreprocessConfig.from_dict(data)


@pytest.fixture(scope="module")
def video_clips():
    from skimage import data as photos
    from test_video_modality import _clip
    made = [_clip("pan_h264_24", "pan", photos.astronaut(), fmt="mp4", codec="libx264", fps=24,
                  seconds=2.5, width=128, height=96, gop=10),
            _clip("zoom_mpeg4_10", "zoom", photos.chelsea(), fmt="mp4", codec="mpeg4", fps=10,
                  seconds=3, width=96, height=64)]
    return {clip.name: clip for clip in made}


@pytest.fixture(scope="module")
def media(corpus, video_clips) -> dict[str, bytes]:
    return {"cat": (corpus / "images" / "chelsea.jpg").read_bytes(),
            "pan": video_clips["pan_h264_24"].data, "zoom": video_clips["zoom_mpeg4_10"].data}


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
    samples = [Preprocessor(config)(record, member_bytes)
               for record, member_bytes in _records(media)]
    return {"name": request.param, "checkpoint": checkpoint, "config": config,
            "batch": Collator(Preprocessor(config))(samples)[0],
            "tokens": Preprocessor(config).text.modality_token_ids}


def second_per_grid(frames: int, fps: float, config: VideoConfig) -> float:
    """The processor's ``temporal_patch_size / sampled_fps``, its sampled count by its rule:
    ``frames / fps * config.fps`` within [min_frames, frames], down to a multiple of the
    temporal patch."""
    patch = config.temporal_patch_size
    wanted = min(max(frames / fps * config.fps, config.min_frames), frames)
    sampled = math.floor(wanted / patch) * patch
    return patch / (sampled / frames * fps)


def test_mrope_positions_equal_the_familys_get_rope_index(family, video_clips):
    from transformers import AutoConfig, Qwen2_5_VLModel, Qwen2VLModel
    config = AutoConfig.from_pretrained(family["checkpoint"])
    model = (Qwen2_5_VLModel if family["name"] == "qwen2.5-vl" else Qwen2VLModel)(config)
    batch, tokens = family["batch"], family["tokens"]
    inputs = batch["modality_inputs"]
    ids = batch["input_ids"]
    kinds = ((ids == tokens["image"]).int() + 2 * (ids == tokens["video"]).int())
    video = family["config"].modalities["video"]
    clips = [video_clips[name] for name in ("pan_h264_24", "zoom_mpeg4_10", "zoom_mpeg4_10",
                                            "pan_h264_24")]
    extra = {}
    if family["name"] == "qwen2.5-vl":
        assert video.tokens_per_second == config.vision_config.tokens_per_second == 4
        extra["second_per_grid_ts"] = torch.tensor(
            [second_per_grid(c.frames, c.fps, video) for c in clips])
    expected, _ = model.get_rope_index(
        ids, mm_token_type_ids=kinds, image_grid_thw=inputs["image"]["image"]["image_grid_thw"],
        video_grid_thw=inputs["video"]["video"]["video_grid_thw"],
        attention_mask=batch["attention_mask"].long(), **extra)
    real = batch["attention_mask"]
    assert torch.equal(batch["position_ids"][:, real], expected[:, real])
    times = batch["position_ids"][0][ids == tokens["video"]]
    steps = sorted(set(times[:times.numel() // 2].tolist()))   # the first clip's
    assert len(steps) > 1
    if family["name"] == "qwen2.5-vl":    # seconds, not patches: steps above 1 apart
        assert steps[1] - steps[0] > 1


def test_the_tower_encodes_videos_as_transformers(family):
    """The checkpoint's one tower, built by mimo, on the batch's videos and images."""
    from transformers import AutoModelForImageTextToText
    from mimo_train.families import ENCODERS, read_vlm
    config = family["config"]
    vlm = read_vlm(str(family["checkpoint"]))
    tower = ENCODERS[vlm.encoder_kind](config.modalities["image"], 0, 0, 0,
                                       str(family["checkpoint"])).eval()
    tower.take_also("video", config.modalities["video"])
    reference = AutoModelForImageTextToText.from_pretrained(family["checkpoint"],
                                                            dtype=torch.float32).eval()
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
    from mimo_train.model import EncoderSetting, _SeededEncoder
    image_config = PreprocessConfig(tokenizer=str(CHECKPOINTS["qwen2-vl"])).modalities["image"]
    video_config = dataclasses.replace(VideoConfig(), **PIXELS)
    module = _SeededEncoder(0, "image", EncoderSetting(
        "image", image_config, EncoderConfig(hidden_size=16, num_layers=1,
                                             num_attention_heads=2), "qwen2_vl",
        {"video": video_config}))

    class Rows(torch.nn.Module):       # item k of a modality gives rows full of its tag
        def encode(self, modality, **inputs):
            return inputs["tag"]
    module.encoder = Rows()
    placeholders = torch.tensor([1, 0, 0, 1, 0])
    out = module(placeholders=placeholders, image={"tag": torch.tensor([[1.], [2.], [3.]])},
                 video={"tag": torch.tensor([[10.], [20.]])})
    assert out.squeeze(1).tolist() == [10., 1., 2., 20., 3.]


@pytest.mark.parametrize("name, change, expected", [
    ("qwen2.5-vl", {"tokens_per_second": None},
     "modalities.video.tokens_per_second is None, but model.pretrained"),
    ("qwen2-vl", {"tokens_per_second": 4.0}, "positions videos with None"),
    ("qwen2-vl", {"token": "<|vision_pad|>"}, "expects video tokens '<|video_pad|>'"),
    ("qwen2-vl", {"wrap": ()}, "expects each video between ['<|vision_start|>'"),
])
def test_videos_written_otherwise_than_the_checkpoint_expects_are_refused(name, change,
                                                                          expected):
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.config import TrainConfigError
    from mimo_train.families import read_vlm
    from mimo_train.families.base import check_preprocessing
    config = config_for(CHECKPOINTS[name])
    video = dataclasses.replace(config.modalities["video"], **change)
    changed = dataclasses.replace(config, modalities={**config.modalities, "video": video})
    with pytest.raises(TrainConfigError) as error:
        check_preprocessing(read_vlm(str(CHECKPOINTS[name])), changed, load_tokenizer(changed))
    assert expected in str(error.value)


@pytest.mark.parametrize("layout, expected", [
    ("language=dp1;video=dp1", "serves ['video'], which no encoder takes on its own"),
    ("language=dp1;image=dp1,audio", "serves ['audio', 'image']: give each its own encoder"),
])
def test_video_goes_to_a_tower_that_takes_it(layout, expected):
    from types import SimpleNamespace

    from mimo_data.loading.layout import Layout
    from mimo_train.config import TrainConfigError
    from mimo_train.model import encoder_settings
    config = config_for(CHECKPOINTS["qwen2-vl"])
    config = dataclasses.replace(config, modalities={
        **config.modalities, "audio": PreprocessConfig(tokenizer=config.tokenizer
                                                       ).modalities["audio"]})
    cfg = SimpleNamespace(model=SimpleNamespace(encoders={}, pretrained=None))
    with pytest.raises(TrainConfigError, match=re.escape(expected)):
        encoder_settings(cfg, SimpleNamespace(layout=Layout.parse(layout)), config)


def test_a_tower_refuses_video_cut_into_other_patches():
    from mimo_train.families.base import EncoderBuildError
    from mimo_train.families.qwen2_vl import Qwen2VLVision
    image = config_for(CHECKPOINTS["qwen2-vl"]).modalities["image"]
    tower = Qwen2VLVision(image, 16, 1, 2)
    with pytest.raises(EncoderBuildError, match="modalities.video temporal_patch_size 4 "
                       "differs from modalities.image's 2"):
        tower.take_also("video", dataclasses.replace(VideoConfig(), temporal_patch_size=4))
