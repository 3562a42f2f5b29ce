"""NextBatchGain in real Trainer runs: each update's gain on the next update's loss, checked against the gradients
and weights recorded here (dense AdamW), logged beside its ratio to the step's own in-batch gain (LoGRA from its
sketches); a method that cannot keep its step is refused, or skipped with a warning when not required."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import chain_sum_data

from logra_pl.callbacks import NextBatchGain
from logra_pl.errors import ConfigError
from logra_pl.methods import DenseAdamW
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig


class Record(pl.Callback):
    """Per training step: the trained tensors before it, their gradients as the update sees them, the logged
    next-batch metrics and the method's in-batch gain."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.logged: list[dict[str, float]] = []
        self.gains: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        params = pl_module.policy.named_parameters()
        self.weights.append({n: p.detach().double().clone() for n, p in params if p.requires_grad})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = pl_module.policy.named_parameters()
        self.grads.append({n: p.grad.double().clone() for n, p in params if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        keys = ("train/next_batch_gain", "train/next_batch_retention")
        self.logged.append({k: float(metrics[k]) for k in keys if k in metrics})
        self.gains.append(pl_module.method.last_gain)


def _fit(tmp_path, rl_run, method=None, logra=None, steps: int = 3, callback=None):
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny", method=method, logra=logra, rollout=RolloutSettings(max_new_tokens=6), microbatch_size=8
    )
    record = Record()
    rl_run(module, tmp_path, steps, callbacks=[callback or NextBatchGain(), record], data=chain_sum_data())
    return record


def test_dense_next_batch_gain_is_the_step_against_the_next_gradient(tmp_path, rl_run) -> None:
    """AdamW in a Trainer: the gain logged at update t+1 is ``−⟨g', W_{t+1} − W_t⟩`` with ``g'`` the gradient update
    t+1 stepped from and the weights recorded here; the retention is that over update t's own gain."""
    rec = _fit(tmp_path, rl_run, method=DenseAdamW(AdamWConfig(lr=1e-3, warmup_steps=0)))
    assert "train/next_batch_gain" not in rec.logged[0]
    for t in (1, 2):
        step = {n: rec.weights[t][n] - rec.weights[t - 1][n] for n in rec.grads[t]}
        want = -sum(float((rec.grads[t][n] * step[n]).sum()) for n in step)
        assert want != 0 and rec.logged[t]["train/next_batch_gain"] == pytest.approx(want, rel=1e-4)
        ratio = rec.logged[t]["train/next_batch_retention"]
        assert ratio == pytest.approx(rec.logged[t]["train/next_batch_gain"] / rec.gains[t - 1], rel=1e-6)


def test_logra_logs_its_sketched_measure(tmp_path, rl_run) -> None:
    """LoGRA on a fixed basis: measured from the second update on, the retention against the earlier update's gain."""
    rec = _fit(tmp_path, rl_run, logra=LoGRAConfig(rank=16, refresh_every=0))
    assert rec.logged[0] == {}
    for t in (1, 2):
        gain = rec.logged[t]["train/next_batch_gain"]
        assert gain != 0 and rec.logged[t]["train/next_batch_retention"] == pytest.approx(gain / rec.gains[t - 1])


def test_a_method_that_cannot_keep_its_step(tmp_path, rl_run) -> None:
    """A basis drawn every update: refused by default, warned about and not logged when not required."""
    logra = LoGRAConfig(rank=16, refresh_every=1)
    with pytest.raises(ConfigError, match="refresh_every"):
        _fit(tmp_path, rl_run, logra=logra, steps=1)
    with pytest.warns(UserWarning, match="nothing is logged"):
        rec = _fit(tmp_path, rl_run, logra=logra, steps=2, callback=NextBatchGain(required=False))
    assert rec.logged == [{}, {}]
