"""Fan-in with a variable token count per sample: encoder DP > language DP, non-colocated.

megatron-core 0.19's bridge already sends each encoder DP rank's output (its samples' tokens,
in placeholder order) to the language DP rank whose part holds those samples, with the shapes
exchanged first, and concatenates them there in rank order: the forward pass is right for any
counts. Two things assume equal counts:

- the backward pass cuts the gradient of the concatenation evenly (``tensor_split``) before
  sending each encoder rank its piece; ``SizedBridgeCommunicator`` cuts it at the sizes the
  pieces arrived with. The receiving leader records them per micro-batch when the shapes
  arrive and uses them, first in first out, for that micro-batch's gradient (the schedule runs
  backward passes in forward order). ``finish`` ends a schedule run: a forward-only run sends
  no gradient, so its record is dropped; after a training run every record must have been
  used, or the routing is out of step and the run stops;
- ``MimoModel`` refuses to annotate per-sample sizes when fanning in (its TODO in
  ``_attach_modality_split_sizes``); ``RoutedMimoModel`` skips the annotation there, since
  each encoder rank's whole output goes to one language rank.

Both sides know every sample's count from the token table, and the collator checks
placeholders against encoder outputs item by item, so the sizes always agree with the data.
"""

from __future__ import annotations

from collections import deque

import torch

from mimo_data.loading.layout import LANGUAGE
from mimo_train.mcore import (BridgeCommunicator, HyperCommGrid,
                              MultiModulePipelineCommunicator)
from mimo_train.mcore.deepstack import DeepstackMimoModel


class SizedBridgeCommunicator(BridgeCommunicator):
    """A bridge whose receiving side returns each source its own share of the gradient."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._arrived: deque[list[int]] = deque()    # per micro-batch: sizes per source

    def finish(self, forward_only: bool) -> None:
        if forward_only:
            self._arrived.clear()
        elif self._arrived:
            raise RuntimeError(
                f"bridge {self.src_module_name} -> {self.dest_module_name}: "
                f"{len(self._arrived)} micro-batch(es) received without their gradient sent "
                "back; this is a bug in mimo, report it")

    def _communicate_shapes(self, tensor_to_send_next=None, recv_next=False, recv_prev=False,
                            tensor_to_send_prev=None):
        forward, gradients = super()._communicate_shapes(
            tensor_to_send_next=tensor_to_send_next, recv_next=recv_next, recv_prev=recv_prev,
            tensor_to_send_prev=tensor_to_send_prev)
        if recv_prev:
            self._arrived.append([int(shape[self._batch_dim]) for shape in forward])
        return forward, gradients

    def _split_tensor_at_batch_dim(self, aggregated_tensor: torch.Tensor, num_splits: int):
        if not self.is_current_rank_in_grid(self.dest_grid):   # activations: megatron-core's
            return super()._split_tensor_at_batch_dim(aggregated_tensor, num_splits)
        sizes = self._arrived.popleft()                        # a gradient: as it arrived
        if len(sizes) != num_splits or sum(sizes) != aggregated_tensor.size(self._batch_dim):
            raise RuntimeError(
                f"bridge {self.src_module_name} -> {self.dest_module_name}: a gradient of "
                f"{aggregated_tensor.size(self._batch_dim)} rows for {num_splits} sources, "
                f"whose activations arrived as {sizes} rows; this is a bug in mimo, report it")
        return [piece.contiguous()
                for piece in torch.split(aggregated_tensor, sizes, dim=self._batch_dim)]


class SizedPipelineCommunicator(MultiModulePipelineCommunicator):
    """megatron-core's multi-module communicator with ``SizedBridgeCommunicator`` bridges."""

    def _build_bridge_comms(self):
        for source, grid in self.module_to_grid_map.items():
            for destination in self.topology[source]:
                self.bridge_comms.append(SizedBridgeCommunicator(
                    src_grid=grid, dest_grid=_cp_in_tp(self.module_to_grid_map[destination]),
                    dim_mapping=self.dim_mapping, comm_dtype=self.config.pipeline_dtype,
                    src_module_name=source, dest_module_name=destination,
                    tensor_ndim=self.module_output_ndim.get(source, 3)))

    def finish(self, forward_only: bool) -> None:
        """End a schedule run (see the module docstring)."""
        for bridge in self.bridge_comms:
            bridge.finish(forward_only)


def _cp_in_tp(grid: HyperCommGrid) -> HyperCommGrid:
    """``grid`` with its context-parallel ranks counted as tensor-parallel ones, for the
    bridge: megatron-core's asserts cp1 (its CP support is to come), but it addresses each DP
    replica's tp x cp ranks as one group (the leader receives the rows and broadcasts them to
    the group; its gradient goes back), which is what context parallelism needs: every CP rank
    splices the whole sequence before its cut, and the rows' gradient is summed over the CP
    group before it leaves (``mcore.context_parallel``). tp and cp are the two fastest dims, so
    the folded grid has the same groups."""
    shape = dict(zip(grid.dim_names, grid.shape))
    if shape.get("cp", 1) == 1:
        return grid
    shape["tp"], shape["cp"] = shape["tp"] * shape["cp"], 1
    return HyperCommGrid([shape[d] for d in grid.dim_names], list(grid.dim_names),
                         rank_offset=grid.rank_offset, backend=grid.backend)


class RoutedMimoModel(DeepstackMimoModel):
    """``MimoModel`` that fans in variable per-sample counts (see the module docstring), with
    deepstack rows (``mcore.deepstack``)."""

    def _attach_modality_split_sizes(self, output, input_ids, encoder_name):
        grids = self.mimo_config.module_to_grid_map
        if grids and _dp(grids[encoder_name]) > _dp(grids[LANGUAGE]):
            return          # the whole output goes to one language rank: nothing to cut
        super()._attach_modality_split_sizes(output, input_ids, encoder_name)


def _dp(grid) -> int:
    return grid.shape[grid.dim_names.index("dp")]
