"""The language-model checkpoints set-up builds (tools/make_models.py) are what they claim."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import model_dir


def test_smollm2_answers_the_capital_of_france():
    """The dequantized real SmolLM2-135M-Instruct, greedy, through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


@pytest.mark.parametrize("name, expected", [
    ("tiny-llama", {"model_type": "llama", "tie_word_embeddings": False,
                    "num_key_value_heads": 2, "rope_type": "llama3"}),
    ("tiny-qwen2", {"model_type": "qwen2", "tie_word_embeddings": True, "rope_type": "default"}),
    ("tiny-qwen3", {"model_type": "qwen3", "tie_word_embeddings": False, "head_dim": 32}),
])
def test_tiny_checkpoints_have_their_family_features(name, expected):
    config = json.loads((model_dir(name) / "config.json").read_text())
    config["rope_type"] = config["rope_parameters"]["rope_type"]
    assert {key: config[key] for key in expected} == expected


@pytest.mark.parametrize("name, expected, processor", [
    ("tiny-qwen2-vl-vision", {"model_type": "qwen2_vl_vision", "patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2},
     {"image_processor_type": "Qwen2VLImageProcessor", "merge_size": 2}),
    ("tiny-siglip-vision", {"model_type": "siglip_vision_model", "image_size": 224,
                            "patch_size": 14},
     {"image_processor_type": "SiglipImageProcessor", "image_mean": [0.5, 0.5, 0.5]}),
    ("tiny-whisper", {"model_type": "whisper", "num_mel_bins": 80, "max_source_positions": 1500},
     {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80,
      "sampling_rate": 16000, "hop_length": 160, "n_fft": 400}),
])
def test_tiny_encoders_have_their_family_features_and_processor(name, expected, processor):
    """The geometry configs/preprocess.yaml gives (SigLIP: the fixed policy's 224 px), and the
    family's processor config beside the model."""
    config = json.loads((model_dir(name) / "config.json").read_text())
    saved = json.loads((model_dir(name) / "preprocessor_config.json").read_text())
    assert {key: config[key] for key in expected} == expected
    assert {key: saved[key] for key in processor} == processor


def test_the_audio_check_reads_a_feature_extractor_saved_by_transformers_5(tmp_path):
    """The Whisper tower's check reads the feature extractor section of the one nested
    processor_config.json this transformers saves (no preprocessor_config.json beside it)."""
    from transformers import AutoProcessor

    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.base import check_preprocessor
    AutoProcessor.from_pretrained(model_dir("tiny-whisper")).save_pretrained(tmp_path)
    assert not (tmp_path / "preprocessor_config.json").exists()
    check_preprocessor(str(tmp_path), {"feature_size": ("modalities.audio.n_mels", 80)},
                       part="audio")
    with pytest.raises(EncoderBuildError, match=r"the audio processor saved in .* "
                                                r"preprocesses differently: feature_size 80"):
        check_preprocessor(str(tmp_path), {"feature_size": ("modalities.audio.n_mels", 128)},
                           part="audio")
