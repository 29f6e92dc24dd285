"""``Preprocessor.prompt``: a conversation to generate from, built as training builds samples.

The expected ids come from transformers (``apply_chat_template`` with the generation prompt on
the text with each marker replaced by N modality tokens, N computed here from the image size);
the encoder inputs are checked against the token counts the same way.
"""

from __future__ import annotations

import pytest

from conftest import preprocess_config_file


@pytest.fixture(scope="module")
def preprocessor(tmp_path_factory):
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.preprocessor import Preprocessor
    path = preprocess_config_file(tmp_path_factory.mktemp("prompt") / "preprocess.yaml")
    return Preprocessor(PreprocessConfig.from_yaml(str(path)))


def _expected(preprocessor, content: str) -> list[int]:
    return preprocessor.text.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]


def test_a_text_prompt_ends_with_the_generation_prompt(preprocessor):
    prompt = preprocessor.prompt([{"role": "user", "content": "What is the capital of France?"}],
                                 [])
    assert prompt.input_ids.tolist() == _expected(preprocessor, "What is the capital of France?")
    assert preprocessor.text.tokenizer.decode(prompt.input_ids).endswith(
        "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.encoder_inputs == {}


def test_an_image_marker_becomes_its_token_count_and_its_encoder_inputs(preprocessor, assets):
    from PIL import Image, ImageOps

    from mimo_data.preprocess.preprocessor import media_item
    data = assets["jpeg"].read_bytes()
    with Image.open(assets["jpeg"]) as image:
        width, height = ImageOps.exif_transpose(image).size
    # the dynamic policy (configs/preprocess.yaml): sides rounded to multiples of 28 within
    # [3136, 200704] pixels, one token per 28 x 28 block
    config = preprocessor.config.modalities["image"]
    assert config.min_pixels <= width * height <= config.max_pixels
    tokens = round(height / 28) * round(width / 28)
    prompt = preprocessor.prompt([{"role": "user", "content": "<image>\nDescribe it."}],
                                 [(media_item("image", data, 0), data)])
    assert prompt.token_counts["image"] == [tokens]
    expected = _expected(preprocessor, "<|image_pad|>" * tokens + "\nDescribe it.")
    assert prompt.input_ids.tolist() == expected
    grid = prompt.encoder_inputs["image"]["image_grid_thw"].tolist()
    assert len(grid) == 1 and grid[0][1] * grid[0][2] == tokens * 4    # 2 x 2 patches a token


def test_a_prompt_with_more_markers_than_media_is_refused(preprocessor):
    from mimo_data.preprocess.chat_tokens import TextError
    with pytest.raises(TextError, match="markers"):
        preprocessor.prompt([{"role": "user", "content": "<image>\nDescribe it."}], [])


def test_caption_mode_prompts_end_where_the_answer_starts(tmp_path):
    import yaml

    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.preprocessor import Preprocessor
    path = preprocess_config_file(tmp_path / "caption.yaml")
    data = yaml.safe_load(path.read_text())
    data["mode"] = "caption"
    path.write_text(yaml.safe_dump(data))
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(path)))
    prompt = preprocessor.prompt([{"role": "user", "content": "A photo of"}], [])
    tokenizer = preprocessor.text.tokenizer
    assert prompt.input_ids.tolist() == tokenizer("A photo of\n", add_special_tokens=False)[
        "input_ids"]
