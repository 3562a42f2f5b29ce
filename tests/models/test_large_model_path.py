"""The training path for large models in one process: bf16 compute over fp32 master weights, activation
checkpointing, token-budget microbatching and the attention kernel setting — each on real Trainer runs."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from logra_pl.callbacks import BudgetSchedule, PredictedKLControl
from logra_pl.models.load import load_policy
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.runtime.checkpointing import checkpointed_layers, decoder_layers
from logra_pl.runtime.ranks import Ranks
from logra_pl.sketch import LoGRAConfig
from logra_pl.train.logprobs import pack_responses
from logra_pl.train.passes import TrainerPasses


class CountLayerForwards(pl.Callback):
    """Decoder-layer forward calls made with grad enabled: loss forwards, and checkpoint replays in backward."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def count(*_: object) -> None:
            if torch.is_grad_enabled():
                self.calls += 1

        for layer in decoder_layers(pl_module.policy):
            layer.register_forward_pre_hook(count)  # a pre-hook: a replay stops early, before post-hooks


@pytest.fixture
def fit(rl_run):
    """``fit(root, steps=3, callbacks=(), precision=None, **module_args)``: a tiny LoGRA run, seeded."""

    def run(tmp: Path, steps: int = 3, callbacks=(), precision: str | None = None, **module_args):
        return _fit(rl_run, tmp, steps, callbacks, precision, **module_args)

    return run


def _fit(rl_run, tmp: Path, steps: int, callbacks, precision: str | None, **module_args) -> LoGRAPolicyModule:
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        **{
            "policy": "tiny",
            "logra": LoGRAConfig(rank=16, update_ratio=1e-2),
            "rollout": RolloutSettings(max_new_tokens=6),
            "microbatch_size": 4,
            **module_args,
        }
    )
    overrides = {"precision": precision} if precision else {}
    rl_run(module, tmp, steps, callbacks, **overrides)
    return module


def _weights(module: LoGRAPolicyModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def test_activation_checkpointing_in_one_process(fit, tmp_path: Path) -> None:
    plain_count, ac_count = CountLayerForwards(), CountLayerForwards()
    plain = fit(tmp_path / "plain", callbacks=[plain_count])
    ac = fit(tmp_path / "ac", callbacks=[ac_count], activation_checkpointing=True)
    assert len(checkpointed_layers(ac.policy)) == len(decoder_layers(ac.policy)) == 2
    assert not checkpointed_layers(plain.policy)
    # Recomputed in backward: two grad-enabled forwards per layer and microbatch instead of one (eval mode!).
    assert ac_count.calls == 2 * plain_count.calls > 0
    # ... and nothing else changes: same state-dict keys, bit-identical weights after 3 updates.
    a, b = _weights(plain), _weights(ac)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dense_adamw_with_activation_checkpointing_keeps_its_engine_in_sync(fit, tmp_path: Path) -> None:
    """Dense AdamW sends its trained tensors to the engine by name. Activation checkpointing puts
    ``_checkpoint_wrapped_module.`` into the policy's parameter names (the HF engine's private copy, made before the
    wrapping, has none): the first sync stopped the run with a KeyError. The engine now holds the trainer's weights."""
    module = fit(tmp_path, steps=2, optimizer="adamw", activation_checkpointing=True)
    assert checkpointed_layers(module.policy)
    assert any("_checkpoint_wrapped_module" in n for n, _ in module.policy.named_parameters())
    trained = module.method.trained_tensors(module.policy)
    engine = dict(module.engine.model.named_parameters())
    assert len(trained) == 14 and set(trained) <= set(engine)
    before = load_policy("tiny")[0].state_dict()
    assert all(not torch.equal(trained[n], before[n]) for n in trained)  # two AdamW steps moved each matrix
    assert all(torch.equal(trained[n], engine[n]) for n in trained)


def test_token_budget_microbatches(fit, tmp_path: Path) -> None:
    passes = TrainerPasses(load_policy("tiny")[0], microbatch_size=8, max_tokens=40, ranks=Ranks())
    prompts = [[1] * n for n in (5, 5, 30, 6, 6, 6, 6, 6, 6, 6)]
    packed = pack_responses(prompts, [[2, 3]] * len(prompts), 0)
    groups, padding = passes.microbatches(list(range(len(prompts))), packed)
    assert padding == 0  # one process: no padding microbatches
    assert [r for g in groups for r in g] == list(range(len(prompts)))  # consecutive, every row once
    lengths = packed.attention_mask.sum(dim=1).tolist()
    for g in groups:
        assert len(g) <= 8
        assert len(g) == 1 or len(g) * max(lengths[r] for r in g) <= 40
    assert groups == [[0, 1], [2], [3, 4, 5, 6, 7], [8, 9]]  # lengths 7, 7, 32, then 8s: 5 × 8 = 40 fits
    # A run under a budget trains like one without (the same rows, in other groupings and narrower batches).
    plain = fit(tmp_path / "plain")
    budget = fit(tmp_path / "budget", max_tokens_per_microbatch=64)
    a, b = _weights(plain), _weights(budget)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
def test_bf16_mixed_keeps_fp32_master_and_sketches(fit, tmp_path: Path, operands: str) -> None:
    """bf16-mixed with activation checkpointing, with the sketch's matmuls on fp32 operands (the default) or bf16
    ones (``logra.sketch_operands``, the GPU's tensor cores): fp32 master weights and sketches, every target moved,
    the KL controller's prediction still within 10%."""
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4), calibrate=True)
    logra = LoGRAConfig(rank=16, update_ratio=1e-2, sketch_operands=operands)
    module = fit(tmp_path / "bf16", callbacks=[kl], precision="bf16-mixed", activation_checkpointing=True, logra=logra)
    assert module.method.sketcher.num_applied == 3
    signs = {m.signs is not None for m in module.method.sketcher.matrices.values()}
    assert signs == {operands == "bfloat16"}
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}  # master weights
    assert {s.dtype for s in module.method.sketcher.sketches().values()} == {torch.float32}
    before, after = load_policy("tiny")[0].state_dict(), _weights(module)
    moved = [k for k in after if k.endswith("proj.weight") and not torch.equal(before[k], after[k])]
    assert len(moved) == 14 and all(bool(torch.isfinite(after[k]).all()) for k in after)
    # The KL controller still predicts what happens: measured over 6 updates of this setup, |realized − α²·pred| /
    # realized stayed ≤ 2.4% in bf16-mixed (≤ 2.2% in fp32). 10% leaves CPU-to-CPU room.
    for h in kl.history:
        assert h["realized"] > 0
        assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.1


def test_bf16_mixed_kl_probe_and_calibration_run_in_fp32(fit, tmp_path: Path) -> None:
    """On a policy whose logits span several units, as a trained one's do, bf16 rounds each logit by ~0.03: enough to
    swamp a 1e-4 update. The KL probe (inside Lightning's autocast, in the optimizer step) and the calibration forward
    (after the step, outside it) both run with autocast off, so under bf16-mixed the realized KL matches α²·pred as in
    fp32 (measured: ≤ 1.9%). Before, the probe's logits were bf16 and the calibration's fp32: 12%, 48% and 29% off."""
    from logra_pl.runs.export import save_policy_folder

    model, tokenizer = load_policy("tiny")
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)  # the final RMSNorm's gain scales every logit: a peaked policy
    policy = save_policy_folder(model, tokenizer, tmp_path / "peaked")
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 40).reshape(1, -1)).logits
    assert float(logits.std()) > 1.0
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-4), calibrate=True)
    fit(tmp_path / "bf16", callbacks=[kl], precision="bf16-mixed", policy=str(policy))
    assert len(kl.history) == 3
    for h in kl.history:
        assert h["realized"] > 0
        assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.05


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_attention_kernel_is_a_setting(fit, tmp_path: Path, kernel: str) -> None:
    module = fit(tmp_path, steps=1, attn_implementation=kernel)
    assert module.policy.config._attn_implementation == kernel
    assert module.method.sketcher.num_applied == 1
