"""Fused formulas compiled on a GPU, run as written elsewhere: ``Compiler``, which the towers'
fusions (``model.tower_fusions``) and the language models' rotary (``mcore.rope_fusion``)
call. torch.compile does the compiling; this adds what both need around it: dynamic lengths
(the other sizes constants) and detached tensors (whatever the lengths or the tensors'
autograd state, no new graph; a new
memory layout or a dimension of size 1 still makes one), numbers as constants of the graph,
and a formula past torch's recompile limit run as written instead of stopping the run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mimo_train.runtime.console import PREFIX, say


class Compiler:
    """Runs the fused formulas: compiled by ``backend`` for tensors on ``devices``, else as
    written. Each tensor's first dimension (the tokens; a CLIP batch's images) is dynamic, so
    another length makes no other graph (another memory layout, such as a strided view, or a
    dimension of size 1 does); its other sizes (heads, widths) are constants of the graph:
    with every size symbolic, inductor's kernels divide each element's index by sizes read at
    run time, and on the H200 the towers' rotary backward took 1.85 ms a call, ~9% of the
    packed 8k step (docs/benchmarks.md, 2026-12-04); another value there makes another graph
    (the language rotary has one for the queries' heads, one for the keys' groups; torch's
    automatic dynamic shapes, which would make such a size symbolic, are off). Its tensors are
    passed detached, so whether they need a gradient, are parameters or views (no-grad
    evaluation, recompute, a frozen weight) makes no other graph. Its numbers (a rotary's
    scale, QuickGELU's constant, a norm's epsilon: arguments or globals) are constants of the
    graph: under dynamic sizes dynamo would make each float an input, which every call wraps
    into a tensor on the host and reads back (seven operators a call outside the graph; ~3,100
    a step with their views for Qwen2-VL-2B, its rotaries and QuickGELU forward and backward,
    tools/bench_operators.py); another value makes another graph. ``compiled`` holds what it
    compiled (the formula itself once past torch.compile's recompile limit)."""

    def __init__(self, backend: str | Callable = "inductor", devices: tuple[str, ...] = ("cuda",)):
        self.backend, self.devices = backend, devices
        self.compiled: dict[Callable, Callable] = {}

    def __call__(self, formula: Callable, *args):
        if args[0].device.type not in self.devices:
            return formula(*args)
        if formula not in self.compiled:
            self.compiled[formula] = torch.compile(formula, backend=self.backend,
                                                   dynamic=False, fullgraph=True)
        detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
        for arg in detached:
            if isinstance(arg, torch.Tensor) and arg.dim():
                # "maybe": a first dimension the formula ties to another's constant size
                # (a norm's weight, the width) stays a constant, without an error
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        # dynamo's setting is the process's, not a thread's: the fused formulas are called
        # from one thread at a time (a step's forward, then its backward)
        config = torch._dynamo.config
        specialized = config.specialize_float
        config.specialize_float = True          # read when dynamo traces: on a call that compiles
        try:
            return self.compiled[formula](*detached)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # more kinds of input than dynamo keeps graphs for: with fullgraph torch raises
            # where it would otherwise run the function as written, which this does from now
            say(f"{PREFIX}the fused {formula.__name__} reached torch.compile's "
                "recompile limit: it runs as written from here on (the same results, slower)")
            self.compiled[formula] = formula
            return formula(*detached)
        finally:
            config.specialize_float = specialized
