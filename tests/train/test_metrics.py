"""pass@k metrics: estimator vs enumeration, PassAtK / MacroPassAt1 vs direct sums, gloo sync, Lightning."""

from __future__ import annotations

import itertools
import math
import os
import socket
from fractions import Fraction
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from logra_pl.train.metrics import MacroPassAt1, PassAtK, pass_at_k

TASKS = ("chain_sum", "basic_arithmetic", "leg_counting")


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n responses (the first c correct) that hold at least one correct response."""
    hits = total = 0
    for subset in itertools.combinations(range(n), k):
        total += 1
        hits += any(i < c for i in subset)
    return Fraction(hits, total)


def random_correct(seed: int, problems: int, n: int, p: float = 0.4) -> torch.Tensor:
    """A reproducible (problems, n) bool matrix, with per-problem difficulty so that c covers 0 … n."""
    gen = torch.Generator().manual_seed(seed)
    difficulty = torch.rand(problems, 1, generator=gen) * 2 * p
    return torch.rand(problems, n, generator=gen) < difficulty


def direct_pass_at(correct: torch.Tensor, j: int) -> float:
    """Mean over problems of the scalar estimator."""
    n = correct.shape[1]
    return sum(pass_at_k(n, int(c), j) for c in correct.sum(dim=1)) / correct.shape[0]


# ------------------------------------------------------------------------------------------------ pass_at_k
def test_pass_at_k_equals_enumeration_of_subsets() -> None:
    cases = 0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = brute_force(n, c, k)
                assert expected == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # the closed form itself
                assert abs(pass_at_k(n, c, k) - float(expected)) <= 1e-12, (n, c, k)
                cases += 1
    assert cases == sum(n * (n + 1) for n in range(1, 9))


def test_pass_at_k_edges_are_exact() -> None:
    assert pass_at_k(8, 0, 3) == 0.0
    assert pass_at_k(8, 6, 3) == 1.0  # n − c = 2 < k: every 3-subset holds a correct response
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)  # pass@1 = c / n


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1000, 100) has 140 digits: the product form must not overflow or lose the small miss probability.
    for n, c, k in [(1000, 500, 100), (1000, 3, 10), (1000, 999, 1), (400, 1, 399), (1000, 900, 50)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15), (n, c, k)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 5, 1, "0 <= c <= n"),
        (4, -1, 1, "0 <= c <= n"),
        (4, 2, 0, "1 <= k <= n"),
        (4, 2, 5, "1 <= k <= n"),
        (0, 0, 1, "1 <= k <= n"),
    ],
)
def test_pass_at_k_rejects_out_of_range(n: int, c: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_integers() -> None:
    with pytest.raises(TypeError):
        pass_at_k(4.0, 2, 1)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------- PassAtK
def test_pass_at_k_metric_over_several_updates_equals_direct_computation() -> None:
    n, ks = 8, (1, 2, 4, 8)
    metric = PassAtK(ks=ks, samples=n)
    batches = [random_correct(seed, problems, n) for seed, problems in [(0, 5), (1, 17), (2, 1), (3, 9)]]
    # all correct, none correct, and n − c = 1 < j (exact 1.0 for every j ≥ 2)
    batches.append(torch.tensor([[1] * 8, [0] * 8, [1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool))
    for batch in batches:
        metric.update(batch)
    result = metric.compute()
    everything = torch.cat(batches)
    assert set(result) == {"pass@1", "pass@2", "pass@4", "pass@8"}
    assert all(v.ndim == 0 for v in result.values())
    counts = everything.sum(dim=1)
    assert 0 in counts and n in counts and ((counts > 0) & (counts < n)).any()  # the data exercises every branch
    assert result["pass@1"].item() == pytest.approx(everything.float().mean().item(), abs=1e-7)
    # with the same n for every problem, mean correctness equals the estimator at j = 1
    assert direct_pass_at(everything, 1) == pytest.approx(everything.double().mean().item(), abs=1e-12)
    for j in ks:
        assert result[f"pass@{j}"].item() == pytest.approx(direct_pass_at(everything, j), abs=1e-6), j
    values = [result[f"pass@{j}"].item() for j in ks]
    assert values == sorted(values) and values[0] < values[-1]  # pass@j grows with j


def test_pass_at_k_metric_accepts_bool_int_and_float_and_resets() -> None:
    correct = random_correct(7, 12, 4)
    results = []
    for matrix in (correct, correct.long(), correct.float()):
        metric = PassAtK(ks=(2, 4))
        metric.update(matrix)
        results.append({key: v.item() for key, v in metric.compute().items()})
    assert results[0] == results[1] == results[2]
    assert set(results[0]) == {"pass@1", "pass@2", "pass@4"}  # pass@1 is always reported
    metric.reset()
    metric.update(torch.ones(3, 4, dtype=torch.bool))
    assert {key: v.item() for key, v in metric.compute().items()} == {"pass@1": 1.0, "pass@2": 1.0, "pass@4": 1.0}


def test_pass_at_k_metric_refuses_bad_settings_and_inputs() -> None:
    with pytest.raises(ValueError, match=r"val_responses=4 is smaller than the requested pass@8"):
        PassAtK(ks=(1, 8), samples=4)
    with pytest.raises(ValueError, match="positive"):
        PassAtK(ks=(0, 2))
    with pytest.raises(ValueError, match="unique"):
        PassAtK(ks=(2, 2))
    unsized = PassAtK(ks=(1, 4))
    with pytest.raises(ValueError, match=r"val_responses=2 is smaller than the requested pass@4"):
        unsized.update(torch.ones(3, 2))
    metric = PassAtK(ks=(1, 2))
    metric.update(torch.ones(3, 4))
    with pytest.raises(ValueError, match="n must be the same for every update"):
        metric.update(torch.ones(3, 5))
    fixed = PassAtK(ks=(1, 2), samples=4)
    with pytest.raises(ValueError, match="n must be the same for every update"):
        fixed.update(torch.ones(3, 3))
    with pytest.raises(ValueError, match="only 0 and 1"):
        fixed.update(torch.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="only 0 and 1"):
        fixed.update(torch.full((2, 4), 2))
    with pytest.raises(ValueError, match=r"shape \(problems, responses\)"):
        fixed.update(torch.ones(4))
    assert metric.compute()["pass@1"].item() == 1.0  # refused updates left the sums alone


# --------------------------------------------------------------------------------------------- MacroPassAt1
def test_macro_pass_at_1_equals_direct_per_task_and_macro_means() -> None:
    metric = MacroPassAt1(TASKS)
    rows: dict[str, list[torch.Tensor]] = {task: [] for task in TASKS}
    gen = torch.Generator().manual_seed(3)
    for seed, problems in [(10, 6), (11, 9), (12, 4)]:
        correct = random_correct(seed, problems, 4)
        # only chain_sum and leg_counting appear, with unequal counts, so macro ≠ micro
        names = [TASKS[0] if torch.rand(1, generator=gen).item() < 0.7 else TASKS[2] for _ in range(problems)]
        metric.update(correct, names)
        for row, name in zip(correct, names, strict=True):
            rows[name].append(row)
    result = metric.compute()
    assert set(result) == {"chain_sum/pass@1", "leg_counting/pass@1", "macro_pass@1"}  # no samples: no key
    task_means = {task: torch.stack(r).double().mean().item() for task, r in rows.items() if r}
    for task, mean in task_means.items():
        assert result[f"{task}/pass@1"].item() == pytest.approx(mean, abs=1e-7)
    macro = sum(task_means.values()) / len(task_means)
    micro = torch.stack(rows[TASKS[0]] + rows[TASKS[2]]).double().mean().item()
    assert result["macro_pass@1"].item() == pytest.approx(macro, abs=1e-7)
    assert abs(macro - micro) > 1e-3  # the test would notice a micro average


def test_macro_pass_at_1_refuses_unknown_tasks_and_mismatched_rows() -> None:
    metric = MacroPassAt1(TASKS)
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['spell_backward'\]"):
        metric.update(torch.ones(2, 3), ["chain_sum", "spell_backward"])
    with pytest.raises(ValueError, match="one name per row"):
        metric.update(torch.ones(2, 3), ["chain_sum"])
    with pytest.raises(ValueError, match="unique"):
        MacroPassAt1(["a", "a"])
    with pytest.raises(ValueError, match="at least one task"):
        MacroPassAt1([])
    metric.update(torch.tensor([[1, 0, 0]]), ["leg_counting"])
    result = metric.compute()
    assert set(result) == {"leg_counting/pass@1", "macro_pass@1"}  # the refused updates added nothing
    assert result["macro_pass@1"].item() == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------------------- data parallelism
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sync_problems() -> tuple[torch.Tensor, list[str]]:
    correct = random_correct(21, 30, 6)
    names = [TASKS[i % 3] if i < 20 else TASKS[1] for i in range(30)]  # rank 1's half is mostly one task
    return correct, names


def _sync_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: update with this rank's half (in two uneven batches), compute, save the result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        correct, names = _sync_problems()
        half = slice(0, 11) if rank == 0 else slice(11, 30)  # unequal shares: sums, not means of means
        mine, my_names = correct[half], names[half]
        pass_k, macro = PassAtK(ks=(1, 2, 3, 6), samples=6), MacroPassAt1(TASKS)
        for part in (slice(0, 4), slice(4, None)):
            pass_k.update(mine[part])
            macro.update(mine[part], my_names[part])
        result = {**pass_k.compute(), **macro.compute()}
        torch.save({key: v.item() for key, v in result.items()}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path: Path) -> None:
    mp.spawn(_sync_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    correct, names = _sync_problems()
    pass_k, macro = PassAtK(ks=(1, 2, 3, 6), samples=6), MacroPassAt1(TASKS)
    pass_k.update(correct)
    macro.update(correct, names)
    single = {key: v.item() for key, v in {**pass_k.compute(), **macro.compute()}.items()}
    assert len(single) == 4 + 3 + 1
    for rank in (0, 1):
        synced = torch.load(tmp_path / f"rank{rank}.pt")
        assert synced.keys() == single.keys()
        for key, value in single.items():
            assert synced[key] == pytest.approx(value, abs=1e-7), (rank, key)
    # a rank's own half alone differs: the equality above came from the sync
    local = PassAtK(ks=(1, 2, 3, 6), samples=6)
    local.update(correct[:11])
    assert abs(local.compute()["pass@2"].item() - single["pass@2"]) > 1e-3


# ---------------------------------------------------------------------------------------------- Lightning
class _Validator(pl.LightningModule):
    """Validation only: each batch is (correct, task indices); the metrics are logged with ``log_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.pass_k = PassAtK(ks=(1, 2, 4), samples=4)
        self.macro = MacroPassAt1(TASKS)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        correct, task_ids = batch
        self.pass_k.update(correct)
        self.macro.update(correct, [TASKS[i] for i in task_ids.tolist()])

    def on_validation_epoch_end(self) -> None:
        self.log_dict({f"val/{key}": v for key, v in self.pass_k.compute().items()})
        self.log_dict({f"val/{key}": v for key, v in self.macro.compute().items()})
        self.pass_k.reset()
        self.macro.reset()


def test_metrics_log_through_lightning(tmp_path: Path) -> None:
    correct = random_correct(5, 24, 4)
    task_ids = torch.arange(24) % 3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(correct, task_ids), batch_size=5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    metrics = trainer.validate(_Validator(), dataloaders=loader, verbose=False)[0]
    assert metrics["val/pass@1"] == pytest.approx(correct.float().mean().item(), abs=1e-6)
    assert metrics["val/pass@2"] == pytest.approx(direct_pass_at(correct, 2), abs=1e-6)
    assert metrics["val/pass@4"] == pytest.approx(direct_pass_at(correct, 4), abs=1e-6)
    means = [correct[task_ids == i].float().mean().item() for i in range(3)]
    for task, mean in zip(TASKS, means, strict=True):
        assert metrics[f"val/{task}/pass@1"] == pytest.approx(mean, abs=1e-6)
    assert metrics["val/macro_pass@1"] == pytest.approx(sum(means) / 3, abs=1e-6)


def test_macro_mean_weights_tasks_equally_with_partial_credit() -> None:
    from logra_pl.train.metrics import MacroMean

    metric = MacroMean(["a", "b", "c"])
    metric.update(torch.tensor([[0.5, 1.0], [0.0, 0.25]]), ["a", "a"])
    metric.update(torch.tensor([[1.0, 1.0]]), ["b"])
    out = metric.compute()
    assert out["a/reward"] == pytest.approx(1.75 / 4) and out["b/reward"] == pytest.approx(1.0)
    assert "c/reward" not in out  # no samples: not part of the macro mean
    assert out["macro_reward"] == pytest.approx((1.75 / 4 + 1.0) / 2)  # not the pooled mean 3.75 / 6
    with pytest.raises(ValueError, match="unknown task"):
        metric.update(torch.ones(1, 2), ["d"])
