"""A mixture of experts' local experts as grouped GEMMs (``mcore.grouped_experts``) against
megatron-core's own ``SequentialMLP`` (its loop over experts) with the same weights, in
process on a one-rank gloo world: the output and every gradient (the tokens', the router
weights', each expert's two weights) in fp32, an expert receiving no token among them; the
checkpoint keys are ``SequentialMLP``'s; where the experts are not plain linears (a LoRA
adapter on one) it runs the loop. The trained models' steps with grouped experts against
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


def _experts(kind, groups, seed: int = 0):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from mimo_train.mcore import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1,
                               num_moe_experts=4, moe_ffn_hidden_size=12, ffn_hidden_size=12,
                               gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True)
    torch.manual_seed(seed)
    return kind(4, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
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
