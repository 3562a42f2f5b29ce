"""PredictedKLControl's line search in real Trainer runs: ``logits_at`` against a policy whose weights the test moves
itself, the realized KL of every step held within ``max_overshoot`` × budget when the probe underestimates it, and a
step that stays too large skipped with the weights untouched."""

from __future__ import annotations

import copy
import math
import tempfile
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import BudgetSchedule, PredictedKLControl
from logra_pl.errors import ConfigError
from logra_pl.methods import DenseAdamW, LoRAMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.methods.lora import LoRAConfig
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig
from tests.conftest import chain_sum_data, quick_trainer

# Budgets that keep each method's α well inside its quadratic region (test_kl_control_dense.py says why LoRA's is
# smaller), so that a correct α lands within the line search's bound.
BUDGETS = {"logra": 1e-4, "adamw": 1e-4, "lora": 4e-6}


def _method(kind: str):
    if kind == "logra":
        return None
    adamw = AdamWConfig(lr=1e-3, warmup_steps=0)
    return DenseAdamW(adamw) if kind == "adamw" else LoRAMethod(LoRAConfig(rank=4, alpha=8.0), adamw)


def _run(callbacks, kind: str, steps: int = 3):
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny",
        method=_method(kind),
        logra=LoGRAConfig(rank=16, update_ratio=1e-2) if kind == "logra" else None,
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
    )
    trainer = quick_trainer(Path(tempfile.gettempdir()), steps, callbacks)  # writes nothing: no logger, checkpoints
    trainer.fit(module, datamodule=chain_sum_data(train_size=64, eval_size=8))
    return module, trainer


class FlatProbe(PredictedKLControl):
    """A probe that sees 1% of the change a step makes, as two probed responses on a flat stretch of the policy can:
    α comes out 10× too large, and the step's KL about 100× its budget."""

    def predict(self, pl_module, proposal, ctx):
        pred, probe = super().predict(pl_module, proposal, ctx)
        return pred / 100.0, probe


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(12).expand(2, 12).contiguous(),
    }


class MovedByHand(pl.Callback):
    """At the first proposal: the method's ``logits_at`` against the logits of a copy of the policy whose weights
    are moved here, from the proposal's own tensors (LoGRA: ``W − α U P``; dense: ``θ + α Δθ``)."""

    alpha = 2.5

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != 0:
            return
        proposal, policy, method = optimizer.proposal, pl_module.policy, pl_module.method
        inputs = _inputs(policy.config.vocab_size)
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        self.got = method.logits_at(policy, proposal, inputs, self.alpha)
        self.untouched = all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
        moved = copy.deepcopy(policy)
        with torch.no_grad():
            if hasattr(proposal, "matrices"):
                for name, m in proposal.matrices.items():
                    w = moved.get_submodule(name).weight
                    w -= self.alpha * (m.factor.double() @ m.projection.double()).to(w.dtype)
            else:
                names = {id(p): n for n, p in policy.named_parameters()}
                params = dict(moved.named_parameters())
                for p, delta in proposal.deltas().items():
                    params[names[id(p)]] += self.alpha * delta.to(p.dtype)
            self.want = moved(**inputs, use_cache=False).logits
            self.unmoved = policy(**inputs, use_cache=False).logits


@pytest.mark.parametrize("kind", ["logra", "adamw", "lora"])
def test_logits_at_is_the_moved_policy(kind: str) -> None:
    probe = MovedByHand()
    _run([probe], kind, steps=1)
    assert probe.untouched
    change = (probe.want - probe.unmoved).abs().max()
    assert change > 1e-4  # the step moves the logits: the comparison below can fail
    assert (probe.got - probe.want).abs().max() < 1e-3 * change


@pytest.mark.parametrize("kind", ["logra", "adamw", "lora"])
def test_line_search_bounds_the_kl_a_flat_probe_underestimates(kind: str) -> None:
    """Without the search every step's realized KL is far above its budget; with it every step lands within
    ``max_overshoot`` × budget, measured again after the merge by the calibration (an independent forward)."""
    budget = BUDGETS[kind]
    schedule = BudgetSchedule("constant", delta_max=budget, delta_min=budget)
    blind = FlatProbe(schedule, alpha_max=1000.0, calibrate=True)
    _run([blind], kind)
    assert all(h["realized"] > 20 * budget for h in blind.history), [h["realized"] for h in blind.history]

    searched = FlatProbe(schedule, alpha_max=1000.0, calibrate=True, max_overshoot=1.5)
    module, trainer = _run([searched], kind)
    assert module.method.applied_updates == 3 and searched.skipped == 0
    for h in searched.history:
        assert h["backtracks"] >= 1
        assert h["line_search_realized"] <= 1.5 * budget
        assert h["realized"] == pytest.approx(h["line_search_realized"], rel=0.05)
        assert h["alpha"] < math.sqrt(budget / h["predicted"])  # only ever shrinks
    for name in ("kl/backtracks", "kl/line_search_realized"):
        assert name in trainer.logged_metrics, name


def test_a_step_the_search_cannot_bound_is_skipped() -> None:
    """``max_backtracks: 0``: a step above the bound is skipped and counted; no weight changes."""
    kl = FlatProbe(BudgetSchedule("constant", delta_max=1e-4), alpha_max=1000.0, max_overshoot=1.5, max_backtracks=0)

    class Start(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.weights = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

    start = Start()
    module, trainer = _run([kl, start], "logra")
    assert kl.skipped == 3 and module.method.applied_updates == 0 and kl.history == []
    after = module.policy.state_dict()
    assert len(start.weights) == len(after) and all(torch.equal(v, after[k]) for k, v in start.weights.items())
    assert trainer.logged_metrics["kl/skipped_updates"] == 3


def test_settings_and_a_method_without_logits_at() -> None:
    with pytest.raises(ValueError, match="max_overshoot"):
        PredictedKLControl(max_overshoot=0.5)
    with pytest.raises(ValueError, match="max_backtracks"):
        PredictedKLControl(max_backtracks=-1)

    class NoMoves:
        def logits_at(self, *args):
            raise NotImplementedError("OwnMethod makes no proposals to measure")

    module = types.SimpleNamespace(method=NoMoves(), policy=None, device=torch.device("cpu"), trainer=None)
    with pytest.raises(ConfigError, match=r"NoMoves cannot say what its step would do.*UpdateMethod\.logits_at"):
        PredictedKLControl(max_overshoot=2.0).realized_at(module, None, {"inputs": {}}, 1.0)


def test_a_search_that_never_backtracks_changes_nothing() -> None:
    """Where every step's KL is within the bound, the search's forwards change no bit of the run: the weights after
    three updates equal a run without it (the grid's line-search methods equal their plain rule on SmolLM2, where no
    update of any method realized more than 1.4x its prediction)."""
    schedule = BudgetSchedule("constant", delta_max=1e-4)
    searched = PredictedKLControl(schedule, max_overshoot=2.0)
    module, _ = _run([searched], "logra")
    plain, _ = _run([PredictedKLControl(schedule)], "logra")
    assert [h["backtracks"] for h in searched.history] == [0.0] * 3
    assert all(h["line_search_realized"] <= 2.0 * 1e-4 for h in searched.history)
    a, b = module.policy.state_dict(), plain.policy.state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.items())


def test_the_search_can_measure_on_more_responses_than_the_probe() -> None:
    """``search_responses``: the search measures the step on the batch's first responses (here all 8), every
    generated position of them, and holds the KL there within the bound."""

    class Contexts(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                self.positions = int(pl_module.step_context.packed.response_mask.sum())

    schedule = BudgetSchedule("constant", delta_max=1e-4)
    kl = FlatProbe(schedule, alpha_max=1000.0, max_overshoot=1.5, search_responses=8)
    seen = Contexts()
    original = kl.search_contexts
    sizes = []

    def counted(pl_module, temperature):
        contexts = original(pl_module, temperature)
        sizes.append(int(contexts["flat"].numel()))
        return contexts

    kl.search_contexts = counted
    module, _ = _run([kl, seen], "logra")
    assert module.method.applied_updates == 3 and len(sizes) == 3
    assert sizes[0] == seen.positions > 0
    assert all(h["backtracks"] >= 1 and h["line_search_realized"] <= 1.5e-4 for h in kl.history)
    with pytest.raises(ValueError, match="search_responses"):
        PredictedKLControl(search_responses=0)
