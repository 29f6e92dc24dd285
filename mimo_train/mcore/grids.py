"""Per-module ``HyperCommGrid``s and process-group collections, built from a ``Layout``.

Every module (``language`` and each encoder) gets a grid of shape ``[tp, cp, dp, pp]`` with
dim names ``tp, cp, dp, pp`` at its rank offset (and an expert view ``[expt_tp, ep, expt_dp,
pp]`` over the same ranks: the layout's ``etp`` and ``ep``): the rank order
``mimo_data.loading.layout`` uses for data placement, so the trainer's DP groups are the
loader's DP slices. Group creation is collective over the whole world, so every rank builds
every module's groups, in layout order;
each rank then keeps a ``ProcessGroupCollection`` only for the modules it is in. Topology: each
encoder feeds ``language``. ``optimizer_groups``: a module's groups as its optimizer takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from mimo_data.loading.layout import GRID_DIM_NAMES, LANGUAGE, Layout, ModuleLayout, RankRole
from mimo_train.mcore import (HyperCommGrid, ProcessGroupCollection,
                              _get_pg_collection_for_optimizer)

# Groups megatron-core reads from a module's ProcessGroupCollection: the models (tp, cp, pp,
# tp_cp, mp, ...), DDP (dp, dp_cp, intra_dp_cp), finalize_model_grads and the optimizer
# (tp_dp_cp, intra_dist_opt = all dims), plus an expert view the optimizer asks for.
_BASE_GROUPS = (("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp"), ("tp", "cp"), ("tp", "pp"),
                ("tp", "dp", "cp"), ("tp", "cp", "dp", "pp"))
_EXPERT_GROUPS = (("ep",), ("expt_tp",), ("expt_dp",), ("expt_tp", "ep"),
                  ("expt_tp", "ep", "pp"))


@dataclass
class ModuleInfra:
    """One module's grid and, on ranks inside it, its process groups."""
    name: str
    grid: HyperCommGrid
    pgs: ProcessGroupCollection | None  # None on ranks outside the module


@dataclass
class Infra:
    """Grids for every module, this rank's role and topology."""
    layout: Layout
    role: RankRole
    modules: dict                       # name -> ModuleInfra, layout order

    @property
    def grids(self) -> dict:
        return {name: module.grid for name, module in self.modules.items()}

    @property
    def topology(self) -> dict:
        """megatron-core's module dependency map: each encoder feeds the language model."""
        return {**{e.name: [LANGUAGE] for e in self.layout.encoders}, LANGUAGE: []}

    @property
    def local(self) -> dict:
        """Modules this rank runs: name -> ModuleInfra."""
        return {name: m for name, m in self.modules.items() if m.pgs is not None}


def expert_view(module: ModuleLayout) -> tuple[list[int], list[str]]:
    """The expert view's shape and dim names: each stage's tp x cp x dp ranks as etp x ep x
    expert dp, etp fastest (megatron-core's ``tp-ep-dp-pp`` order); without ``ep`` it mirrors
    the dense grid."""
    return ([module.expert_tp, module.ep, module.expert_dp, module.pp],
            ["expt_tp", "ep", "expt_dp", "pp"])


def build_infra(layout: Layout, backend: str, timeout: timedelta | None = None) -> Infra:
    """Create every module's grid and groups (collective: call on all ranks, same layout);
    ``timeout``: their collectives' (torch's default when None)."""
    rank = dist.get_rank()
    modules = {}
    for module in layout.modules:
        shape = [getattr(module, dim) for dim in GRID_DIM_NAMES]
        grid = HyperCommGrid(shape, list(GRID_DIM_NAMES), rank_offset=module.rank_offset,
                             backend=backend)
        shape, names = expert_view(module)
        grid.register_view("expert", shape=shape, dim_names=names, shared_dims=["pp"])
        for dims in _BASE_GROUPS:
            grid.create_pg(list(dims), timeout=timeout)
        for dims in _EXPERT_GROUPS:
            grid.create_pg(list(dims), view="expert", timeout=timeout)
        embd = None
        if module.pp > 1:
            # first and last stage of each pipeline: megatron-core keeps tied input/output
            # embeddings equal over this group (a pretrained language model may tie them)
            pairs = [[ranks[0], ranks[-1]] for ranks in grid.get_rank_enum("pp")]
            embd, _ = dist.new_subgroups_by_enumeration(pairs, backend=backend, timeout=timeout)
        pgs = _collection(grid, embd) if rank in module.ranks else None
        modules[module.name] = ModuleInfra(module.name, grid, pgs)
    return Infra(layout, layout.role(rank), modules)


def _collection(grid, embd):
    def expert(dims):
        return grid.get_pg(dims, view="expert")

    return ProcessGroupCollection(
        tp=grid.get_pg("tp"), cp=grid.get_pg("cp"), pp=grid.get_pg("pp"),
        dp=grid.get_pg("dp"), dp_cp=grid.get_pg(["dp", "cp"]),
        intra_dp_cp=grid.get_pg(["dp", "cp"]), tp_cp=grid.get_pg(["tp", "cp"]),
        mp=grid.get_pg(["tp", "pp"]), tp_dp_cp=grid.get_pg(["tp", "dp", "cp"]),
        intra_dist_opt=grid.get_pg(["tp", "cp", "dp", "pp"]),
        ep=expert("ep"), expt_tp=expert("expt_tp"), expt_dp=expert("expt_dp"),
        intra_expt_dp=expert("expt_dp"), tp_ep=expert(["expt_tp", "ep"]),
        tp_ep_pp=expert(["expt_tp", "ep", "pp"]),
        # embd: None without pipeline stages; no learned position embeddings (rope)
        embd=embd, pos_embd=None)


def optimizer_groups(grid: HyperCommGrid) -> ProcessGroupCollection:
    """The process groups of the module of ``grid`` (built by ``build_infra``) as megatron-core's
    optimizer takes them, the distributed optimizer's and the expert views' included: those its
    ``get_mimo_optimizer`` gives each module, from its own helper (private: there is no public
    one), so that they stay the ones megatron-core would give."""
    return _get_pg_collection_for_optimizer(grid)
