"""M-RoPE position ids (``positions: mrope``) against transformers' ``get_rope_index``.

The reference gets the batch's input ids, which tokens are image tokens, and the patch grids
the encoder inputs were actually cut into (``image_grid_thw``, from the decoded pixels): the
preprocessor computes its positions from the shard metadata alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mimo_data.errors import ConfigError
from mimo_data.modalities.image import ImageConfig
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor, media_item

from conftest import REPO

TOKENIZER = str(REPO / "assets" / "tokenizer" / "smollm2")
MERGE = 2


def _config(positions: str = "mrope") -> PreprocessConfig:
    base = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess.yaml"))
    image = dataclasses.replace(base.modalities["image"], max_pixels=28 * 28 * 24)
    return dataclasses.replace(base, tokenizer=TOKENIZER, positions=positions,
                               modalities={**base.modalities, "image": image})


def _turns(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(texts)]


@pytest.fixture(scope="module")
def records(corpus) -> list[tuple[dict, dict]]:
    """(record, media bytes): several images of different sizes over a multi-turn
    conversation, text only, and images beside audio (positioned like text)."""
    images = [(corpus / "images" / name).read_bytes()
              for name in ("chelsea.jpg", "astronaut.jpg", "camera.png")]
    audio = (corpus / "audio" / "question-what.wav").read_bytes()

    def record(key, messages, media):
        items = [media_item(modality, data, i) for i, (modality, data) in enumerate(media)]
        return ({"key": key, "messages": messages, "media": items},
                {item["member"]: data for item, (_, data) in zip(items, media)})

    return [
        record("multi", _turns("<image>\nWhat animal is this?", "A cat.",
                               "And here? <image> Compare it with <image>.", "A person, a camera."),
               [("image", images[0]), ("image", images[1]), ("image", images[2])]),
        record("text", _turns("What is a tar file?", "An archive."), []),
        record("mixed", _turns("<audio> Say it, then look: <image>", "Done."),
               [("audio", audio), ("image", images[0])]),
    ]


@pytest.fixture(scope="module")
def samples(records):
    preprocessor = Preprocessor(_config())
    return [preprocessor(record, media) for record, media in records]


@pytest.fixture(scope="module")
def reference_model():
    from transformers import Qwen2VLConfig, Qwen2VLModel
    config = Qwen2VLConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, vocab_size=64),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=16,
                           spatial_merge_size=MERGE))
    return Qwen2VLModel(config)


def _reference(model, batch, image_token: int) -> torch.Tensor:
    """transformers' position ids for a padded batch ([3, B, S])."""
    grids = batch["modality_inputs"]["image"]["image"]["image_grid_thw"]
    input_ids = batch["input_ids"]
    positions, _ = model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == image_token).int(), image_grid_thw=grids,
        attention_mask=batch["attention_mask"].long())
    return positions


def test_mrope_positions_equal_get_rope_index(samples, reference_model):
    collator = Collator(Preprocessor(_config()))
    batch, _ = collator(samples)
    image_token = collator.modality_token_ids["image"]
    expected = _reference(reference_model, batch, image_token)
    real = batch["attention_mask"]
    assert batch["position_ids"].shape == (3, *batch["input_ids"].shape)
    assert torch.equal(batch["position_ids"][:, real], expected[:, real])
    # the images really are laid out on grids: heights and widths differ from the times
    images = batch["input_ids"] == image_token
    assert (batch["position_ids"][1][images] != batch["position_ids"][0][images]).any()
    assert (batch["position_ids"][2][images] != batch["position_ids"][1][images]).any()
    # text after an image continues from the image's start plus its grid's larger side
    first = samples[0]
    grids = batch["modality_inputs"]["image"]["image"]["image_grid_thw"]
    start = int(images[0].nonzero()[0])
    after = start + int(grids[0].prod()) // MERGE ** 2
    assert first.position_ids[:, after].tolist() == [start + int(grids[0, 1:].max()) // MERGE] * 3


def test_packed_mrope_positions_restart_at_every_sample(samples, reference_model):
    padded, _ = Collator(Preprocessor(_config()))(samples)
    packed, _ = Collator(Preprocessor(_config()), packed=True)(samples)
    image_token = Collator(Preprocessor(_config())).modality_token_ids["image"]
    expected = _reference(reference_model, padded, image_token)
    rows = [expected[:, row, padded["attention_mask"][row]] for row in range(len(samples))]
    assert packed["position_ids"].shape == (3, 1, packed["input_ids"].size(1))
    assert torch.equal(packed["position_ids"][:, 0], torch.cat(rows, dim=1))


def test_language_ranks_get_the_same_positions_without_decoding(records, samples):
    metadata_only = Preprocessor(_config(), with_media=False)
    for (record, _), full in zip(records, samples):
        sample = metadata_only(record, None)
        assert sample.encoder_inputs == {}
        assert torch.equal(sample.position_ids, full.position_ids)


def test_sequential_positions_stay_the_default(records):
    record, media = records[0]
    sample = Preprocessor(_config("sequential"))(record, media)
    assert sample.position_ids.tolist() == list(range(len(sample.input_ids)))
    assert PreprocessConfig(tokenizer=TOKENIZER).positions == "sequential"
    with pytest.raises(ConfigError, match="positions is 'rope3d': use sequential or mrope"):
        PreprocessConfig(tokenizer=TOKENIZER, positions="rope3d")


def test_fixed_size_images_lie_on_their_patch_grid():
    from mimo_data.modalities import MODALITIES
    fixed = ImageConfig(policy="fixed", image_size=224, patch_size=14)
    assert MODALITIES["image"].token_grid({"width": 640, "height": 480}, fixed) == (1, 16, 16)
