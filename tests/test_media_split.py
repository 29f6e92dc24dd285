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

from conftest import MODELS

PUBLISHED = MODELS / "published"
TOWERS = {"qwen2_vl": "Qwen--Qwen2-VL-2B-Instruct", "qwen2_5_vl": "Qwen--Qwen2.5-VL-3B-Instruct",
          "qwen3_vl": "Qwen--Qwen3-VL-2B-Instruct", "qwen3_5": "Qwen--Qwen3.5-4B"}


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
