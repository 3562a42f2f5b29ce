"""SketchDiagnostics under a real Trainer: exact against the test's own gradient and projection, random-matrix theory,
logging and heatmap, and a run that trains bit-identically to one without it."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from logra_pl.callbacks import SketchDiagnostics
from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import ConfigError
from logra_pl.models import load_policy
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig, make_projection, projection_seed, sketch_fidelity
from logra_pl.strategy import LoGRAStrategy

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
RANK = 16
UPDATES = 3
SNAPSHOT_AT = 2  # the update whose pre-merge weights the exactness test rebuilds


class Snapshot(pl.Callback):
    """Copies the policy's weights and the sketcher's update index just before update ``at`` merges."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.weights: dict[str, torch.Tensor] = {}
        self.update_index = -1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if pl_module.method.sketcher.update_index + 1 == self.at:
            self.weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
            self.update_index = pl_module.method.sketcher.update_index


def _run(callbacks, root, logger=False, optimizer: str = "logra", steps: int = UPDATES, **logra):
    pl.seed_everything(0)
    module = LoGRAPolicyModule(
        policy="tiny",
        optimizer=optimizer,
        logra=LoGRAConfig.paper(rank=RANK, update_ratio=1e-2, **logra),  # refreshed: each update its own projection
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,  # the 16 probe responses take two microbatches
    )
    data = ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL}}, train_size=64, eval_size=8, prompts_per_step=16, eval_batch_size=8
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data)
    return module, trainer


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    """3 updates, measured at 1 and 2 (a heatmap at each), with the weights just before update 2 merged."""
    root = tmp_path_factory.mktemp("diag")
    diag = SketchDiagnostics(every_n_updates=2, at_first_update=True, probe_responses=16, image_every=2)
    snap = Snapshot(SNAPSHOT_AT)
    logger = TensorBoardLogger(root, name="diag")
    module, trainer = _run([snap, diag], root, logger=logger)
    return module, trainer, diag, snap, logger


def _own_fidelity(grad: torch.Tensor, proj: torch.Tensor) -> tuple[float, float]:
    """cos(G, G Pᵀ P) with the product formed, and ‖G Π‖/‖G‖ with Π = Pᵀ(PPᵀ)⁻¹P the projector on P's rows."""
    g, p = grad.double(), proj.double()
    recon = g @ p.T @ p
    cosine = float((g * recon).sum() / (g.norm() * recon.norm()))
    projector = p.T @ torch.linalg.solve(p @ p.T, p)
    return cosine, float((g @ projector).norm() / g.norm())


def test_logged_values_equal_the_tests_own_gradient_and_projection(diagnosed) -> None:
    _, _, diag, snap, _ = diagnosed
    assert snap.update_index == SNAPSHOT_AT - 1 and diag.last_update == SNAPSHOT_AT
    probe = diag.probe
    assert probe["input_ids"].shape[0] == 16 and probe["update"] == 1  # captured at the first update
    # The model as it was before update 2 merged, rebuilt from scratch (no sketch hooks), plain autograd.
    model, _ = load_policy("tiny")
    model.load_state_dict(snap.weights)
    model.eval().requires_grad_(False)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        weight = model.get_submodule(name).weight
        weight.requires_grad_(True)
        logits = model(
            input_ids=probe["input_ids"],
            attention_mask=probe["attention_mask"],
            position_ids=probe["position_ids"],
            use_cache=False,
        ).logits
        # REINFORCE+TIS written out: -Σ A·min(π/π_rollout, 2)·log π over response tokens / their count (T = 1).
        mask, targets = probe["response_mask"], probe["targets"]
        rows = torch.arange(targets.shape[0]).unsqueeze(1)
        cols = (probe["starts"].unsqueeze(1) + torch.arange(targets.shape[1])).clamp(max=logits.shape[1] - 1)
        logp = torch.log_softmax(logits[rows, cols].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp.detach() - probe["logp_rollout"]).clamp(max=2.0)
        loss = -(probe["advantages"].float().unsqueeze(1) * ratio * logp * mask).sum() / mask.sum()
        (grad,) = torch.autograd.grad(loss, weight)
        weight.requires_grad_(False)
        assert grad.norm() > 0
        seed = projection_seed(0, SNAPSHOT_AT - 1, name)  # base seed 0, refreshed: the update's own index
        proj = make_projection(seed, RANK, weight.shape[1], "rademacher")
        cosine, energy = _own_fidelity(grad, proj)
        key = f"{name.split('.')[2]}.{name.rsplit('.', 1)[1]}"
        assert diag.last[f"logra/recon_cosine/{key}"] == pytest.approx(cosine, rel=1e-4)
        assert diag.last[f"logra/captured_energy/{key}"] == pytest.approx(energy, rel=1e-4)
        assert sketch_fidelity(grad, proj) == pytest.approx((cosine, energy), rel=1e-6)
    per_matrix = [v for k, v in diag.last.items() if k.startswith("logra/recon_cosine/")]
    assert len(per_matrix) == 14  # 2 layers × 7 kinds
    assert diag.last["logra/recon_cosine"] == pytest.approx(sum(per_matrix) / 14)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_random_gradient_matches_theory(distribution: str) -> None:
    """Gaussian G (64 × 128): energy ≈ sqrt(r/d_in); cosine ≈ sqrt(r/(d_in + r)), ≈ sqrt(r/d_in) only for r ≪ d_in."""
    d_out, d_in, draws = 64, 128, 8
    for r in (4, 16, 64):
        cosines, energies = [], []
        for k in range(draws):
            grad = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(100 + k))
            fid = sketch_fidelity(grad, make_projection(projection_seed(k, r, "m"), r, d_in, distribution))
            cosines.append(fid.recon_cosine)
            energies.append(fid.captured_energy)
        cosine, energy = sum(cosines) / draws, sum(energies) / draws
        assert energy == pytest.approx(math.sqrt(r / d_in), rel=0.1), r
        assert cosine == pytest.approx(math.sqrt(r / (d_in + r)), rel=0.1), r
        if r <= 16:
            assert cosine == pytest.approx(math.sqrt(r / d_in), rel=0.1), r
        else:  # r = d_in/2: the two formulas are 18% apart, and the measurement sides with sqrt(r/(d_in + r))
            assert abs(cosine - math.sqrt(r / d_in)) > 0.1 * math.sqrt(r / d_in)
    assert all(math.isnan(v) for v in sketch_fidelity(torch.zeros(3, 8), make_projection(0, 2, 8)))


def test_run_logs_draws_and_trains_bit_identically(diagnosed, tmp_path) -> None:
    module, trainer, diag, _, logger = diagnosed
    assert [h["update"] for h in diag.history] == [1.0, 2.0]
    for h in diag.history:
        assert 0 < h["logra/recon_cosine"] <= 1 and 0 < h["logra/captured_energy"] <= 1
    assert all(0 < v <= 1 for v in diag.last.values())
    assert set(trainer.logged_metrics) >= {"train/reward_mean", "guard/relative_update"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    # One point per measurement (updates 1, 2), at the steps of those updates' own scalars; none at update 3.
    steps = [e.step for e in events.Scalars("train/reward_mean")]
    assert steps == list(range(UPDATES))
    measured = [steps[0], steps[1]]
    assert [e.step for e in events.Images("logra/recon_cosine_heatmap")] == measured
    for name in ("logra/recon_cosine", "logra/captured_energy", "logra/recon_cosine/1.down_proj"):
        assert [e.step for e in events.Scalars(name)] == measured, name
    assert [e.value for e in events.Scalars("logra/recon_cosine")] == pytest.approx(
        [h["logra/recon_cosine"] for h in diag.history], rel=1e-6
    )
    assert "logra/captured_energy/1.down_proj" not in events.Tags()["scalars"]  # kept in `last`, not logged
    assert diag.png()[:8] == b"\x89PNG\r\n\x1a\n"

    plain, _ = _run([], tmp_path)
    a, b = module.policy.state_dict(), plain.policy.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert module.method.sketcher.update_index == plain.method.sketcher.update_index == UPDATES
    for name, stats in module.method.sketcher.row_stats.items():
        assert torch.equal(stats, plain.method.sketcher.row_stats[name])
    for name, m in module.method.sketcher.matrices.items():
        assert torch.equal(m.sketch, plain.method.sketcher.matrices[name].sketch)

    # A measurement by hand leaves everything as it found it: weights, sketches, hooks, flags, .grad, the RNG.
    rng, weights = torch.get_rng_state(), {k: v.clone() for k, v in module.policy.state_dict().items()}
    values = diag.measure(module)
    assert len(values) == 14 and all(0 < v.recon_cosine <= 1 and 0 < v.captured_energy <= 1 for v in values.values())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(v, weights[k]) for k, v in module.policy.state_dict().items())
    for m in module.method.sketcher.matrices.values():
        assert m.handle is not None and m.handle.id in m.module._forward_hooks
        assert not m.module.weight.requires_grad and m.module.weight.grad is None
        assert not m.sketch.any()  # zeroed after the last update, and still zero

    # The probe batch travels in the callback's checkpoint state.
    resumed = SketchDiagnostics()
    resumed.load_state_dict(diag.state_dict())
    assert all(torch.equal(resumed.probe[k], v) for k, v in diag.probe.items() if isinstance(v, torch.Tensor))
    assert resumed.history == diag.history


def test_dense_runs_warn_once_and_fsdp_is_refused(tmp_path) -> None:
    diag = SketchDiagnostics(every_n_updates=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, trainer = _run([diag], tmp_path, optimizer="adamw", steps=1)
    said = [w for w in caught if "SketchDiagnostics measures LoGRA sketches" in str(w.message)]
    assert len(said) == 1 and "'adamw'" in str(said[0].message)
    assert diag.probe is None and not diag.last and not diag.history
    assert "train/reward_mean" in trainer.logged_metrics

    fsdp = pl.Trainer(accelerator="cpu", devices=1, strategy=LoGRAStrategy(), logger=False)
    with pytest.raises(ConfigError, match="SketchDiagnostics needs each matrix's whole dense gradient"):
        SketchDiagnostics().setup(fsdp, LoGRAPolicyModule(policy="tiny"), "fit")
    for bad in ({"every_n_updates": 0}, {"probe_responses": 0}, {"image_every": -1}):
        with pytest.raises(ConfigError):
            SketchDiagnostics(**bad)


def test_outputs_side_is_measured_on_the_transposed_gradient(tmp_path) -> None:
    """``logra.sketch_side: outputs`` sketches ``Gᵀ Rᵀ``: its fidelity is that of ``Gᵀ`` under ``R`` (``r × d_out``,
    drawn here from the update's seed), on the dense gradient of the probe at the run's last weights."""
    from logra_pl.callbacks.diagnostics import dense_gradients

    diag = SketchDiagnostics(every_n_updates=1, at_first_update=True, probe_responses=16, image_every=0)
    module, trainer = _run([diag], tmp_path, steps=1, sketch_side="outputs")
    sketcher = module.method.sketcher
    measured = diag.measure(module, trainer)
    grads = dense_gradients(trainer, module, diag.probe)
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.down_proj"):
        m = sketcher.matrices[name]
        proj = make_projection(projection_seed(0, sketcher.update_index, name), RANK, m.d_out, "rademacher")
        assert m.d_out != m.d_in and tuple(SketchDiagnostics.projection(sketcher, name).shape) == (RANK, m.d_out)
        want = sketch_fidelity(grads[name].mT, proj)
        assert tuple(measured[name]) == pytest.approx(tuple(want), rel=1e-6), name
