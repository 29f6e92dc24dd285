"""mimo_train/model/tower_fusions.py: the towers' fused rotary, QuickGELU, RMSNorm and gated
SiLU.

Against transformers' own towers built from the published configs (the rotary of all six,
Qwen2-VL's QuickGELU, Qwen2.5-VL's RMSNorm and gated SiLU): the fused tower's rows equal
transformers' bit for bit, fp32 and bf16; its gradients equal in fp32 (the rotary's exactly,
the others' to 1e-5); in bf16 they are as far from fp32's as transformers' own. The weights
keep their names. Each fused region keeps its inputs alone. Each formula compiles once, in one
graph, for every patch count and whatever the step does (the GPU compiles with inductor; here
dynamo's tracing alone, where a graph break or a recompile comes from); the GPU check's
``fusions`` probe checks the compiled kernels.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from conftest import MODELS, PUBLISHED_TOWERS, symbolic_sizes
from mimo_train.runtime.compile import Compiler
from mimo_train.runtime.profile import parent_names
from mimo_train.model import tower_fusions
from mimo_train.model.tower_fusions import (FusedRotaryAttention, GatedMLP, PatchMatmul,
                                            QuickGELU, RMSNorm, fuse)

GRID = torch.tensor([[1, 8, 12], [3, 8, 8], [1, 16, 8]])


def _towers(kind: str, dtype: torch.dtype, depth: int | None = None):
    """transformers' tower of the published ``kind`` (``depth`` blocks: its own), a fused
    copy, and pixels for ``GRID``."""
    from transformers import AutoConfig

    from mimo_train.families.registry import ENCODERS
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(MODELS / "published" / PUBLISHED_TOWERS[kind]
                                        ).vision_config
    if depth is not None:
        config.depth = depth
        if hasattr(config, "fullatt_block_indexes"):
            config.fullatt_block_indexes = [depth - 1]
    reference = ENCODERS[kind].tower_class()._from_config(config, dtype=dtype)
    reference.set_attn_implementation("sdpa")
    fused = copy.deepcopy(reference)
    fuse(fused, "sdpa")
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(int(GRID.prod(-1).sum()), columns).to(dtype)
    return reference, fused, pixels


def _run(tower, pixels):
    out = tower(hidden_states=pixels, grid_thw=GRID)
    rows = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])],
                     dim=-1)
    (rows.float() * torch.linspace(-1, 1, rows.numel()).view_as(rows)).sum().backward()
    return rows.detach(), {n: p.grad.float() for n, p in tower.named_parameters()}


# fused modules of each kind a tower of ``depth`` blocks has beside its attention: exact
# (the rotary alone) or not (the others' backward passes sum in another order)
def _fused_counts(kind: str, depth: int) -> dict[type, int]:
    return {"qwen2_vl": {QuickGELU: depth},
            "qwen2_5_vl": {RMSNorm: 2 * depth + 1, GatedMLP: depth}}.get(kind, {})


@pytest.mark.parametrize("kind", sorted(PUBLISHED_TOWERS))
def test_fused_towers_give_transformers_rows_and_gradients(kind):
    reference, fused, pixels = _towers(kind, torch.float32)
    assert fused.state_dict().keys() == reference.state_dict().keys()
    counts = _fused_counts(kind, len(fused.blocks))
    for cls in (FusedRotaryAttention, QuickGELU, RMSNorm, GatedMLP, PatchMatmul):
        assert sum(type(m) is cls for m in fused.modules()) == (
            len(fused.blocks) if cls is FusedRotaryAttention else
            1 if cls is PatchMatmul else counts.get(cls, 0)), cls
    rows, grads = _run(reference, pixels)
    our_rows, our_grads = _run(fused, pixels)
    assert torch.equal(our_rows, rows)
    for name, grad in grads.items():
        if counts:
            torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(our_grads[name], grad), name


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_bf16_is_as_close_to_fp32_as_transformers(kind):
    """In bf16 (Qwen2-VL: the rotary and QuickGELU; Qwen2.5-VL: the rotary, RMSNorm and the
    gated SiLU): the same rows, and weight gradients whose distance from the fp32 tower's is
    transformers' own within 5%."""
    reference, fused, pixels = _towers(kind, torch.bfloat16)
    exact = copy.deepcopy(reference).float()
    rows, grads = _run(reference, pixels)
    our_rows, our_grads = _run(fused, pixels)
    _, exact_grads = _run(exact, pixels.float())
    assert torch.equal(our_rows, rows)

    def distance(found):
        return sum((found[n] - g).square().sum() for n, g in exact_grads.items()).sqrt()
    theirs, ours = distance(grads), distance(our_grads)
    assert 0 < ours <= 1.05 * theirs, (ours, theirs)


@pytest.mark.parametrize("kind", sorted(PUBLISHED_TOWERS))
def test_the_patch_embedding_as_a_matmul_gives_the_convolutions_rows(kind, monkeypatch):
    """The matmul a GPU runs in place of the patch embedding's Conv3d (here on the CPU): the
    rows and the weight's (and bias's) gradients of transformers' embedding in fp32, to its
    rounding (1e-5, and 1e-4 where a gradient's sum cancels); in bf16 each as close to the
    fp32 ones as transformers' own bf16 embedding's (on this CPU the weight's gradient 7x
    closer)."""
    reference, fused, _ = _towers(kind, torch.float32, depth=1)
    embed = next(m for m in fused.modules() if type(m) is PatchMatmul)
    monkeypatch.setattr(embed, "devices", ("cpu",))
    pixels = torch.randn(300, embed.proj.weight[0].numel())

    def run(module, dtype):
        module = copy.deepcopy(module).to(dtype)
        if type(module) is PatchMatmul:             # the matmul, not the Conv3d, runs
            module.proj.forward = None
        rows = module(pixels.to(dtype))
        (rows.float() * torch.linspace(-1, 1, rows.numel()).view_as(rows)).sum().backward()
        return [rows.float(), *(p.grad.float() for p in module.proj.parameters())]
    exact = run(reference.patch_embed, torch.float32)
    assert exact[0].shape == (300, embed.embed_dim)
    assert len(exact) == (3 if embed.proj.bias is not None else 2)
    for ours, theirs in zip(run(embed, torch.float32), exact):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    for ours, theirs, fp32 in zip(run(embed, torch.bfloat16),
                                  run(reference.patch_embed, torch.bfloat16), exact):
        assert (ours - fp32).norm() <= 1.05 * (theirs - fp32).norm()


def _saved(module: torch.nn.Module, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The shapes of what autograd saves in ``module(x)``, each storage once, weights not."""
    weights = {p.data_ptr() for p in module.parameters()}
    found: dict[int, tuple[int, ...]] = {}

    def pack(tensor):
        if tensor.data_ptr() not in weights:
            found[tensor.data_ptr()] = tuple(tensor.shape)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sorted(found.values())


def test_each_fused_region_keeps_its_inputs_alone():
    from transformers.activations import QuickGELUActivation
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLMLP,
                                                                    Qwen2_5_VLRMSNorm)
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    assert _saved(QuickGELUActivation(), x) == [(6, 16)] * 2       # input, sigmoid (output)
    assert _saved(QuickGELU(), x) == [(6, 16)]
    norm = Qwen2_5_VLRMSNorm(16).bfloat16()
    assert _saved(norm, x) == [(6, 1), (6, 16), (6, 16)]  # statistics, fp32 x, bf16 output
    assert _saved(RMSNorm(norm), x) == [(6, 16)]
    config = Qwen2_5_VLVisionConfig(hidden_size=16, intermediate_size=24)
    mlp = Qwen2_5_VLMLP(config, bias=True).bfloat16()
    # the projections' inputs (x, the product), the gate, its SiLU, up
    assert _saved(mlp, x) == [(6, 16)] + [(6, 24)] * 4
    assert _saved(GatedMLP(mlp), x) == [(6, 16)] + [(6, 24)] * 3


def _compiled_step(tower, compiler, monkeypatch, grid, columns: int, train: bool = True):
    """One forward (and backward) of ``tower`` on random pixels for ``grid`` with the fused
    formulas run by ``compiler``; its rows and pixels."""
    pixels = torch.randn(int(grid.prod(-1).sum()), columns).bfloat16()
    with torch.set_grad_enabled(train), monkeypatch.context() as patched:
        patched.setattr(tower_fusions, "COMPILER", compiler)
        rows = tower(hidden_states=pixels, grid_thw=grid).pooler_output
        if train:
            rows.float().square().mean().backward()
    return rows, pixels


def test_each_formula_compiles_once_whatever_the_step_does(monkeypatch):
    """The compiled path (here dynamo's tracing, on the CPU; inductor compiles the same graphs
    on a GPU) through Qwen2-VL's and Qwen2.5-VL's towers: training steps on two patch counts,
    a no-grad forward, recomputed blocks, frozen norm weights. Each formula is compiled
    once, in one graph, and the rows are those of the formulas run as written."""
    from mimo_train.model.build import recompute_tower
    graphs: list = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    compiler = Compiler(backend=backend, devices=("cpu",))
    grids = [torch.tensor([[1, 8, 12], [1, 16, 8]]), torch.tensor([[1, 8, 8], [2, 8, 16]])]
    for kind in ("qwen2_vl", "qwen2_5_vl"):
        _, tower, pixels = _towers(kind, torch.bfloat16, depth=2)
        written = copy.deepcopy(tower)
        run = functools.partial(_compiled_step, tower, compiler, monkeypatch,
                                columns=pixels.shape[1])
        rows, pixels = run(grids[0])
        assert torch.equal(rows, written(hidden_states=pixels, grid_thw=grids[0]).pooler_output)
        run(grids[1])
        run(grids[0], train=False)
        recompute_tower(tower, "image")
        run(grids[1])
        for module in tower.modules():
            if isinstance(module, RMSNorm):
                module.weight.requires_grad_(False)
        run(grids[0])
    names = {formula.__name__ for formula in compiler.compiled}
    assert names == {"split_rotary", "split_rotary_backward", "quick_gelu", "quick_gelu_backward",
                     "rms_norm", "rms_norm_backward", "rms_norm_weight_backward", "silu_gate",
                     "silu_gate_backward"}
    assert len(graphs) == len(names), [graph.code for graph in graphs]
    for graph in graphs:      # heads and widths compiled in: no index divided at run time
        assert symbolic_sizes(graph) == {0}, graph.code


def test_a_formula_past_the_recompile_limit_runs_as_written(capsys):
    """A formula compiled for more kinds of input than dynamo keeps graphs for (here a limit
    of one, and two dtypes) runs as written from then on, saying so, instead of stopping the
    run (torch raises there under fullgraph)."""
    import torch._dynamo
    compiler = Compiler(backend="eager", devices=("cpu",))

    def double(x):              # a code object of its own: dynamo counts graphs per one
        return x * 2
    # torch's own patch: pytest's monkeypatch deletes a config key on undo, and every later
    # compile in the process then fails on the missing limit
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype in (torch.float32, torch.float64):
            x = torch.arange(3, dtype=dtype)
            assert torch.equal(compiler(double, x), x * 2)
    assert compiler.compiled[double] is double
    assert "double reached torch.compile's recompile limit" in capsys.readouterr().out


def _outside_compiled(profiler, outermost: bool = True) -> list[str]:
    """The operators a profile holds outside the compiled regions: the outermost ones, or
    all (those inside other operators too)."""
    inner = ("aten::", "Torch-Compiled Region") if outermost else ("Torch-Compiled Region",)
    return [event.name for event in profiler.events() if event.name.startswith("aten::")
            and not any(name.startswith(inner) for name in parent_names(event))]


def test_a_formulas_numbers_are_constants_of_its_graph():
    """A float argument (a rotary's scale, a norm's epsilon) is compiled in, not made a graph
    input: a call dispatches no operator outside the compiled region (dynamo would wrap the
    float into a tensor on the host and read it back every call, seven operators), and
    another value gets its own graph with its own result."""
    graphs: list = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward
    compiler = Compiler(backend=backend, devices=("cpu",))

    def scaled(x, y, scale):
        return x * y * scale
    rows = torch.randn(7, 3, requires_grad=True)
    for tokens in (5, 7, 5):
        x, y = rows[:tokens], torch.randn(tokens, 3)
        compiler(scaled, x, y, 0.5)
    with torch.profiler.profile() as profiler:
        out = compiler(scaled, x, y, 0.5)
    outside = _outside_compiled(profiler)
    assert set(outside) == {"aten::detach"}, outside     # the tensors' (see Compiler)
    assert torch.equal(out, (x * y * 0.5).detach())
    assert torch.equal(compiler(scaled, x, y, 2.0), (x * y * 2.0).detach())
    assert len(graphs) == 2, [graph.code for graph in graphs]


def test_the_attentions_split_copies_nothing_outside_its_formulas(monkeypatch):
    """A Qwen tower's attention under the varlen kernel (an opaque stand-in here), forward
    and backward with the fused formulas compiled (dynamo's tracing on the CPU): the
    queries, keys and values leave the projection's output in one formula (the values'
    contiguous copy with the rotary) and their gradients reach it in one (written in its
    layout), so no operator outside the formulas, nor inside another one, copies, stacks or
    zero-fills a tower-sized tensor (autograd's own path: a stack and a copy back to the
    projection's layout, and a zeroed copy per tensor for indexing the batch dimension
    away)."""
    import torch.nn.attention.varlen as varlen

    from mimo_train.model.tower_attention import set_attention

    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            return q * k + v

        @staticmethod
        def backward(ctx, grad):
            return grad, grad, grad
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, *_, **kw: Kernel.apply(q, k, v))
    tower, _, _ = _towers("qwen2_vl", torch.bfloat16, depth=1)
    fuse(tower, set_attention(tower, "varlen", by_boundaries=True))     # as the trainer does
    attention = tower.blocks[0].attn
    monkeypatch.setattr(tower_fusions, "COMPILER",
                        Compiler(backend=lambda graph, _: graph.forward, devices=("cpu",)))
    x = torch.randn(20, attention.proj.in_features, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = torch.randn(2, 20, attention.proj.in_features // attention.num_heads)
    bounds = torch.tensor([0, 8, 20], dtype=torch.int32)
    for _ in range(2):                      # the second call's operators: compiled already
        with torch.profiler.profile() as profiler:
            out = attention(x, bounds, (cos, sin), max_seqlen=12)
            out.backward(torch.ones_like(out))
    # (not copy_: the CPU's addmm copies the bias into its output, inside the linear layers)
    copies = {"aten::stack", "aten::cat", "aten::clone", "aten::contiguous", "aten::zeros",
              "aten::zero_", "aten::select_backward", "aten::unbind", "aten::permute"}
    outermost, every = _outside_compiled(profiler), _outside_compiled(profiler, False)
    assert "aten::mm" in outermost and not copies & set(every), sorted(set(every))
    assert x.grad is not None and attention.qkv.weight.grad is not None


def test_clip_gets_its_quick_gelu_fused_and_what_mimo_cannot_fuse_is_refused():
    """LLaVA's CLIP tower: QuickGELU fused, its own attention left as it is. A Qwen2.5-VL
    tower MLP with another activation than the published SiLU, and an attention function
    transformers does not have, are refused by name."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.models.clip.modeling_clip import CLIPAttention

    from mimo_train.errors import EncoderBuildError
    tower = CLIPVisionModel(CLIPVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14))
    fuse(tower, "sdpa")
    assert [type(m) for m in tower.modules() if "GELU" in type(m).__name__] == [QuickGELU]
    assert [type(m) for m in tower.modules() if "Attention" in type(m).__name__] \
        == [CLIPAttention]
    reference, _, _ = _towers("qwen2_5_vl", torch.float32, depth=1)
    reference.blocks[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(EncoderBuildError, match="Qwen2.5-VL tower MLP with GELU"):
        fuse(copy.deepcopy(reference), "sdpa")
    with pytest.raises(EncoderBuildError, match="'no_such_kernel' is not one of"):
        fuse(reference, "no_such_kernel")
