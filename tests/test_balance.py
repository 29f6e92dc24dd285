"""Token balance (``data.balance: tokens``): each step keeps exactly its samples, every module's
DP ranks get near-equal tokens, resume at a step boundary is exact, and a mid-step state of
another arrangement is refused.

Imbalance is measured here from the costs and the positions alone: a module with DP size d
gives DP rank r the contiguous part r of d of every global micro-batch."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import preprocess_config_file
from mimo_data.inspect.cli import main as inspect_main
from mimo_data.loading.balance import Arrangement, arrange
from mimo_data.loading.loader import DataSource, LoaderError, build_loader

LAYOUTS = {   # name: (modules as (name, dp, cost columns), global micro-batch)
    "language dp4, image dp2": ((("language", 4, (0,)), ("image", 2, (1,)),
                                 ("audio", 1, (2,))), 16),
    "language dp4 only": ((("language", 4, (0,)), ("image", 1, (1,))), 16),
    "image dp4 into language dp1": ((("language", 1, (0,)), ("image", 4, (1,))), 16),
    "language dp2, image dp4, audio dp2": ((("language", 2, (0,)), ("image", 4, (1,)),
                                            ("audio", 2, (2,))), 16),
}


def synthetic_costs(steps: int = 200, batch: int = 64) -> np.ndarray:
    """Varied SFT-like costs: text 20-1000 tokens, 0-3 images of 50-400 tokens, audio on 40%."""
    rng = np.random.default_rng(0)
    costs = np.zeros((steps, batch, 3), np.int64)
    costs[:, :, 0] = rng.integers(20, 1000, (steps, batch))
    costs[:, :, 1] = rng.integers(0, 4, (steps, batch)) * rng.integers(50, 400, (steps, batch))
    costs[:, :, 2] = (rng.random((steps, batch)) < 0.4) * rng.integers(10, 200, (steps, batch))
    return costs


def rank_loads(costs: np.ndarray, order: np.ndarray, column: int, dp: int,
               group: int) -> np.ndarray:
    """``[steps, dp]`` tokens of ``column`` per DP rank when positions hold ``order``."""
    steps, batch, _ = costs.shape
    placed = np.take_along_axis(costs[:, :, column], order, axis=1)
    return placed.reshape(steps, batch // group, dp, group // dp).sum(axis=(1, 3))


def max_over_mean(loads: np.ndarray) -> np.ndarray:
    return loads.max(axis=1) / loads.mean(axis=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_step_keeps_its_samples_and_every_module_is_balanced(name):
    modules, group = LAYOUTS[name]
    costs = synthetic_costs()
    order = arrange(costs, Arrangement(group, modules))
    steps, batch, _ = costs.shape
    assert (np.sort(order, axis=1) == np.arange(batch)).all()      # a permutation per step
    plain = np.broadcast_to(np.arange(batch), (steps, batch))
    for module, dp, (column,) in modules:
        if dp == 1:
            continue
        before = max_over_mean(rank_loads(costs, plain, column, dp, group))
        after = max_over_mean(rank_loads(costs, order, column, dp, group))
        assert before.mean() > 1.05, module                       # there is something to fix
        assert after.mean() <= 1.01 and after.max() <= 1.05, (module, after.max())


def test_nothing_to_balance_keeps_the_order():
    costs = synthetic_costs(steps=3, batch=16)
    order = arrange(costs, Arrangement(8, (("language", 1, (0,)), ("image", 1, (1,)))))
    assert (order == np.arange(16)).all()


def test_a_step_without_one_modalitys_tokens_still_balances_the_others():
    """Text-only steps of a mixed dataset (no image or audio tokens in the step): the
    language ranks are still balanced there, as in the steps with media."""
    modules, group = LAYOUTS["language dp4, image dp2"]
    costs = synthetic_costs(steps=20)
    costs[::2, :, 1:] = 0
    order = arrange(costs, Arrangement(group, modules))
    after = max_over_mean(rank_loads(costs, order, 0, 4, group))
    assert after.max() <= 1.05, after.round(3)


def test_a_steps_longest_samples_fill_its_first_micro_batches():
    """Balanced, a step's samples go longest first: each global micro-batch holds samples no
    shorter than the next one's (unpadded micro-batches of similar lengths pad less)."""
    modules, group = LAYOUTS["language dp4 only"]
    costs = synthetic_costs(steps=20)
    order = arrange(costs, Arrangement(group, modules))
    tokens = np.take_along_axis(costs[:, :, 0], order, axis=1).reshape(20, -1, group)
    assert (tokens.min(axis=2)[:, :-1] >= tokens.max(axis=2)[:, 1:]).all()


@pytest.fixture(scope="module")
def source(loader_corpus, tmp_path_factory):
    return DataSource(str(loader_corpus), preprocess_config_file(
        tmp_path_factory.mktemp("balance") / "p.yaml"))


LAYOUT = "language=dp2;image=dp1;audio=dp1"


def stream(source, balance: str, rank: int = 0, state=None, stop_at_step=None):
    """``[(step, keys, tokens)]`` per micro-batch of ``rank`` (a language rank), and the
    loader state, stopped before ``stop_at_step`` when given."""
    loader = build_loader(source, None, LAYOUT, rank, 4, 8, 2, seed=3, balance=balance,
                          state=state)
    out = []
    for _, meta in loader:
        out.append((meta["step"], meta["keys"], sum(meta["tokens"])))
        if meta["step"] + 1 == stop_at_step and \
                meta["micro_batch"] + 1 == loader.micro_batches_per_step:
            break
    return out, loader.state_dict()


def per_step(micro_batches) -> dict[int, tuple[list, int]]:
    """step -> (its keys, its tokens) on one rank."""
    steps: dict[int, tuple[list, int]] = {}
    for step, keys, tokens in micro_batches:
        held, total = steps.get(step, ([], 0))
        steps[step] = (held + keys, total + tokens)
    return steps


def test_the_loader_keeps_each_steps_samples_and_balances_the_language_ranks(source):
    ranks = {balance: [per_step(stream(source, balance, rank)[0]) for rank in (0, 1)]
             for balance in ("none", "tokens")}
    for balance, (first, second) in ranks.items():
        assert first.keys() == second.keys(), balance
    samples = {balance: {s: sorted(first[s][0] + second[s][0]) for s in first}
               for balance, (first, second) in ranks.items()}
    assert samples["tokens"] == samples["none"]           # each step holds the same samples
    assert ranks["tokens"][0] != ranks["none"][0]         # arranged otherwise within the step

    def imbalance(first, second) -> float:
        loads = np.array([[first[s][1], second[s][1]] for s in sorted(first)], np.float64)
        return float(max_over_mean(loads).mean())
    assert imbalance(*ranks["tokens"]) < imbalance(*ranks["none"])


def test_resume_at_a_step_boundary_is_exact_and_a_mid_step_state_of_another_arrangement_is_refused(
        source):
    whole, _ = stream(source, "tokens")
    first, state = stream(source, "tokens", stop_at_step=2)
    assert (state["step"], state["micro_batch"]) == (2, 0)
    rest, _ = stream(source, "tokens", state=state)
    assert first + rest == whole
    loader = build_loader(source, None, LAYOUT, 0, 4, 8, 2, seed=3)
    next(iter(loader))                                      # one micro-batch into step 0
    with pytest.raises(LoaderError, match="inside a step arranged as 'none'"):
        build_loader(source, None, LAYOUT, 0, 4, 8, 2, seed=3, balance="tokens",
                     state=loader.state_dict())


def test_a_mid_step_state_is_refused_where_other_token_counts_order_that_step_otherwise(
        source, tmp_path):
    """Smaller images keep the same samples (the same fingerprint) with fewer image tokens, so
    a balanced step's places move: resuming inside that step would repeat some of its samples
    and skip others. The state says which samples the step's consumed part holds."""
    import yaml

    data = yaml.safe_load(preprocess_config_file(tmp_path / "a.yaml").read_text())
    data["modalities"]["image"]["max_pixels"] = 50176             # 64 tokens, not 256
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    other = DataSource(source.directories, tmp_path / "b.yaml")
    assert other.fingerprint == source.fingerprint
    layout = "language=dp1;image=dp2;audio=dp1"
    firsts = [next(iter(build_loader(data, None, layout, 0, 4, 16, 4, seed=1,
                                     balance="tokens")))[1]["keys"] for data in (source, other)]
    assert sorted(firsts[0]) != sorted(firsts[1])           # step 0's first micro-batch moves
    loader = build_loader(source, None, layout, 1, 4, 16, 4, seed=1, balance="tokens")
    next(iter(loader))                                      # one micro-batch into step 0
    state = loader.state_dict()
    build_loader(source, None, layout, 1, 4, 16, 4, seed=1, balance="tokens", state=state)
    with pytest.raises(LoaderError, match="which this loader orders otherwise"):
        build_loader(other, None, layout, 1, 4, 16, 4, seed=1, balance="tokens", state=state)
    # at a step boundary each step keeps its samples whatever their places: resumed
    for _, meta in loader:
        if meta["micro_batch"] + 1 == loader.micro_batches_per_step:
            break
    build_loader(other, None, layout, 1, 4, 16, 4, seed=1, balance="tokens",
                 state=loader.state_dict())


def test_inspect_plan_shows_the_imbalance_with_and_without(loader_corpus, tmp_path, capsys):
    config = preprocess_config_file(tmp_path / "p.yaml")
    code = inspect_main(["plan", str(loader_corpus), "--config", str(config), "--layout",
                         LAYOUT, "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--balance", "tokens"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines()
             if line.strip().startswith("balance ") and " language " in line]
    assert [line.split()[1] for line in lines] == ["tokens", "none"]   # this plan's first
    tokens_mean, none_mean = (float(line.split("mean ")[1].split(",")[0]) for line in lines)
    assert tokens_mean < none_mean
