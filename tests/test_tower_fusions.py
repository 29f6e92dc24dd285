"""mimo_train/model/tower_fusions.py: the towers' fused rotary and QuickGELU.

Against transformers' own towers built from the published configs (Qwen2-VL's QuickGELU and the
rotary of all six): the fused tower's rows equal transformers' bit for bit, fp32 and bf16; its
gradients equal in fp32 (the rotary's exactly, QuickGELU's to 1e-5); in bf16 they are as far
from fp32's as transformers' own. The weights keep their names. The fused QuickGELU keeps its
input alone. The formulas compile in one graph for every patch count (the GPU compiles them
with inductor; here dynamo's tracing alone, which is where a graph break or a recompile comes
from); the GPU check's ``tower_varlen`` probe checks the compiled kernels' rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import MODELS, PUBLISHED_TOWERS
from mimo_train.model import tower_fusions
from mimo_train.model.tower_fusions import FusedRotaryAttention, QuickGELU, fuse

GRID = torch.tensor([[1, 8, 12], [3, 8, 8], [1, 16, 8]])


def _towers(kind: str, dtype: torch.dtype):
    """transformers' tower of the published ``kind`` and a fused copy."""
    from transformers import AutoConfig

    from mimo_train.families.registry import ENCODERS
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(MODELS / "published" / PUBLISHED_TOWERS[kind]
                                        ).vision_config
    reference = ENCODERS[kind].tower_class()._from_config(config, dtype=dtype)
    reference.set_attn_implementation("sdpa")
    fused = copy.deepcopy(reference)
    fuse(fused, "sdpa", ENCODERS[kind].vision_rotary)
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(int(GRID.prod(-1).sum()), columns).to(dtype)
    return reference, fused, pixels


def _run(tower, pixels):
    out = tower(hidden_states=pixels, grid_thw=GRID)
    rows = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])],
                     dim=-1)
    (rows.float() * torch.linspace(-1, 1, rows.numel()).view_as(rows)).sum().backward()
    return rows.detach(), {n: p.grad.float() for n, p in tower.named_parameters()}


@pytest.mark.parametrize("kind", sorted(PUBLISHED_TOWERS))
def test_fused_towers_give_transformers_rows_and_gradients(kind):
    reference, fused, pixels = _towers(kind, torch.float32)
    assert fused.state_dict().keys() == reference.state_dict().keys()
    assert sum(isinstance(m, FusedRotaryAttention) for m in fused.modules()) \
        == len(fused.blocks)
    gelus = sum(isinstance(m, QuickGELU) for m in fused.modules())
    assert gelus == (len(fused.blocks) if kind == "qwen2_vl" else 0)
    rows, grads = _run(reference, pixels)
    our_rows, our_grads = _run(fused, pixels)
    assert torch.equal(our_rows, rows)
    for name, grad in grads.items():
        if gelus:
            torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(our_grads[name], grad), name


def test_bf16_is_as_close_to_fp32_as_transformers():
    """Qwen2-VL in bf16 (the rotary and QuickGELU): the same rows, and weight gradients whose
    distance from the fp32 tower's is transformers' own within 5%."""
    reference, fused, pixels = _towers("qwen2_vl", torch.bfloat16)
    exact = copy.deepcopy(reference).float()
    rows, grads = _run(reference, pixels)
    our_rows, our_grads = _run(fused, pixels)
    _, exact_grads = _run(exact, pixels.float())
    assert torch.equal(our_rows, rows)

    def distance(found):
        return sum((found[n] - g).square().sum() for n, g in exact_grads.items()).sqrt()
    theirs, ours = distance(grads), distance(our_grads)
    assert 0 < ours <= 1.05 * theirs, (ours, theirs)


def _saved(function, x: torch.Tensor) -> list[torch.Size]:
    shapes: list[torch.Size] = []

    def pack(tensor):
        shapes.append(tensor.shape)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(x)
    return shapes


def test_fused_quick_gelu_keeps_its_input_alone():
    from transformers.activations import QuickGELUActivation
    x = torch.randn(6, 10, dtype=torch.bfloat16, requires_grad=True)
    assert _saved(QuickGELUActivation(), x) == [x.shape] * 3      # input, sigmoid, sigmoid
    assert _saved(QuickGELU(), x) == [x.shape]


@pytest.mark.parametrize("formula, arguments", [
    (tower_fusions.rotary, lambda n: (torch.randn(n, 3, 8).bfloat16(),
                                      torch.randn(n, 3, 8).bfloat16(),
                                      torch.randn(n, 8), torch.randn(n, 8))),
    (tower_fusions.rotary_backward, lambda n: (torch.randn(n, 3, 8).bfloat16(),
                                               torch.randn(n, 3, 8).bfloat16(),
                                               torch.randn(n, 8), torch.randn(n, 8))),
    (tower_fusions.quick_gelu, lambda n: (torch.randn(n, 24).bfloat16(),)),
    (tower_fusions.quick_gelu_backward, lambda n: (torch.randn(n, 24).bfloat16(),
                                                   torch.randn(n, 24).bfloat16())),
], ids=["rotary", "rotary_backward", "quick_gelu", "quick_gelu_backward"])
def test_each_formula_compiles_once_for_every_patch_count(formula, arguments):
    compiled = torch.compile(formula, backend="eager", **tower_fusions.COMPILE_OPTIONS)
    torch.manual_seed(0)
    first = arguments(37)
    torch.testing.assert_close(compiled(*first), formula(*first), rtol=0, atol=0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (1000, 5):
            given = arguments(n)
            torch.testing.assert_close(compiled(*given), formula(*given), rtol=0, atol=0)


def test_a_tower_without_the_qwen_attention_is_refused():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from mimo_train.errors import EncoderBuildError
    tower = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14))
    fuse(tower, "sdpa", rotary_attention=False)           # CLIP's QuickGELU alone
    assert [type(m) for m in tower.modules() if "GELU" in type(m).__name__] == [QuickGELU]
    with pytest.raises(EncoderBuildError, match="Qwen-family vision attention"):
        fuse(tower, "sdpa", rotary_attention=True)
