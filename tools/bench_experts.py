"""A rank's local experts, forward and backward: megatron-core's ``SequentialMLP`` (a loop over
experts after reading their token counts on the host) against mimo's ``GroupedExperts`` (two
grouped GEMMs, ``mcore.grouped_experts``) with the same weights, in the same run, on the CPU
(a one-rank gloo world in this process). Prints each one's milliseconds, their ratio and the
outputs' largest difference per experts x tokens.

Per experts x tokens: the milliseconds of one forward and backward of each (median of
``--repeats``), the ratio loop / grouped (above 1: grouped is faster), and the largest
difference of the outputs relative to the largest entry. Router-like token counts: the
tokens x top-k rows spread over the experts unevenly (seeded). No figure is asserted.

    python tools/bench_experts.py [--experts 8 32 128] [--tokens 512 4096] [--hidden 64]
                                  [--ffn 32] [--topk 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _experts(kind, count: int, hidden: int, ffn: int, groups):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    from mimo_train.mcore import TransformerConfig
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                               num_moe_experts=count, moe_ffn_hidden_size=ffn,
                               ffn_hidden_size=ffn, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False,
                               use_cpu_initialization=True)
    torch.manual_seed(0)
    return kind(count, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                             linear_fc2=RowParallelLinear), pg_collection=groups)


def _once(experts, tokens, probs, counts) -> tuple[float, torch.Tensor]:
    x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    started = time.perf_counter()
    output, _ = experts(x, counts, p)
    output.square().sum().backward()
    return time.perf_counter() - started, output.detach()


def _time(sides: list, tokens, probs, counts, repeats: int) -> list[tuple[float, torch.Tensor]]:
    """Each of ``sides``' median milliseconds and last output; the sides alternate in each
    repeat (the first is a warm-up), so that a busy machine's spells weigh on both alike."""
    times: list[list[float]] = [[] for _ in sides]
    outputs: list = [None] * len(sides)
    for repeat in range(repeats + 1):
        for index, experts in enumerate(sides):
            seconds, outputs[index] = _once(experts, tokens, probs, counts)
            if repeat:
                times[index].append(seconds)
    return [(statistics.median(found) * 1e3, output) for found, output in zip(times, outputs)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=32)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)        # thread pools spinning on a shared machine swamp the ratio

    from megatron.core.transformer.moe.experts import SequentialMLP

    from mimo_data.loading.layout import Layout
    from mimo_train.mcore.grids import build_infra
    from mimo_train.mcore.grouped_experts import GroupedExperts
    from mimo_train.runtime import distributed

    print(f"{'experts':>7} {'rows':>6} {'loop ms':>8} {'grouped ms':>10} {'ratio':>6} "
          f"{'max rel diff':>12}")
    with distributed.alone():
        groups = build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs
        for count in args.experts:
            loop = _experts(SequentialMLP, count, args.hidden, args.ffn, groups)
            grouped = _experts(GroupedExperts, count, args.hidden, args.ffn, groups)
            grouped.load_state_dict(loop.state_dict())
            for tokens in args.tokens:
                rows = tokens * args.topk
                generator = torch.Generator().manual_seed(count + tokens)
                picks = torch.multinomial(torch.rand(count, generator=generator) ** 3, rows,
                                          replacement=True, generator=generator)
                counts = torch.bincount(picks, minlength=count)
                x = torch.randn(rows, args.hidden, generator=generator)
                probs = torch.rand(rows, generator=generator)
                (loop_ms, expected), (grouped_ms, found) = _time([loop, grouped], x, probs,
                                                                 counts, args.repeats)
                difference = ((found - expected).abs().max() / expected.abs().max()).item()
                print(f"{count:>7} {rows:>6} {loop_ms:>8.2f} {grouped_ms:>10.2f} "
                      f"{loop_ms / grouped_ms:>6.2f} {difference:>12.1e}", flush=True)


if __name__ == "__main__":
    main()
