"""mimo_train/model/tower_attention.py: the towers' attention over all items in one varlen call.

For each tower that gives boundaries (the published replicas' tower configs: Qwen2-VL,
Qwen2.5-VL's windows, Qwen3-VL's deepstack, Qwen3.5, and the MoE models' towers), with
``varlen`` set the tower calls the kernel once per layer (not once per image) with what the
real kernel takes (int32 boundaries, host ints for the longest item, ``[tokens, heads, dim]``,
the tower's scale, no causal window), and its rows and every weight's gradient equal
transformers' own ``sdpa`` (fp32). The kernel needs CUDA: here a stand-in runs SDPA on each
item (the GPU check's ``tower_varlen`` probe runs the real one against transformers' SDPA).
The towers are fused as the trainer builds them (``model.tower_fusions``).
Towers without boundaries and other choices keep transformers' implementation.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import MODELS, PUBLISHED_TOWERS
from mimo_train.model.tower_attention import VARLEN, set_attention
from mimo_train.model.tower_fusions import fuse

TOWERS = PUBLISHED_TOWERS


def _stand_in(calls: list):
    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert q.dim() == 3 and q.is_contiguous() and q.shape == k.shape == v.shape
        assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert type(max_q) is int and type(max_k) is int and window_size == (-1, -1)
        bounds = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(bounds, bounds[1:])) and bounds[-1] == len(q)
        calls.append(len(bounds) - 1)
        return torch.cat([F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])])
    return varlen_attn


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_one_varlen_call_per_layer_gives_transformers_rows_and_gradients(kind, monkeypatch):
    import torch.nn.attention.varlen as varlen
    from transformers import AutoConfig

    from mimo_train.families.registry import ENCODERS
    assert ENCODERS[kind].attends_by_boundaries
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(MODELS / "published" / TOWERS[kind]).vision_config
    reference = ENCODERS[kind].tower_class()._from_config(config, dtype=torch.float32)
    reference.set_attn_implementation("sdpa")
    ours = copy.deepcopy(reference)
    fuse(ours, set_attention(ours, "varlen", by_boundaries=True))   # as the trainer builds it
    calls: list[int] = []
    monkeypatch.setattr(varlen, "varlen_attn", _stand_in(calls))
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    # two images and a clip of 3 temporal patches (each patch attends on its own)
    grid = torch.tensor([[1, 8, 12], [3, 8, 8], [1, 16, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), columns)

    def run(tower):
        out = tower(hidden_states=pixels, grid_thw=grid)
        rows = torch.cat([out.pooler_output,
                          *(getattr(out, "deepstack_features", None) or [])], dim=-1)
        weights = torch.linspace(-1, 1, rows.numel()).view_as(rows)
        (rows * weights).sum().backward()
        return rows.detach(), {n: p.grad for n, p in tower.named_parameters()}

    rows, grads = run(reference)
    assert not calls
    our_rows, our_grads = run(ours)
    layers = len(ours.blocks)
    assert len(calls) == layers, f"{len(calls)} kernel calls for {layers} layers"
    assert min(calls) >= 5      # every item at once (Qwen2.5-VL's windows cut them further)
    torch.testing.assert_close(our_rows, rows, rtol=1e-5, atol=1e-5)
    assert our_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_other_towers_and_choices_keep_transformers_implementation():
    from transformers import AutoConfig

    from mimo_train.families.registry import ENCODERS
    config = AutoConfig.from_pretrained(
        MODELS / "published" / TOWERS["qwen2_vl"]).vision_config
    tower = ENCODERS["qwen2_vl"].tower_class()._from_config(config, dtype=torch.float32)
    set_attention(tower, "varlen", by_boundaries=False)
    assert tower.config._attn_implementation == "sdpa"
    set_attention(tower, "varlen", by_boundaries=True)
    assert {m.config._attn_implementation for m in tower.modules()
            if hasattr(m, "config")} == {VARLEN}
    set_attention(tower, "sdpa", by_boundaries=True)
    assert tower.config._attn_implementation == "sdpa"
    assert {kind for kind, encoder in ENCODERS.items() if encoder.attends_by_boundaries} \
        == set(TOWERS)


@pytest.mark.parametrize("kind", sorted(TOWERS))
@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_the_tower_reads_no_device_value(kind, attention, monkeypatch):
    """A GPU run keeps ``image_grid_thw`` on the host (``HOST_INPUTS``) and the encoder makes
    what transformers' tower would derive from it there: its weights and pixels on the
    ``meta`` device, where reading any value fails, mimo's encoder still runs (transformers'
    own call with the grid beside the pixels does not), and it gives transformers' rows on the
    CPU. The boundaries go to the device for the varlen kernel, stay on the host for sdpa's
    per-item split."""
    import torch.nn.attention.varlen as varlen

    from mimo_data.modalities.image import normalize_pixels
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.families.registry import ENCODERS, preprocessing_for, read_vlm
    from mimo_train.families.base import HOST_INPUTS
    assert {"image_grid_thw", "video_grid_thw"} <= HOST_INPUTS
    path = str(MODELS / "published" / TOWERS[kind])
    image = PreprocessConfig.from_dict(preprocessing_for(path)).modalities["image"]
    torch.manual_seed(0)
    encoder = ENCODERS[kind](image, 0, 0, 0, read_vlm(path)).eval()
    fuse(encoder.model, set_attention(encoder.model, attention, by_boundaries=True))
    bounds: list[torch.device] = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        bounds.append(cu_q.device)
        return (_stand_in([])(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
                if q.device.type == "cpu" else torch.empty_like(q))
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    # what the tower gets, and what reaches its blocks: every derived input taken by the
    # tower (none passed on), on the pixels' device but for the boundaries under sdpa
    given: list[dict] = []
    encoder.model.register_forward_pre_hook(lambda _, args, kwargs: given.append(kwargs),
                                            with_kwargs=True)
    derived = set(ENCODERS[kind].grid_inputs(encoder.model, torch.tensor([[1, 4, 4]])))
    assert {"position_ids", "cu_seqlens", "max_seqlen"} <= derived
    leaked: list[set] = []
    for block in encoder.model.blocks:
        block.register_forward_pre_hook(
            lambda _, args, kwargs: leaked.append(derived - {"cu_seqlens", "max_seqlen"}
                                                  & set(kwargs)), with_kwargs=True)
    grid = torch.tensor([[1, 8, 12], [3, 8, 8], [1, 16, 8]])
    pixels = torch.randint(0, 256, (int(grid.prod(-1).sum()), 3 * image.patch_size ** 2),
                           dtype=torch.uint8)
    with torch.no_grad():
        rows = encoder(pixel_values=pixels, image_grid_thw=grid)
        theirs = encoder.rows(encoder.model(hidden_states=normalize_pixels(pixels, image),
                                            grid_thw=grid))
    assert torch.equal(rows, theirs)
    encoder.to("meta")
    bounds.clear()
    with torch.no_grad():
        on_meta = encoder(pixel_values=pixels.to("meta"), image_grid_thw=grid)
        assert on_meta.shape == rows.shape and on_meta.is_meta
        kwargs = given[-1]
        with pytest.raises((NotImplementedError, RuntimeError)):    # reads the meta grid
            encoder.model(hidden_states=normalize_pixels(pixels, image).to("meta"),
                          grid_thw=grid.to("meta"))
    assert derived <= kwargs.keys() and not any(leaked), (derived, leaked)
    on_host = {"grid_thw"} | ({"cu_seqlens", "cu_window_seqlens"} if attention == "sdpa"
                              else set())
    devices = {key: value.device.type for key, value in kwargs.items()
               if isinstance(value, torch.Tensor)}
    assert devices == {key: "cpu" if key in on_host else "meta" for key in devices}, devices
    if attention == "varlen":
        assert bounds and {device.type for device in bounds} == {"meta"}, bounds
