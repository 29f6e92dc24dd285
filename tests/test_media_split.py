"""``data.split_media``: a micro-batch's media rows cut over the encoder ranks that fan in to
one language rank (docs/layouts-and-loader.md, "Long videos: media split over the encoder
ranks").

- every tower mimo cuts (``Encoder.frame_independent``: the Qwen2-VL family) gives a clip's
  rows whole or cut at a temporal patch: the tower on ``[t, h, w]`` equals the tower on
  ``[t1, h, w]`` then on ``[t - t1, h, w]``, rows concatenated (fp32, the published
  replicas' tower configs: Qwen2.5-VL's windows, Qwen3-VL's deepstack rows and resampled
  position embeddings);
- the loader's parts of one language rank's micro-batch: contiguous in placeholder order,
  token-balanced, images whole, videos cut only between temporal patches; their rows, grids
  and placeholder rows add up to the whole micro-batch's, and a clip spans two ranks;
- the option is refused where it cannot work, with the reason.

The multi-rank step (Qwen3-VL-2B's tower at dp2 fanning in with the option, against the
colocated step) is a case of ``test_qwen3_vl.py``'s fan-in test.
"""

from __future__ import annotations

import pytest
import torch

from conftest import MODELS, PUBLISHED_TOWERS

PUBLISHED = MODELS / "published"
TOWERS = {kind: PUBLISHED_TOWERS[kind]
          for kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")}


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_a_tower_gives_a_clip_cut_at_a_temporal_patch_the_same_rows(kind):
    """Each frame-independent tower: a clip of 5 temporal patches on a 12 x 20 patch grid (6 x
    10 merged: Qwen2.5-VL's windows of 4 x 4 merged patches do not fit it evenly), cut after
    its second patch, and an image after it, in one call and in two; the rows (deepstack ones
    included) equal to fp32 rounding."""
    from transformers import AutoConfig

    from mimo_train.families.registry import ENCODERS
    assert ENCODERS[kind].frame_independent
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(PUBLISHED / TOWERS[kind]).vision_config
    tower = ENCODERS[kind].tower_class()._from_config(config, dtype=torch.float32).eval()
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    clip, image = torch.tensor([[5, 12, 20]]), torch.tensor([[1, 8, 8]])
    pixels = torch.randn(5 * 12 * 20 + 64, columns)

    def rows(hidden, grid):
        with torch.no_grad():
            out = tower(hidden_states=hidden, grid_thw=grid)
        return torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])],
                         dim=-1)

    whole = rows(pixels, torch.cat([clip, image]))
    cut = 2 * 12 * 20                                      # after 2 temporal patches
    parts = torch.cat([rows(pixels[:cut], torch.tensor([[2, 12, 20]])),
                       rows(pixels[cut:], torch.tensor([[3, 12, 20], [1, 8, 8]]))])
    assert whole.shape == (5 * 60 + 16, parts.size(1))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_images_and_clips_in_one_call_give_each_modalitys_own_rows_and_gradients(kind):
    """mimo's encoder of each tower kind serving images and clips (``encode_together``: one
    tower call, their patches and grids one after another) against one call per modality
    (``encode``): the rows (deepstack ones included) equal to fp32 rounding and every weight's
    gradient within 1e-5 of its largest entry (the rows are summed in one matmul instead of
    two). A 4-layer tower, Qwen2.5-VL with full attention in layers 1 and 3, Qwen3-VL with
    deepstack rows from layers 0 and 2; three images and two clips of grids that
    Qwen2.5-VL's windows do not fit evenly."""
    from transformers import AutoConfig

    from mimo_data.modalities.image import ImageConfig
    from mimo_data.modalities.video import VideoConfig
    from mimo_train.families.registry import ENCODERS
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(PUBLISHED / TOWERS[kind]).vision_config
    config.depth = 4
    if hasattr(config, "fullatt_block_indexes"):
        config.fullatt_block_indexes = [1, 3]
    if hasattr(config, "deepstack_visual_indexes"):
        config.deepstack_visual_indexes = [0, 2]
    geometry = dict(patch_size=config.patch_size, merge_size=config.spatial_merge_size,
                    temporal_patch_size=config.temporal_patch_size)
    encoder = ENCODERS[kind](ImageConfig(**geometry), 16, 1, 2)    # then the 4-layer tower
    encoder.model = ENCODERS[kind].tower_class()._from_config(config, dtype=torch.float32)
    encoder.take_also("video", VideoConfig(**geometry, mean=(0.4, 0.5, 0.6),
                                           std=(0.2, 0.3, 0.25)))
    images, clips = torch.tensor([[1, 12, 20], [1, 8, 6], [1, 18, 10]]), \
        torch.tensor([[3, 10, 14], [2, 12, 20]])
    side = config.patch_size
    inputs = {"image": {"pixel_values": torch.randint(0, 256, (int(images.prod(1).sum()),
                                                                 3 * side * side),
                                                        dtype=torch.uint8),
                        "image_grid_thw": images},
              "video": {"pixel_values_videos": torch.randint(
                  0, 256, (int(clips.prod(1).sum()), 3 * config.temporal_patch_size
                           * side * side), dtype=torch.uint8), "video_grid_thw": clips}}
    calls: list[int] = []
    encoder.model.register_forward_hook(lambda module, args, output: calls.append(1))

    def rows_and_gradients(encode):
        encoder.model.zero_grad()
        rows = encode()
        weights = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1))
        (rows * weights).sum().backward()
        return rows.detach(), {n: p.grad.clone() for n, p in encoder.model.named_parameters()}

    together, together_grads = rows_and_gradients(lambda: encoder.encode_together(inputs))
    assert len(calls) == 1
    alone, alone_grads = rows_and_gradients(lambda: torch.cat(
        [encoder.encode(m, **kwargs) for m, kwargs in inputs.items()]))
    assert len(calls) == 3 and together.shape == alone.shape
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    for name, grad in alone_grads.items():
        scale = float(grad.abs().max()) or 1.0
        torch.testing.assert_close(together_grads[name] / scale, grad / scale, rtol=0,
                                   atol=1e-5, msg=name)


# ------------------------------------------------------------------- the loader's parts

CHECKPOINT = PUBLISHED / "Qwen--Qwen3-VL-2B-Instruct"
SEED, GLOBAL_BATCH = 3, 4                 # test_qwen3_vl.py's fan-in step's


@pytest.fixture(scope="module")
def source(corpus, corpus_videos, tmp_path_factory):
    """test_qwen3_vl.py's four conversations (two images, text only, a clip, an image and a
    clip) under Qwen3-VL-2B's preprocessing, opened once."""
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from support.qwen_vlm import build_shards, preprocessing
    tmp = tmp_path_factory.mktemp("media-split")
    return DataSource([build_shards(tmp, corpus, corpus_videos)],
                      PreprocessConfig.from_dict(preprocessing(CHECKPOINT)))


def _micro_batches(source, layout: str, rank: int, micro_batch_size: int, **options):
    from mimo_data.loading.layout import Layout
    from mimo_data.loading.loader import build_loader
    loader = build_loader(source, None, layout, rank, Layout.parse(layout).world_size,
                          GLOBAL_BATCH, micro_batch_size, SEED, **options)
    assert loader is not None
    return list(loader)


def _assert_pieces(parts: list[list[list]], found: list[dict | None], whole: dict,
                   pixels: str, grid: str) -> None:
    """Each rank's pieces (``media_parts``) against the whole micro-batch's inputs: a piece's
    grid is its item's with ``stop - first`` temporal patches, its rows are the item's rows of
    those patches (in the rank's rows, one piece after the other, nothing else), and the
    pieces, rank after rank, are every item's patches once, in order."""
    shapes = whole[grid].tolist()
    sizes = [t * h * w for t, h, w in shapes]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    keys: list[tuple] = []               # the whole's items, in order, as the pieces name them
    at = 0                               # the next item's next temporal patch, over the ranks
    patch = 0
    for rank_parts, inputs in zip(parts, found):
        offset = 0
        rank_grids = inputs[grid].tolist() if inputs is not None else []
        assert len(rank_grids) == len(rank_parts)
        for (key, item, first, stop), piece_grid in zip(rank_parts, rank_grids):
            if first == 0:
                keys.append((key, item))
                at, patch = len(keys) - 1, 0
            assert keys[at] == (key, item) and first == patch, (key, item, first, patch)
            t, h, w = shapes[at]
            assert piece_grid == [stop - first, h, w]
            rows = (stop - first) * h * w
            torch.testing.assert_close(
                inputs[pixels][offset:offset + rows],
                whole[pixels][starts[at] + first * h * w:starts[at] + stop * h * w],
                rtol=0, atol=0)
            offset, patch = offset + rows, stop
        assert inputs is None or offset == len(inputs[pixels])
    assert len(keys) == len(shapes) and patch == shapes[-1][0]


@pytest.mark.parametrize("encoders, micro_batch_size", [(2, 2), (4, 4)])
def test_the_parts_add_up_to_the_micro_batch_and_a_clip_spans_two_ranks(source, encoders,
                                                                        micro_batch_size):
    """The tower's module at dp2 (test_qwen3_vl.py's fan-in step: two samples a micro-batch,
    packed)
    and at dp4 (all four in one) fanning in to one language rank with ``split_media``: per
    micro-batch, every rank reads the language rank's samples; the ranks' pixel rows and
    placeholder rows, concatenated in rank order, are the whole micro-batch's (the colocated
    loader's) and the language rank's placeholders in token order; their grids joined piece
    by piece are its grids, images whole, clips cut only between temporal patches; each part's
    tokens are within one image or temporal patch of its share; a clip spans two ranks."""
    token_ids = source.metadata.text.modality_token_ids
    layout = f"image=dp{encoders},video;language=dp1"
    whole = _micro_batches(source, "language=dp1;image=dp1,off0,video", 0, micro_batch_size,
                           packing=True)
    ranks = [_micro_batches(source, layout, rank, micro_batch_size, split_media=True,
                            packing=True) for rank in range(encoders)]
    language = _micro_batches(source, layout, encoders, micro_batch_size, split_media=True,
                              packing=True)
    spanned = 0
    for index, (batch, metadata) in enumerate(whole):
        parts = [rank[index] for rank in ranks]
        assert all(m["keys"] == metadata["keys"] for _, m in parts)    # all read the replica's
        ids = language[index][0]["input_ids"]
        media = torch.isin(ids, torch.tensor([token_ids["image"], token_ids["video"]]))
        row = torch.cat([b["input_ids"][0] for b, _ in parts])
        assert torch.equal(row, ids[media])             # the placeholders, in token order
        for modality, (pixels, grid) in {"image": ("pixel_values", "image_grid_thw"),
                                         "video": ("pixel_values_videos", "video_grid_thw")
                                         }.items():
            inputs = batch["modality_inputs"].get(modality, {}).get(modality)
            found = [b["modality_inputs"].get(modality, {}).get(modality) for b, _ in parts]
            if inputs is None:
                assert found == [None] * encoders
                continue
            assert torch.equal(torch.cat([f[pixels] for f in found if f is not None]),
                               inputs[pixels])
            pieces = [m["media_parts"][modality] for _, m in parts]
            _assert_pieces(pieces, found, inputs, pixels, grid)
            if modality == "image":
                assert all(first == 0 and stop == 1 for p in pieces for _, _, first, stop in p)
            spanned += sum(a[-1][:2] == b[0][:2] for a, b in zip(pieces, pieces[1:]) if a and b)
        tokens = [len(b["input_ids"][0]) for b, _ in parts]
        merge = source.config.modalities["image"].merge_size
        unit = max(h * w // merge ** 2 for inputs in batch["modality_inputs"].values()
                   for grid in ("image_grid_thw", "video_grid_thw") if grid in inputs[next(
                       iter(inputs))] for _, h, w in inputs[next(iter(inputs))][grid].tolist())
        # each cut at the unit boundary nearest its share: a part is off by less than a unit
        assert all(abs(n * encoders - sum(tokens)) <= unit * encoders for n in tokens), tokens
    # the fan-in step's micro-batch of the text-only sample and the clip of three temporal
    # patches: the clip's first on rank 0, the other two on rank 1; at dp4 the images are
    # larger than the clips, whose turn it then is not to be cut
    assert spanned == (1 if encoders == 2 else 0)


@pytest.mark.parametrize("language_dp", [1, 2])
def test_token_balance_orders_the_samples_the_language_ranks_read(source, language_dp):
    """``data.balance: tokens`` with ``split_media`` at micro batch 1, the tower's module at
    dp4 (which does not divide the global micro-batch of one or two samples): the fanning-in
    module is balanced over the language DP ranks, so each of its ranks reads its language
    rank's samples, micro-batch by micro-batch, and the step's samples are the four of the
    step without the balance, once each."""
    layout = f"image=dp4,video;language=dp{language_dp}"
    options = {"split_media": True, "balance": "tokens"}
    language = [_micro_batches(source, layout, 4 + r, 1, **options) for r in range(language_dp)]
    for rank in range(4):
        ours = _micro_batches(source, layout, rank, 1, **options)
        theirs = language[rank // (4 // language_dp)]
        assert [m["keys"] for _, m in ours] == [m["keys"] for _, m in theirs]
    read = [key for rank in language for _, m in rank for key in m["keys"]]
    unbalanced = [key for r in range(language_dp)
                  for _, m in _micro_batches(source, layout, 4 + r, 1, split_media=True)
                  for key in m["keys"]]
    assert sorted(read) == sorted(unbalanced) and len(set(read)) == len(read) == GLOBAL_BATCH


def test_one_long_clip_spreads_over_every_rank():
    """A clip of 20 temporal patches of 30 tokens alone: four parts of five patches; beside
    an image of 150 tokens, three parts cut at the patch boundaries nearest 250 and 500 tokens
    (240, 510), the image whole."""
    from mimo_data.loading.media_split import Item, Piece, cut
    clip = Item(0, "video", 0, 20, 20 * 30)
    assert cut([clip], 4) == [[Piece(0, "video", 0, 5 * j, 5 * j + 5, 150)] for j in range(4)]
    image = Item(1, "image", 0, 1, 150)
    assert cut([clip, image], 3) == [[Piece(0, "video", 0, 0, 8, 240)],
                                     [Piece(0, "video", 0, 8, 17, 270)],
                                     [Piece(0, "video", 0, 17, 20, 90),
                                      Piece(1, "image", 0, 0, 1, 150)]]
    assert cut([], 2) == [[], []]


@pytest.mark.parametrize("checkpoint", ["llava-hf--llava-1.5-7b-hf",
                                        "llava-hf--llava-interleave-qwen-0.5b-hf", None])
def test_an_image_tower_gives_images_dealt_over_ranks_the_same_rows(checkpoint):
    """The towers of images alone (``frame_independent``: data.split_media deals their images
    whole over the ranks): LLaVA's CLIP and SigLIP towers (the published replicas') and a
    SigLIP encoder of its own give three images' rows in one call as in a call of one and a
    call of two."""
    from mimo_data.modalities.image import ImageConfig
    from mimo_train.families.llava import LlavaVision
    from mimo_train.families.registry import read_vlm
    from mimo_train.families.siglip import SiglipVision
    torch.manual_seed(0)
    if checkpoint is None:
        image = ImageConfig(token="<image>", policy="fixed", image_size=56, patch_size=14)
        tower = SiglipVision(image, 32, 2, 2)
    else:
        from mimo_data.preprocess.config import PreprocessConfig
        from mimo_train.families.registry import preprocessing_for
        path = str(PUBLISHED / checkpoint)
        image = PreprocessConfig.from_dict(preprocessing_for(path)).modalities["image"]
        tower = LlavaVision(image, 0, 0, 0, pretrained=read_vlm(path))
    assert type(tower).frame_independent
    pixels = torch.randint(0, 256, (3, 3, image.image_size, image.image_size), dtype=torch.uint8)
    with torch.no_grad():
        whole = tower.eval()(pixels)
        parts = torch.cat([tower(pixels[:1]), tower(pixels[1:])])
    assert whole.size(0) == 3 * (image.image_size // image.patch_size) ** 2
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_where_the_split_cannot_work_it_is_refused_with_the_reason():
    """The trainer's rule: no encoder module fanning in (colocated, or dp not above the
    language model's), or one whose tower is not frame-independent (Whisper's, say); the
    loader: a fanning-in module serving audio, whose inputs it does not take apart."""
    from mimo_data.loading.layout import Layout, LayoutError
    from mimo_data.loading.media_split import check_split_media
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.plan import rules
    facts = rules.Facts(layers=2, heads=4, query_groups=2)
    on = rules.Settings(split_media=True)
    for layout in ("image=dp1,video;language=dp1", "language=dp2;image=dp2,off0,video",
                   "image=dp2,video;language=dp2"):
        [refusal] = rules.refusals(facts, Layout.parse(layout), on)
        assert "this layout has none" in refusal.reason, layout
    fan_in = Layout.parse("image=dp2,video;language=dp1")
    assert rules.refusals(facts, fan_in, on) == []
    assert rules.refusals(facts, Layout.parse("image=dp1;language=dp1"), rules.Settings()) == []
    [refusal] = rules.refusals(rules.Facts(2, 4, 2, whole_towers=("image",)), fan_in, on)
    assert "the tower of encoder module 'image' does not encode each frame" in refusal.reason
    config = PreprocessConfig.from_dict({"tokenizer": "unused", "modalities": {"audio": {}}})
    with pytest.raises(LayoutError, match="serves audio, whose encoder inputs mimo does not"):
        check_split_media(Layout.parse("audio=dp2;language=dp1"), config)
    with pytest.raises(LayoutError, match="this layout has none|has none"):
        check_split_media(Layout.parse("language=dp1;audio=dp1"), config)


def test_with_the_split_a_tower_module_need_not_divide_the_micro_batch():
    """One clip a micro-batch over two tower ranks: whole samples need the tower's dp to divide
    the global micro-batch; split, each tower rank reads its language rank's samples."""
    from mimo_data.loading.layout import Layout, LayoutError
    layout = Layout.parse("image=dp2,video;language=cp2")
    with pytest.raises(LayoutError, match="does not divide the global micro-batch of 1"):
        layout.validate(4, 2, 1)
    layout.validate(4, 2, 1, split_media=True)
    with pytest.raises(LayoutError, match="does not divide the global micro-batch of 1"):
        Layout.parse("language=cp2;image=dp2,off0").validate(2, 2, 1, split_media=True)
