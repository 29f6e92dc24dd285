"""The language model's loss step, forward and backward, with every token's logits at once
(megatron-core's ``output_layer`` and ``compute_language_model_loss``) against mimo's loss at
the trained tokens only (``mcore.language_loss``), all of them at once and in chunks
(``model.language.loss_chunk_tokens``), with the same weights and batch, on the CPU (a
one-rank gloo world). Prints each variant's peak memory growth (GiB), seconds and largest
differences from megatron-core's loss and gradients.

Each variant runs in a fresh process (``python tools/bench_loss.py --run CHUNK ...``; -1:
megatron-core's path), on the output layer of a language model built as the trainer builds it
(``model.build``'s, no embedding, one layer that is not run) and the decoder's hidden states of
``--tokens`` tokens, one in five untrained or, with ``--trained-every N``, one in N trained (an
image conversation's answer): from before the forward pass (the process's peak resident memory
reset then, ``/proc/self/clear_refs``) to the end of the backward pass, the growth of its peak
resident memory (VmHWM: large tensors are mapped and unmapped whole, so it follows them), the
seconds, and for mimo's what
``planning.memory`` predicts for it (the last stage's hidden states' gradient, its output-layer
temporaries and the weight's gradient). Then each variant's peak over megatron-core's, and
their largest differences of the trained tokens' loss and of the hidden states' and the
weight's gradients (relative to the largest entry). Nothing is asserted.

    python tools/bench_loss.py [--tokens 4096] [--vocab 151936] [--hidden 1536] \\
        [--chunks 1024 4096] [--precision fp32] [--trained-every 10]

Defaults: Qwen2-VL-2B's vocabulary and width; 4096 tokens make 2.5 GB of fp32 logits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from mimo_data.process_memory import status_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(chunk: int, tokens: int, vocab: int, hidden: int, precision: str,
            trained_every: int, out: str) -> dict:
    """One variant in this process (see the module docstring); saves its loss and gradients
    to ``out`` for the comparison."""
    import torch

    from mimo_data.loading.layout import Layout
    from mimo_train.mcore import TransformerConfig, ensure_global_memory_buffer
    from mimo_train.mcore.grids import build_infra
    from mimo_train.mcore.layer_specs import language_block_spec
    from mimo_train.model.build import _SeededGPTModel
    from mimo_train.planning import memory as mem
    from mimo_train.planning.dims import Stack
    from mimo_train.runtime import distributed

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with distributed.alone():
        ensure_global_memory_buffer()
        groups = build_infra(Layout.parse("language=dp1"), "gloo").modules["language"].pgs
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=8,
            use_cpu_initialization=True, calculate_per_token_loss=True,
            gradient_accumulation_fusion=False, bias_activation_fusion=False,
            variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
            params_dtype=dtype, bf16=dtype == torch.bfloat16)
        model = _SeededGPTModel(
            seed=1, vocabulary=vocab, loss_chunk_tokens=max(chunk, 0), packed_rows=False,
            config=config, transformer_layer_spec=language_block_spec(config, backend="local"),
            vocab_size=vocab, max_sequence_length=tokens, position_embedding_type="rope",
            share_embeddings_and_output_weights=False, pre_process=False,
            pg_collection=groups).to(dtype)
        generator = torch.Generator().manual_seed(0)
        states = torch.randn(tokens, 1, hidden, generator=generator).to(dtype)
        labels = torch.randint(0, vocab, (1, tokens), generator=generator)
        if trained_every:
            labels[:, [i for i in range(tokens) if i % trained_every]] = -100
        else:
            labels[:, ::5] = -100
        mask = (labels != -100).float()
        states.requires_grad_()
        with open("/proc/self/clear_refs", "w") as f:          # reset VmHWM to VmRSS
            f.write("5")
        before = status_bytes("VmRSS")["VmRSS"]
        started = time.perf_counter()
        if chunk >= 0:      # what GPTModel._postprocess does with mimo's output_processor
            loss = model._trained_tokens_loss(
                hidden_states=states, output_layer=model.output_layer, output_weight=None,
                labels=labels)
        else:               # and without one
            logits, _ = model.output_layer(states)
            loss = model.compute_language_model_loss(labels, logits)
            del logits
        (loss.float() * mask).sum().backward()
        seconds = time.perf_counter() - started
        peak = status_bytes("VmHWM")["VmHWM"] - before
        torch.save({"loss": loss.detach() * mask, "hidden": states.grad,
                    "weight": model.output_layer.weight.grad}, out)
    stack = Stack(layers=1, hidden=hidden, heads=1, query_groups=1, kv_channels=hidden,
                  ffn_hidden=8, gated=False, vocab=vocab)
    settings = mem.Settings(precision, loss_chunk_tokens=max(chunk, 0))
    layers = mem.stack_activation_bytes(stack, 1, tokens, tokens ** 2, settings)
    predicted = mem.language_activation_bytes(stack, [tokens], settings) - layers + \
        mem.language_temporary_bytes(stack, tokens, float(mask.sum()), settings) \
        if chunk >= 0 else None
    return {"chunk": chunk, "peak": peak, "seconds": seconds, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--trained-every", type=int, default=0, metavar="N",
                        help="one token in N trained, 1 for all (default: one in five "
                        "untrained)")
    args = parser.parse_args()
    if args.trained_every < 0:
        parser.error(f"--trained-every is {args.trained_every}: give N >= 1 (one token in N "
                     "trained), or leave it out for one in five untrained")
    shape = dict(tokens=args.tokens, vocab=args.vocab, hidden=args.hidden,
                 precision=args.precision, trained_every=args.trained_every)
    if args.run is not None:
        print("BENCH " + json.dumps(measure(args.run, out=args.out, **shape)), flush=True)
        return
    import torch

    print(f"{args.tokens} tokens, vocabulary {args.vocab}, hidden {args.hidden}, "
          f"{args.precision}: logits {args.tokens * args.vocab * 4 / 2**30:.2f} GiB in fp32")
    print(f"{'chunk':>6} {'peak GiB':>9} {'predicted':>9} {'seconds':>8} {'peak ratio':>10} "
          f"{'loss diff':>9} {'hidden grad':>11} {'weight grad':>11}")
    results, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for chunk in [-1, 0, *args.chunks]:
            out = os.path.join(tmp, f"{chunk}.pt")
            command = [sys.executable, os.path.abspath(__file__), "--run", str(chunk),
                       "--out", out, *[f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
            if line is None:
                sys.exit(f"chunk {chunk} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            result = json.loads(line[6:])
            saved = torch.load(out)
            first = first or (result, saved)
            (base, reference) = first
            diffs = [((saved[k].float() - reference[k].float()).abs().max()
                      / reference[k].float().abs().max()).item()
                     for k in ("loss", "hidden", "weight")]
            results.append(result)
            name = {-1: "mcore", 0: "all"}.get(chunk, chunk)
            predicted = "" if result["predicted"] is None else \
                f"{result['predicted'] / 2**30:.2f}"
            print(f"{name:>6} {result['peak'] / 2**30:>9.2f} "
                  f"{predicted:>9} {result['seconds']:>8.1f} "
                  f"{result['peak'] / base['peak']:>10.3f} {diffs[0]:>9.1e} {diffs[1]:>11.1e} "
                  f"{diffs[2]:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
