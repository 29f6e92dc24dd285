"""The language model's output layer and cross entropy in training: at the trained tokens
only, in chunks of ``model.language.loss_chunk_tokens`` of them (0: all at once).

megatron-core 0.19's path (``GPTModel._postprocess``: ``output_layer`` then
``compute_language_model_loss``) makes the logits of every token, ``[s, b, V / tp]`` in the
run's dtype, casts them to fp32 and keeps the softmax for the backward pass: at 32k tokens of
a 150k vocabulary, about 20 GB in fp32 per copy. In fine-tuning most of those tokens are never
trained (the prompt, the media placeholders, the padding): their logits are computed, then
multiplied by a loss mask of 0. Its fused cross entropy (``cross_entropy_loss_fusion``: the
native or TransformerEngine kernel) saves one of those copies, not the logits; its linear
cross entropy (``fused_linear_cross_entropy``) is not in 0.19. It does take a hook in that
place, ``output_processor``, which gets the decoder's hidden states and the output layer:
mimo's language model (``model.build``) hands ``language_loss`` to it whenever it gets labels.

Only the rows whose label is trained (not ``ignore_index``) go through the output layer: the
same loss and gradients (an untrained row's loss is multiplied by 0, its gradient is 0), the
output layer's matmuls and the cross entropy's passes over the vocabulary on those rows alone
(a packed 8k row of image conversations trains about one token in ten). Their count sets the
shapes: the trainer's forward step hands the micro-batch's labels as the loader made them, on
the host, to the model's ``HostLabels`` (this rank's part under context parallelism), so the
device is never read; called without them (a test's direct call) the loss counts them on the
device, one wait. The loss returned for an untrained row is 0, not its cross entropy.

``ChunkedCrossEntropy`` takes, per chunk of ``chunk`` tokens (the last one shorter), the
logits ``x W^T`` (this TP rank's vocabulary rows), their cross entropy over the vocabulary
split across the TP ranks (megatron-core's ``vocab_parallel_cross_entropy``, step by step: the
max, the target's logit and the sum of exponentials, each all-reduced over the TP group) and,
in the same pass, the gradient of the trained tokens' loss with respect to ``x`` and ``W``;
the backward pass then only scales them. Why the gradients in the forward pass, rather than
``torch.utils.checkpoint`` per chunk: a checkpoint keeps nothing but makes each chunk's logits
again in the backward pass, one more ``x W^T`` matmul per token (a third more of the output
layer's work); here the output layer costs its three matmuls, as unchunked, and what waits
for the backward pass is ``W``'s gradient (``V / tp x h``, what the backward pass would make
anyway) and ``x``'s (``T x h``). ``W``'s gradient is summed over the chunks in fp32 (a bf16
chunk's added ``_ROWS`` output rows at a time, no ``V / tp x h`` product in bf16 beside the
sum) and cast to the weights' dtype once; a micro-batch of one chunk makes it in their dtype,
as unchunked.

The gradient is that of ``c · Σ_trained loss`` for a scalar ``c``: the output's gradient must
be ``c`` on the trained tokens (labels not ``ignore_index``) and 0 elsewhere, which is what
``training.step.loss_func`` makes of it (the per-token losses times the loss mask, which is 1
exactly where labels are trained, summed) and megatron-core's schedules (times a constant).
``c`` is read from the output's gradient on the device (no host sync); on the CPU, where a
check costs nothing, any other gradient is refused with an error rather than answered wrongly.

As the output layer does: under sequence parallelism the hidden states are all-gathered over
the TP group first (their gradient reduce-scattered back), under TP without it they enter a
copy region (their gradient all-reduced); rows past ``vocabulary`` (a checkpoint's
vocabulary padded for TP) get the dtype's lowest logit (``model.build``'s hook on the output
layer, which this path does not run). The loss per token is fp32, ``[b, s]``, as
``compute_language_model_loss`` returns it. Nothing here depends on the pipeline stage (it runs
on the last one's hidden states), on packing (a packed row is one sequence of tokens) or on
where the weight comes from (a tied embedding's, a frozen one's: no gradient made for it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

from mimo_train.mcore.context_parallel import span

# output rows per matmul of a bf16 chunk's weight gradient, added to the fp32 sum block by block
_ROWS = 8192


class HostLabels:
    """The next micro-batch's labels ``[B, S]`` on the host, the whole sequence the language
    model gets (``training.step.host_labels``), set by the forward step before the model runs
    and taken by the loss: how many of this rank's tokens are trained, read from the host."""

    def __init__(self) -> None:
        self.labels: torch.Tensor | None = None

    def take(self, ignore_index: int, cp_group: dist.ProcessGroup | None) -> int | None:
        """The trained tokens of this rank's part (``cp_group``: its contiguous 1/cp, as
        ``context_parallel`` cuts it); None when none were set."""
        labels, self.labels = self.labels, None
        if labels is None:
            return None
        if cp_group is not None:
            labels = labels[:, span(labels.size(1), cp_group)]
        return int((labels != ignore_index).sum())


def language_loss(hidden: torch.Tensor, output_layer, weight: torch.Tensor | None,
                  labels: torch.Tensor, chunk: int, vocabulary: int,
                  ignore_index: int, trained: int | None = None) -> torch.Tensor:
    """The per-token loss ``[b, s]`` (fp32) of the decoder's ``hidden`` states ``[s', b, h]``
    (``s' = s / tp`` under sequence parallelism) through ``output_layer`` (megatron-core's
    ``ColumnParallelLinear``; ``weight``: the tied embedding's, else its own) against
    ``labels`` ``[b, s]``, ``chunk`` of its ``trained`` tokens at a time (``HostLabels``';
    None: counted on the device; see the module docstring)."""
    group = output_layer.tp_group
    weight = output_layer.weight if weight is None else weight
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                      group=group)
    elif group.size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    s, b, h = hidden.shape
    target = labels.transpose(0, 1).reshape(s * b)          # the rows' order: [s, b]
    grads = torch.is_grad_enabled()
    loss = ChunkedCrossEntropy.apply(
        hidden.reshape(s * b, h), weight, target, chunk, group, vocabulary, ignore_index,
        grads and hidden.requires_grad, grads and weight.requires_grad, trained)
    return loss.view(s, b).transpose(0, 1).contiguous()


class ChunkedCrossEntropy(torch.autograd.Function):
    """``[n, h]`` rows, this TP rank's ``[V / tp, h]`` output rows and ``[n]`` targets → the
    ``[n]`` fp32 losses, ``chunk`` rows at a time; the gradients of the trained rows' losses
    made in the forward pass (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, target, chunk, group, vocabulary, ignore_index, x_grad,
                weight_grad, count):
        rows = weight.size(0)
        first = group.rank() * rows                 # this rank's first vocabulary row
        masked = max(vocabulary - first, 0) if vocabulary < first + rows else None
        mask = target != ignore_index
        trained = mask.float()
        # the trained rows alone (the module docstring), as many as the host counted
        if count is None:                           # the host waits for the device here
            picked_rows = torch.nonzero(mask).squeeze(1)
        else:
            picked_rows = torch.nonzero_static(mask, size=count).squeeze(1)
            _check_count(mask, count)
        xs, ts = x.index_select(0, picked_rows), target.index_select(0, picked_rows)
        n = xs.size(0)
        chunk = chunk or max(n, 1)                  # 0: all of them at once
        inside = (ts >= first) & (ts < first + rows)
        local = torch.where(inside, ts - first, 0)
        losses = torch.zeros(n, dtype=torch.float32, device=x.device)
        dxs = torch.empty_like(xs) if x_grad else None
        # W's gradient summed over the chunks in fp32, whatever the run's dtype; one chunk's
        # is made in the run's dtype, as unchunked
        single = n <= chunk
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) \
            if weight_grad and not single else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            part = xs[start:end]
            logits = torch.matmul(part, weight.t())
            if masked is not None:
                logits[:, masked:] = torch.finfo(logits.dtype).min
            z = logits.float()                      # the same tensor in an fp32 run
            del logits
            top = z.max(dim=-1).values
            _all_reduce(top, group, dist.ReduceOp.MAX)
            z -= top.unsqueeze(-1)
            index = torch.arange(end - start, device=x.device)
            picked = torch.where(inside[start:end], z[index, local[start:end]], 0.0)
            z.exp_()
            sums = torch.stack([picked, z.sum(dim=-1)])
            _all_reduce(sums, group, dist.ReduceOp.SUM)
            picked, total = sums[0], sums[1]
            losses[start:end] = torch.log(total) - picked
            if not (x_grad or weight_grad):
                continue
            # d loss / d logits = softmax - one-hot of the target
            z /= total.unsqueeze(-1)
            z[index, local[start:end]] -= inside[start:end].float()
            d = z.to(x.dtype)
            del z
            if x_grad:
                torch.matmul(d, weight, out=dxs[start:end])
            if weight_grad and single:
                dw = torch.matmul(d.t(), part)
            elif weight_grad and d.dtype == torch.float32:
                dw.addmm_(d.t(), part)
            elif weight_grad:       # bf16: a block of rows at a time, no V x h product kept
                for row in range(0, rows, _ROWS):
                    dw[row:row + _ROWS] += torch.matmul(d[:, row:row + _ROWS].t(), part)
            del d
        if weight_grad and dw is None:              # no trained row: a gradient of 0
            dw = torch.zeros_like(weight)
        # back to every row: an untrained one's loss and gradients are 0
        ctx.dx = None if dxs is None else \
            torch.zeros_like(x).index_copy_(0, picked_rows, dxs)
        ctx.dw = None if dw is None else dw.to(weight.dtype)
        ctx.trained = trained
        return torch.zeros(x.size(0), dtype=torch.float32, device=x.device).index_copy_(
            0, picked_rows, losses)

    @staticmethod
    def backward(ctx, grad):
        trained, dx, dw = ctx.trained, ctx.dx, ctx.dw
        ctx.dx = ctx.dw = ctx.trained = None
        scale = (grad * trained).sum() / trained.sum().clamp(min=1)
        if grad.device.type == "cpu" and not torch.allclose(grad, scale * trained,
                                                            rtol=1e-6, atol=0):
            raise RuntimeError(
                "the language loss (mcore.language_loss) gives the gradient of a scalar times "
                "the trained tokens' summed loss (it computes only their logits), but its "
                "output's gradient is not a scalar on the trained tokens and 0 elsewhere: a "
                "loss that weighs tokens otherwise is not one mimo trains")
        if dx is not None:
            dx.mul_(scale.to(dx.dtype))
        if dw is not None:
            dw.mul_(scale.to(dw.dtype))
        return dx, dw, None, None, None, None, None, None, None, None


def _check_count(mask: torch.Tensor, count: int) -> None:
    """That ``mask`` holds the ``count`` trained rows the host counted, without the host
    waiting for a GPU (torch's asynchronous assertion: a GPU's stops the run at its next sync
    with a device-side assert; the CPU's raises at once). A count too high would index past
    the trained rows; too low, drop some without a word."""
    # (CUDA's assertion takes a message of at most 255 characters)
    torch._assert_async(mask.sum() == count,
                        f"the loss was told {count} trained tokens, its labels hold another "
                        f"number: this is a bug in mimo, report it")


def _all_reduce(tensor: torch.Tensor, group, op) -> None:
    if group.size() > 1:
        dist.all_reduce(tensor, op=op, group=group)
