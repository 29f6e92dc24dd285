"""A mixture of experts' local experts as grouped GEMMs (``mcore.grouped_experts``) against
megatron-core's own ``SequentialMLP`` (its loop over experts) with the same weights, in
process on a one-rank gloo world: the output and every gradient (the tokens', the router
weights', each expert's two weights) in fp32, an expert receiving no token among them; the
checkpoint keys are ``SequentialMLP``'s; where the experts are not plain linears (a LoRA
adapter on one) it runs the loop. A model drawn from its seed (``layer_specs._seeded``): each
pipeline stage of a pp2 split draws its layers (their experts and shared expert too) and the
output layer as the whole model does, and an expert-parallel rank's experts are ep1's. The
trained models' steps with grouped experts against
transformers are tests/test_qwen3_vl.py's and tests/test_qwen3_5.py's (their MoE replicas).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def groups():
    from mimo_data.loading.layout import Layout
    from mimo_train.mcore.grids import build_infra
    from mimo_train.runtime import distributed

    with distributed.alone():
        yield build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs


def _experts(kind, groups, seed: int = 0, count: int = 4):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from mimo_train.mcore import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                               num_moe_experts=4, moe_ffn_hidden_size=12, ffn_hidden_size=12,
                               gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True)
    torch.manual_seed(seed)
    return kind(count, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                         linear_fc2=RowParallelLinear), pg_collection=groups)


def _run(experts, tokens, probs, counts):
    tokens, probs = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    output, _ = experts(tokens, counts, probs)
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    return output, {"tokens": tokens.grad, "probs": probs.grad,
                    **{k: p.grad for k, p in experts.named_parameters()}}


def test_grouped_experts_are_sequential_mlp(groups):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from mimo_train.mcore.grouped_experts import GroupedExperts
    loop, grouped = _experts(SequentialMLP, groups), _experts(GroupedExperts, groups, seed=1)
    assert grouped.state_dict().keys() == loop.state_dict().keys()
    grouped.load_state_dict(loop.state_dict())
    assert grouped._groups()
    counts = torch.tensor([7, 0, 12, 5])           # the second expert gets no token
    tokens, probs = torch.randn(24, 16), torch.rand(24)
    expected, expected_grads = _run(loop, tokens, probs, counts)
    output, grads = _run(grouped, tokens, probs, counts)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert not grads["local_experts.1.linear_fc1.weight"].any()


def test_experts_with_adapters_run_the_loop(groups):
    from mimo_train.mcore.grouped_experts import GroupedExperts
    from mimo_train.model.lora import LoraParallelLinear
    experts = _experts(GroupedExperts, groups)
    expert = experts.local_experts[0]
    # LoRA's wrapper around the expert's linear_fc1 (its own layer under ``base``)
    expert.linear_fc1 = LoraParallelLinear.__new__(LoraParallelLinear)
    torch.nn.Module.__init__(expert.linear_fc1)
    expert.linear_fc1.base = experts.local_experts[1].linear_fc1
    assert not experts._groups()


def _stage(groups, stages: int, stage: int, experts: int):
    """Pipeline ``stage`` of ``stages`` of a 4-layer model drawn from its seed (a stage's
    layers, megatron-core's ``layer_number`` counted from 1 on each stage)."""
    from mimo_train.mcore import TransformerConfig
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel

    config = TransformerConfig(
        num_layers=4, pipeline_model_parallel_size=stages, pipeline_dtype=torch.float32,
        hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        use_cpu_initialization=True, moe_token_dispatcher_type="alltoall",
        num_moe_experts=experts or None, moe_ffn_hidden_size=12 if experts else None,
        moe_shared_expert_intermediate_size=12 if experts else None)
    first = stage * 4 // stages
    return _SeededGPTModel(
        seed=5, vocabulary=32, packed_rows=False, config=config, vocab_size=32,
        transformer_layer_spec=language_block_spec(config, backend="local", experts=experts,
                                                   first_layer=first, seed=5),
        max_sequence_length=16, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, pg_collection=groups,
        pre_process=stage == 0, post_process=stage == stages - 1)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_pipeline_stages_draw_the_weights_of_the_whole_model(groups, experts):
    """A model from its seed: each layer (a mixture of experts' router, experts and shared
    expert too) and the output layer get the weights one stage gives them, whichever stage of
    a pp2 split builds them (ep1; the stages built here in one process)."""
    whole = _stage(groups, 1, 0, experts).state_dict()
    checked = 0
    for stage in (0, 1):
        for key, tensor in _stage(groups, 2, stage, experts).state_dict().items():
            if not isinstance(tensor, torch.Tensor):
                continue
            parts = key.split(".")
            if key.startswith("decoder.layers."):        # the stage's layer, its global number
                parts[2] = str(int(parts[2]) + 2 * stage)
            assert torch.equal(tensor, whole[".".join(parts)]), key
            checked += 1
    assert checked == len([v for v in whole.values() if isinstance(v, torch.Tensor)])


def test_each_expert_is_drawn_alike_on_whichever_expert_parallel_rank_holds_it(groups):
    """A mixture of experts from its seed: expert-parallel rank 1 of 2 holds experts 2 and 3
    with the weights one rank (ep1) gives them (megatron-core's loop drew each rank's experts
    on from the same state: copies of experts 0 and 1), and what the layer draws after them
    (its shared expert) is drawn alike."""
    import copy

    from mimo_train.mcore.grouped_experts import GroupedExperts

    class SecondOfTwo:                      # the expert-parallel group as rank 1 of 2 sees it
        def rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

    def built(pgs, experts: int):
        torch.manual_seed(3)
        module = _experts(GroupedExperts, pgs, seed=3, count=experts)
        return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)
                }, torch.rand(4)
    whole, after = built(groups, 4)
    split = copy.copy(groups)
    split.ep = SecondOfTwo()
    half, after_half = built(split, 2)
    assert half.keys() == {key.replace(f"local_experts.{e}.", f"local_experts.{e - 2}.")
                           for key in whole for e in (2, 3) if f"local_experts.{e}." in key}
    for key, tensor in half.items():
        number = int(key.split(".")[1])
        assert torch.equal(tensor, whole[key.replace(f"local_experts.{number}.",
                                                     f"local_experts.{number + 2}.")]), key
    assert not torch.equal(half["local_experts.0.linear_fc1.weight"],
                           whole["local_experts.0.linear_fc1.weight"])
    assert torch.equal(after, after_half)
