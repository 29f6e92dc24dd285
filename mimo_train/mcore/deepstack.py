"""Deepstack (Qwen3-VL): vision features added to the language model's hidden states at the
visual positions after its first decoder layers, under any layout.

An encoder module whose encoder has ``deepstack`` emits one row per placeholder,
``[main | deepstack 0 | … | deepstack K-1]``, each part the language width ``h``: the main and
the deepstack rows of the same tokens travel together through any bridge (fan-in and fan-out
cut rows, never columns), and the language side learns K from the width alone.

- ``DeepstackMimoModel.align_embeddings_by_token_positions`` (the language model's first
  stage, colocated or not) splices the main rows as ``MimoModel`` does (``mcore.splice``'s),
  and places each deepstack part at its placeholders' positions (``SplicingMimoModel.place``):
  K tensors ``[S, B, h]``, zero elsewhere
  (transformers' ``_deepstack_process`` adds the rows at the visual positions, image and video
  tokens in token order: the same sum), split over the sequence as the embeddings are under
  sequence and context parallelism. It hands them to the language model.
- ``DeepstackLanguage`` (the ``GPTModel`` the language model is) adds part k to the output
  of its decoder layer with global index k (forward hooks). Under pipeline parallelism a stage
  sends the parts for layers past its own beside its hidden states (``[S, B, (1 + n) · h]``;
  megatron-core exchanges shapes first, ``variable_seq_lengths``) and the next stage takes them
  apart: the rows reach the stages holding their layers, and stop after the last of them.
  Gradients flow back the same way, into the tower's inner layers and deepstack mergers.

megatron-core has no such path (its ``MimoModel`` splices at the input embeddings only), hence
this module. The hooks add parts that are no input of megatron-core's (reentrant) layer
checkpoints: under full recompute their gradient would flow through the tower twice, or under
pipeline stages read the next micro-batch's parts, so full recompute is refused at start-up
(``plan.rules``); selective recompute checkpoints the attention core only.
"""

from __future__ import annotations

import torch

from megatron.core.utils import unwrap_model

from mimo_train.mcore import GPTModel
from mimo_train.mcore.context_parallel import SequenceShards
from mimo_train.mcore.splice import SplicingMimoModel


def split_rows(rows: torch.Tensor, width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An encoder module's rows → (main rows, deepstack parts), each ``[tokens, width]``."""
    if rows.size(-1) % width:
        raise ValueError(f"encoder rows of {rows.size(-1)} features for a language width of "
                         f"{width}: neither the width nor (1 + deepstack features) times it")
    main, *deepstack = rows.split(width, dim=-1)
    return main, deepstack


class DeepstackMimoModel(SplicingMimoModel):
    """``MimoModel`` (``mcore.splice``'s) that splits deepstack rows off the encoder modules'
    rows (see the module docstring) and gives them to its language model."""

    def _empty_encoder_output(self, encoder_name):
        """megatron-core's rows of an encoder rank with nothing to encode, as wide as its
        encoder's deepstack rows where it has them (its encoders' ``deepstack_width``): the
        bridge concatenates them with the other encoder ranks' under fan-in."""
        empty = super()._empty_encoder_output(encoder_name)
        module = unwrap_model(self.modality_submodules[encoder_name])
        widths = [w for e in module.encoders.values() if (w := getattr(e, "deepstack_width",
                                                                        None))]
        return empty.new_empty((0, widths[0])).requires_grad_() if widths else empty

    def align_embeddings_by_token_positions(self, modality_embeddings, input_ids,
                                            special_token_ids):
        width = modality_embeddings["text"].size(-1)
        main, added = {}, []
        for name, rows in modality_embeddings.items():
            if name != "text" and isinstance(self.partition_adapter, SequenceShards):
                rows = self.partition_adapter.rows(rows)    # each CP rank's tokens' gradient
            if name == "text" or rows.size(-1) == width:
                main[name] = rows
                continue
            main[name], parts = split_rows(rows, width)
            placed = [self.place(part, input_ids, name) for part in parts]
            if self.partition_adapter is not None:    # split over the sequence as the embeddings
                placed = [self.partition_adapter.shard(p, None, None)[0] for p in placed]
            added = [a + p for a, p in zip(added, placed)] if added else placed
        unwrap_model(self.language_model).take_deepstack(dict(enumerate(added)))
        return super().align_embeddings_by_token_positions(main, input_ids, special_token_ids)


class DeepstackLanguage(GPTModel):
    """The language model's side (the ``GPTModel`` ``attention.LanguageModel`` extends): adds
    the deepstack parts of the micro-batch in flight after their decoder layers, and carries
    those of later stages' layers to the next stage."""

    def enable_deepstack(self) -> None:
        """Hook the decoder layers (once, after ``GPTModel.__init__``)."""
        self._deepstack: dict[int, torch.Tensor] = {}
        for layer in self.decoder.layers:
            layer.register_forward_hook(self._add_deepstack)

    def take_deepstack(self, parts: dict[int, torch.Tensor]) -> None:
        """The parts of the next forward pass: global layer index → ``[S, B, h]``."""
        self._deepstack = parts

    def _add_deepstack(self, layer, inputs, output):
        part = self._deepstack.get(layer.layer_number - 1)
        if part is None:
            return output
        hidden, *rest = output
        return (hidden + part.to(hidden.dtype), *rest)

    def _layer_span(self) -> tuple[int, int]:
        """Global indices of this stage's first layer and of the one after its last."""
        layers = self.decoder.layers
        return layers[0].layer_number - 1, layers[-1].layer_number

    def set_input_tensor(self, input_tensor) -> None:
        tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        width = self.config.hidden_size
        if tensor is None or tensor.size(-1) == width:
            self.take_deepstack({})
            return super().set_input_tensor(input_tensor)
        hidden, parts = split_rows(tensor, width)
        first, _ = self._layer_span()
        self.take_deepstack({first + k: part for k, part in enumerate(parts)})
        super().set_input_tensor(hidden.contiguous())

    def carry_deepstack(self, hidden: torch.Tensor) -> torch.Tensor:
        """A non-last stage's output: ``hidden`` and the parts of later stages' layers."""
        _, end = self._layer_span()
        later = [self._deepstack[k] for k in sorted(self._deepstack) if k >= end]
        return torch.cat([hidden, *later], dim=-1) if later else hidden
