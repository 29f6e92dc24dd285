"""One tensor-parallel rank's parts of a checkpoint's tensors, as the converters cut them
(``RankParts``): its rows or columns of a tensor, or of a section of a fused one, read as such
(``Tensors.part``) rather than cut from the whole, in the dtype stored."""

from __future__ import annotations

import torch

from mimo_train.families.base import Tensors


def span(size: int, tp_size: int, tp_rank: int) -> slice:
    """TP rank ``tp_rank``'s part of ``size`` rows, as ``torch.chunk`` cuts them."""
    step = -(-size // tp_size)
    start = min(tp_rank * step, size)
    return slice(start, min(start + step, size))


class RankParts:
    """TP rank ``tp_rank`` of ``tp_size``'s parts of the tensors of ``tensors``."""

    def __init__(self, tensors: Tensors, tp_rank: int, tp_size: int):
        self.tensors, self.tp_rank, self.tp_size = tensors, tp_rank, tp_size

    def span(self, size: int, offset: int = 0) -> slice:
        """This rank's part of a section of ``size`` rows starting at row ``offset``."""
        part = span(size, self.tp_size, self.tp_rank)
        return slice(offset + part.start, offset + part.stop)

    def whole(self, name: str) -> torch.Tensor:
        """A tensor every rank holds whole (a norm, a router)."""
        return self.tensors.part(name)

    def rows(self, name: str, size: int | None = None, offset: int = 0) -> torch.Tensor:
        """Column-parallel (output features): this rank's rows of ``name``, or of its section
        of ``size`` rows from row ``offset``."""
        size = self.tensors.shape(name)[0] if size is None else size
        return self.tensors.part(name, (self.span(size, offset),))

    def cols(self, name: str) -> torch.Tensor:
        """Row-parallel (input features): this rank's columns of ``name``."""
        return self.tensors.part(name, (slice(None), self.span(self.tensors.shape(name)[1])))
