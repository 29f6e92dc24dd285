"""Fused formulas compiled on a GPU, run as written elsewhere: ``Compiler``, which the towers'
fusions (``model.tower_fusions``) and the language models' rotary (``mcore.rope_fusion``)
call. torch.compile does the compiling; this adds what both need around it: dynamic sizes and
detached tensors (whatever the lengths or the tensors' autograd state, no new graph; a new
memory layout or a dimension of size 1 still makes one), numbers as constants of the graph,
and a formula past torch's recompile limit run as written instead of stopping the run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mimo_train.runtime.console import PREFIX, say


class Compiler:
    """Runs the fused formulas: compiled by ``backend`` for tensors on ``devices``, else as
    written. Each formula's sizes are dynamic (another length makes no other graph; another
    memory layout, such as a strided view, or a dimension of size 1 does), and its tensors are
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
                                                   dynamic=True, fullgraph=True)
        detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
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
