"""Asynchronous rollouts (``rollout.max_staleness``) in real Trainer runs with the HF engine's private copy: every
response sampled by the weights its version names (rebuilt in the test), the stale-KL rule, exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from logra_pl.callbacks import PolicySync, PredictedKLControl
from logra_pl.errors import ConfigError
from logra_pl.models.load import load_policy
from logra_pl.module import LoGRAPolicyModule
from logra_pl.sketch import LoGRAConfig
from logra_pl.train.settings import RolloutSettings
from tests.conftest import chain_sum_data, quick_trainer

BATCHES_PER_EPOCH = 4  # train_size 32 / prompts_per_step 8: epoch ends inside the runs below


def _module(k: int, max_stale_kl: float | None = None, **rollout) -> LoGRAPolicyModule:
    settings = RolloutSettings(max_new_tokens=5, max_staleness=k, max_stale_kl=max_stale_kl, **rollout)
    return LoGRAPolicyModule(
        policy="tiny", logra=LoGRAConfig(rank=16, update_ratio=1e-2), rollout=settings, microbatch_size=4
    )


def _data():
    return chain_sum_data(train_size=8 * BATCHES_PER_EPOCH, prompts_per_step=8)


class Record(pl.Callback):
    """Per batch: the trainer's weights before its update (= that version), then what the step trained on."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.weights[len(self.steps)] = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ctx = pl_module.step_context
        self.steps.append(
            {
                "staleness": ctx.staleness,
                "kls": list(ctx.update_kls),
                "rollout": ctx.rollout,
                "dropped": ctx.metrics.get("async/dropped"),
                "reward": float(ctx.rewards.mean()),
            }
        )


def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response | prompt) per token at temperature 1 by one plain forward (no cache, no padding)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def test_each_response_is_sampled_by_the_weights_of_its_version(tmp_path: Path) -> None:
    k, steps = 2, 6
    record = Record()
    quick_trainer(tmp_path, steps, [record]).fit(_module(k), datamodule=_data())
    reference, _ = load_policy("tiny")
    for b, step in enumerate(record.steps):
        start = b - b % BATCHES_PER_EPOCH
        assert step["staleness"] == min(b - start, k), b  # the schedule: version max(epoch start, b - k)
        reference.load_state_dict(record.weights[b - step["staleness"]])
        rollout = step["rollout"]
        for prompt, response, logp in zip(rollout.prompt_ids, rollout.response_ids, rollout.logprobs, strict=True):
            expected = _logprobs(reference, prompt, response)
            assert torch.allclose(torch.tensor(logp, dtype=torch.float64), expected, atol=2e-5), b
        if step["staleness"]:  # and not by the trainer's current weights (the check can tell them apart)
            reference.load_state_dict(record.weights[b])
            pairs = zip(rollout.prompt_ids, rollout.response_ids, strict=True)
            now = torch.cat([_logprobs(reference, p, r) for p, r in pairs])
            sampled = torch.tensor([x for row in rollout.logprobs for x in row], dtype=torch.float64)
            assert not torch.allclose(sampled, now, atol=2e-5)
    assert {s["staleness"] for s in record.steps} == {0, 1, 2}


def test_max_stale_kl_drops_exactly_the_batches_whose_summed_kl_exceeds_it(tmp_path: Path) -> None:
    # PredictedKLControl's default budget prices each update at ~2e-4 here: a batch one update stale (KL ~2e-4)
    # stays, two updates stale (~4e-4) goes — judged below on the KLs this very run recorded.
    k, delta, steps = 2, 3e-4, 7
    record = Record()
    trainer = quick_trainer(tmp_path, steps, [PredictedKLControl(calibrate=True), record])
    trainer.fit(_module(k, delta), datamodule=_data())
    kl = [math.fsum(s["kls"]) for s in record.steps]
    drops = 0
    for b, step in enumerate(record.steps):
        start = b - b % BATCHES_PER_EPOCH
        version = max(start, b - k)
        if math.fsum(kl[version:b]) > delta:  # the test's own sum over the updates since the batch's version
            drops += 1
            assert step["staleness"] == 0, b  # dropped, sampled again by the current weights
        else:
            assert step["staleness"] == b - version, b
        assert step["dropped"] == drops, b
    assert drops >= 1 and any(s["staleness"] == 1 for s in record.steps)  # both outcomes occurred


def test_resume_with_rollouts_in_flight_continues_bit_for_bit(tmp_path: Path) -> None:
    steps = 6

    def run(root: Path, max_steps: int, ckpt: str | None = None, save: bool = False):
        record, callbacks = Record(), []
        if save:
            callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_last=False))
        module = _module(1)
        trainer = quick_trainer(root, max_steps, [*callbacks, record], enable_checkpointing=save)
        trainer.fit(module, datamodule=_data(), ckpt_path=ckpt, weights_only=False if ckpt else None)
        return module, record

    straight, ref = run(tmp_path / "a", steps)
    run(tmp_path / "b", 2, save=True)
    ckpt = next((tmp_path / "b").glob("*step=2*.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["logra_pl"]["async"]
    # After batch 1: batch 2 (requested after batch 0) and batch 3 (after batch 1, in flight then), both finished.
    assert {int(b): e["version"] for b, e in saved["rollouts"].items()} == {2: 1, 3: 2}
    resumed, rest = run(tmp_path / "b", steps, ckpt=str(ckpt))  # through the epoch's end (batch 4 starts one)
    assert [s["staleness"] for s in rest.steps] == [1, 1, 0, 1]
    for a, b in zip(ref.steps[2:], rest.steps, strict=True):
        assert a["rollout"].response_ids == b["rollout"].response_ids and a["staleness"] == b["staleness"]
        assert a["reward"] == b["reward"]
    for (name, x), y in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_policy_sync_ships_and_verifies_through_the_pipeline(tmp_path: Path) -> None:
    """PolicySync with ``max_staleness: 1``: every update reaches the engine in order (a verification after each
    one finds the engine on the trainer's weights), and every update's bytes are logged once."""
    sync, record = PolicySync(mode="factors", verify_every=1, tolerance=1e-4), Record()

    class Checks(pl.Callback):
        def __init__(self) -> None:
            self.diffs: list[float] = []
            self.logged, self.sent = 0.0, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.diffs.append(sync.last_diff)
            self.logged += pl_module.step_context.metrics["sync/payload_bytes"]
            self.sent.append(sum(len(p.to_bytes()) for p in pl_module.step_context.payloads))

    checks = Checks()
    quick_trainer(tmp_path, 5, [sync, checks, record]).fit(_module(1), datamodule=_data())
    assert len(checks.diffs) == 5 and max(checks.diffs) <= 1e-4 and sync.full_resyncs == 0
    assert [s["staleness"] for s in record.steps] == [0, 1, 1, 1, 0]
    # Update t's ship is logged at update t + 1 (the verification after update t waited for it); the last one
    # at the end, or not at all when the worker had not applied it yet at update 5's log.
    assert checks.logged in (sum(checks.sent[:4]), sum(checks.sent)) and min(checks.sent) > 0


def test_settings_the_pipeline_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_staleness is 0"):
        RolloutSettings(max_stale_kl=1e-3)
    with pytest.raises(ConfigError, match="share_weights"):
        quick_trainer(tmp_path, 1).fit(_module(1, share_weights=True), datamodule=_data())
    with pytest.raises(ConfigError, match="needs each update's KL"):
        quick_trainer(tmp_path, 1).fit(_module(1, 1e-3), datamodule=_data())


def test_staleness_zero_is_the_synchronous_path(tmp_path: Path) -> None:
    """With ``max_staleness: 0`` no pipeline starts: each step samples inline with the weights it trains."""

    class Inline(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[object, int]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen.append((pl_module.sampler.pipeline, pl_module.step_context.staleness))

    inline = Inline()
    module = _module(0)
    quick_trainer(tmp_path, 1, callbacks=[inline]).fit(module, datamodule=_data())
    assert module.rollout_settings.max_staleness == 0 and inline.seen == [(None, 0)]
