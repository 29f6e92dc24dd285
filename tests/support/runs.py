"""What several test modules do with training runs, in one place (no test module imports another):

- one step under a layout (``tests/jobs/train_parity.py``: loss and every gradient) and its
  comparison with the colocated step (``step`` / ``compare``): the parity checks;
- ``mimo-train`` runs on forked ranks (``train``), their JSONL records, and a resumed run's
  agreement with the uninterrupted one (``assert_continues``).

Every job goes through ``launch.Ranks`` (the session's pre-imported parent of forked ranks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from support.launch import REPO, TESTS, Job, Ranks

PARITY_RUNNER = TESTS / "jobs" / "train_parity.py"
TOLERANCE = 1e-5                        # fp32 parity of losses and gradients across layouts
CONFIGS = REPO / "configs" / "train"


# ---------------------------------------------------------------------- one step's parity

def step(ranks: Ranks, out: Path, nproc: int, *overrides, save_init: Path | None = None,
         host_reads: bool = False, save_batches: bool = False) -> dict:
    """One step of ``tests/jobs/train_parity.py`` on ``nproc`` ranks: the world's loss sum and
    trained tokens, its gradient norm (``grad_norm``, every rank's checked equal), and every
    module's gradients by global parameter name (DP replicas checked equal), each rank's dtypes
    and fixed parameters; ``save_init``: save the initial weights there first
    (``step_0000000``)."""
    flags = [*(["--save-init", save_init] if save_init else []),
             *(["--host-reads"] if host_reads else []),
             *(["--save-batches"] if save_batches else [])]
    ranks.run(nproc, [PARITY_RUNNER, out, *flags, *overrides], out / "logs").check()
    return merged(out)


def merged(out: Path) -> dict:
    """The ranks' ``rank_R.pt`` of one parity step, merged (see ``step``)."""
    per_rank = [torch.load(path, weights_only=False) for path in sorted(out.glob("rank_*.pt"))]
    balances = {rank.get("moe_aux_loss") for rank in per_rank} - {None}
    assert len(balances) <= 1, balances           # every language rank counts the same
    result = {"loss_sum": per_rank[0]["loss_sum"], "tokens": per_rank[0]["tokens"],
              "flops": per_rank[0]["flops"], "moe_aux_loss": next(iter(balances), None),
              "grad_norm": per_rank[0].get("grad_norm"), "grads": {}, "ranks": per_rank}
    for rank in per_rank:
        assert (rank["loss_sum"], rank["tokens"], rank.get("grad_norm")) == (
            result["loss_sum"], result["tokens"], result["grad_norm"])
        for module, grads in rank["grads"].items():
            for name, grad in grads.items():
                seen = result["grads"].setdefault(module, {}).get(name)
                if seen is not None:        # DP replicas hold the same reduced gradient
                    torch.testing.assert_close(grad, seen, atol=0, rtol=0)
                result["grads"][module][name] = grad
    return result


def compare(reference: dict, other: dict, what: str, tolerance: float = TOLERANCE) -> None:
    """``other``'s step has ``reference``'s trained tokens, loss and every gradient (each
    non-zero in the reference, but for an expert no token was routed to) within
    ``tolerance``: absolute for the loss, and for a gradient
    relative to its largest entry where that is over 1 (fp32 sums in another order differ by
    a few ulp of what they add up: a gradient of entries near 8 by about 2e-5)."""
    assert other["tokens"] == reference["tokens"] > 0, what
    # the step's model FLOPs are the global batch's, whichever ranks count them
    assert other["flops"] == pytest.approx(reference["flops"], rel=1e-12), what
    loss, expected = other["loss_sum"] / other["tokens"], \
        reference["loss_sum"] / reference["tokens"]
    assert abs(loss - expected) <= tolerance, f"{what}: loss {loss} vs {expected}"
    if reference["moe_aux_loss"] is not None:
        assert abs(other["moe_aux_loss"] - reference["moe_aux_loss"]) <= tolerance, \
            f"{what}: load-balancing loss {other['moe_aux_loss']} vs {reference['moe_aux_loss']}"
    assert set(other["grads"]) == set(reference["grads"]), what
    for module, grads in reference["grads"].items():
        assert set(other["grads"][module]) == set(grads), f"{what}: {module} parameters differ"
        for name, grad in grads.items():
            # an expert the router sent no token gets none (then none in ``other`` either)
            assert grad.abs().sum() > 0 or ".local_experts." in name, \
                f"{module}.{name} got no gradient in the reference"
            difference = (other["grads"][module][name] - grad).abs().max().item()
            scale = max(1.0, grad.abs().max().item())
            assert difference <= tolerance * scale, \
                f"{what}: {module}.{name} differs by {difference} (largest entry {scale})"


# --------------------------------------------------------------------------- mimo-train

def train_job(ranks: Ranks, tmp: Path, name: str, config: str, *overrides, nproc: int,
              env: dict | None = None) -> Job:
    """``mimo-train --config configs/train/CONFIG --records TMP/NAME.jsonl OVERRIDES`` on
    ``nproc`` forked ranks (``python -m mimo_train`` on each), whatever its exit status."""
    records = tmp / f"{name}.jsonl"
    records.unlink(missing_ok=True)
    return ranks.run(nproc, ["-m", "mimo_train", "--config", CONFIGS / config, "--records",
                             records, *overrides], tmp / f"{name}-logs", env=env)


def train(ranks: Ranks, tmp: Path, name: str, config: str, *overrides, nproc: int,
          env: dict | None = None) -> list[dict]:
    """``train_job`` that must succeed, its checkpoints' state the same on every rank that
    saves it (megatron-core warns otherwise: rank 0's alone is written); its records."""
    job = train_job(ranks, tmp, name, config, *overrides, nproc=nproc, env=env).check()
    differs = [rank for rank, text in job.ranks.items() if "common state dict differs" in text]
    assert not differs, f"ranks {differs}: {job.explain()}"
    return read_records(tmp / f"{name}.jsonl")


def read_records(path: Path) -> list[dict]:
    """The records file ``path`` read as strict JSON (no ``NaN``, which strict readers refuse);
    [] where there is none."""
    def refuse(constant: str):
        raise ValueError(f"{path} holds {constant}, which is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()] \
        if path.is_file() else []


def train_records(records: list[dict]) -> list[dict]:
    """The step records (not evaluation or anomaly records)."""
    return [r for r in records if "loss" in r]


def copy_checkpoint(source: Path, root: Path) -> Path:
    """A checkpoint.dir whose latest is a copy of the checkpoint ``source``."""
    shutil.copytree(source, root / source.name)
    (root / "latest").write_text(source.name)
    return root


def write_meta(directory: Path, meta: dict) -> None:
    """A saved checkpoint's ``meta.json`` replaced by ``meta``, its digest and size recorded in
    the integrity manifest, as if the run had saved it so."""
    from mimo_data.files import file_sha256
    path = directory / "meta.json"
    path.write_text(json.dumps(meta))
    manifest = json.loads((directory / "integrity.json").read_text())
    manifest["files"]["meta.json"] = file_sha256(str(path))
    manifest["sizes"]["meta.json"] = path.stat().st_size
    (directory / "integrity.json").write_text(json.dumps(manifest))


def assert_continues(resumed: list[dict], full: list[dict], steps: list[int], loss: float,
                     grad_norm_rel: float) -> None:
    """The resumed run's steps are ``steps`` with the uninterrupted run's tokens, its loss
    within ``loss`` and its grad norm within ``grad_norm_rel`` (relative)."""
    assert [r["step"] for r in train_records(resumed)] == steps
    expected = {r["step"]: r for r in train_records(full)}
    for record in train_records(resumed):
        reference = expected[record["step"]]
        assert record["tokens"] == reference["tokens"]
        assert record["loss"] == pytest.approx(reference["loss"], abs=loss)
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=grad_norm_rel)
        # the run's totals go on from the checkpoint's
        totals = ("consumed_samples", "consumed_tokens", "consumed_sequence_tokens")
        assert {k: record[k] for k in totals} == {k: reference[k] for k in totals}, record
