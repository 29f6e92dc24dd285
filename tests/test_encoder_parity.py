"""Each encoder kind built with ``pretrained=`` one of set-up's tiny checkpoints
(tools/make_models.py) equals its transformers reference within 1e-4 in fp32, on the sample
corpus' photos and speech as mimo_data decodes and featurizes them.

The references never go through mimo: the transformers processor saved beside the checkpoint
(the Pillow backends, torchvision is not installed) runs on the file as Pillow opens it
(EXIF-transposed), and the transformers model, loaded with its own class, runs on its output.

- Qwen2-VL vision, SigLIP: end to end. mimo resizes with the same Pillow bicubic call,
  patchifies uint8 pixels and normalizes them on the encoder's device; the reference feeds the
  processor's float ``pixel_values`` to the model.
- Whisper: where the designs differ, the test compares where they must agree.
  WhisperFeatureExtractor pads every clip to 30 s before its STFT; mimo featurizes the clip
  alone, ``len // hop_length`` frames (the token count comes from the shard metadata), its last
  ones seeing the zeros the extractor pads with. So the log-mels are compared with the
  extractor's own 30 s ones over the clip's frames, and the encoder rows with the reference
  encoder run on those features padded to its 3000 frames with the extractor's own silence
  (the last frame of its 30 s features), its rows over the clip kept and pairs averaged
  (mimo's second reduction, a last odd row alone). Not compared: the extractor's 30 s features
  also have one or two frames past the clip that its STFT window reaches the clip's tail from;
  mimo's frames end at the clip, so its rows differ from ``WhisperModel.encoder`` on the
  extractor's own 30 s input by design (attention spreads those frames over every row).
- Row counts equal mimo_data's token counts from the metadata mimo-shard records.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import SiglipVisionModel, WhisperFeatureExtractor, WhisperModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from mimo_data.modalities.audio import AUDIO, AudioConfig, audio_encoder_inputs, decode_audio
from mimo_data.modalities.audio import probe_audio
from mimo_data.modalities.image import IMAGE, ImageConfig, decode_image, image_encoder_inputs
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.errors import EncoderBuildError
from mimo_train.families.qwen2_vl import Qwen2VLVision
from mimo_train.families.siglip import SiglipVision
from mimo_train.families.whisper import WhisperAudio

from conftest import REPO, model_dir

ATOL = 1e-4
DYNAMIC = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess.yaml")).modalities
# SigLIP normalizes with mean 0.5 and std 0.5 (its processor's defaults), not CLIP's.
FIXED = ImageConfig(policy="fixed", image_size=224, patch_size=14, mean=(0.5,) * 3,
                    std=(0.5,) * 3)
SPEECH = AudioConfig()          # configs/preprocess.yaml's audio: 80 mel bins, 30 s
WINDOW = 3000                   # Whisper's input frames: 30 s at 100 frames a second


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def photos(corpus_photos):
    """Every corpus image (conftest's ``corpus_photos``)."""
    return corpus_photos


@pytest.fixture(scope="module")
def speech(corpus):
    """Every corpus clip: (name, shard metadata, mono samples at 16 kHz as mimo decodes them)."""
    entries = []
    for path in sorted((corpus / "audio").iterdir()):
        data = path.read_bytes()
        entries.append((path.name, probe_audio(data), decode_audio(data, SPEECH)))
    assert len({meta["sample_rate"] for _, meta, _ in entries}) > 1, "need resampled clips too"
    return entries


def assert_parity(name: str, ours: torch.Tensor, expected: torch.Tensor, tokens: int) -> None:
    assert ours.shape == expected.shape == (tokens, expected.shape[1]), name
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------- images

def test_qwen2vl_vision_equals_transformers_on_corpus_photos(photos):
    directory = model_dir("tiny-qwen2-vl-vision")
    config = DYNAMIC["image"]
    ours = Qwen2VLVision(config, 1, 1, 1, pretrained=str(directory)).eval()
    model = Qwen2VisionTransformerPretrainedModel.from_pretrained(directory).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    for name, data, meta, image in photos:
        inputs = processor(image, return_tensors="pt")
        expected = model(hidden_states=inputs["pixel_values"],
                         grid_thw=inputs["image_grid_thw"]).pooler_output
        decoded = IMAGE.decode(data, meta | {"member": name}, config)
        assert_parity(name, ours(**image_encoder_inputs([decoded], config)), expected,
                      IMAGE.item_tokens(meta | {"member": name}, config))


def test_siglip_vision_equals_transformers_on_corpus_photos(photos):
    directory = model_dir("tiny-siglip-vision")
    ours = SiglipVision(FIXED, 1, 1, 1, pretrained=str(directory)).eval()
    model = SiglipVisionModel.from_pretrained(directory).eval()
    processor = SiglipImageProcessorPil.from_pretrained(directory)
    for name, data, meta, image in photos:
        expected = model(**processor(image, return_tensors="pt")).last_hidden_state[0]
        decoded = decode_image(data, meta["orientation"], FIXED)
        assert_parity(name, ours(**image_encoder_inputs([decoded], FIXED)), expected,
                      IMAGE.item_tokens(meta | {"member": name}, FIXED))


def test_siglip_checkpoint_refuses_clip_normalization():
    """A SigLIP processor normalizes with 0.5 / 0.5: mimo's CLIP defaults would feed the
    encoder other pixels than its processor does."""
    clip_defaults = ImageConfig(policy="fixed", image_size=224, patch_size=14)
    with pytest.raises(EncoderBuildError, match="image_mean.*modalities.image.mean"):
        SiglipVision(clip_defaults, 1, 1, 1, pretrained=str(model_dir("tiny-siglip-vision")))


# ----------------------------------------------------------------------------------- audio

@pytest.fixture(scope="module")
def whisper():
    """(our encoder, the reference ``WhisperModel.encoder``, the saved feature extractor)."""
    directory = model_dir("tiny-whisper")
    return (WhisperAudio(SPEECH, 1, 1, 1, pretrained=str(directory)).eval(),
            WhisperModel.from_pretrained(directory).encoder.eval(),
            WhisperFeatureExtractor.from_pretrained(directory))


def whisper_reference(samples: np.ndarray, encoder, extractor) -> tuple[torch.Tensor, ...]:
    """(the extractor's clip log-mels ``[n_mels, frames]``, the reference rows): see the
    module docstring."""
    padded = extractor(samples, sampling_rate=16000, return_tensors="pt").input_features[0]
    clip, silence = padded[:, :len(samples) // extractor.hop_length], padded[:, -1:]
    window = torch.cat([clip, silence.expand(-1, WINDOW - clip.shape[1])], dim=1)
    states = encoder(window[None]).last_hidden_state[0][:(clip.shape[1] + 1) // 2]
    return clip, torch.stack([pair.mean(0) for pair in torch.split(states, 2)])


def test_whisper_log_mels_equal_the_feature_extractor(speech, whisper):
    _, _, extractor = whisper
    for name, _, samples in speech:
        ours = audio_encoder_inputs([samples], SPEECH)["input_features"]
        clip, _ = whisper_reference(samples, whisper[1], extractor)
        torch.testing.assert_close(ours.T, clip, rtol=0, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_whisper_equals_transformers_on_corpus_speech(speech, whisper):
    ours, encoder, extractor = whisper
    for name, meta, samples in speech:
        _, expected = whisper_reference(samples, encoder, extractor)
        assert_parity(name, ours(**audio_encoder_inputs([samples], SPEECH)), expected,
                      AUDIO.item_tokens(meta | {"member": name}, SPEECH))


def test_whisper_pads_with_whispers_silence_when_the_clip_has_a_noise_floor(speech, whisper):
    """A clip with a noise floor 40 dB under its peak never reaches the log-mel clamp's floor:
    Whisper's padding is then below the clip's smallest value, not equal to it. A quiet clip
    (-60 dB) and digital silence have their maximum within 8 decades of zero power's 1e-10
    floor: Whisper's padding is then that floor (-1.5), above the clip's maximum minus 2."""
    ours, encoder, extractor = whisper
    name, _, samples = max(speech, key=lambda entry: len(entry[2]))
    noise = np.random.default_rng(0).standard_normal(len(samples)).astype(np.float32)
    noisy = samples + 0.01 * np.abs(samples).max() * noise
    for case, clip_samples in (("+ noise", noisy), ("at -60 dB", samples * 1e-3),
                               ("as silence", np.zeros_like(samples))):
        inputs = audio_encoder_inputs([clip_samples], SPEECH)
        clip, expected = whisper_reference(clip_samples, encoder, extractor)
        silence = extractor(clip_samples, sampling_rate=16000,
                            return_tensors="pt").input_features[0, :, -1]
        if case == "+ noise":
            assert silence.max() < clip.min(), "the clip should stay above Whisper's silence"
        else:
            assert torch.all(silence == -1.5) and clip.max() - 2 < -1.5, case
        assert_parity(f"{name} {case}", ours(**inputs), expected,
                      AUDIO.rows_to_tokens(inputs, SPEECH)[0])
