"""``PredictedKLControl``: scale every proposal so its predicted KL fits a budget (algorithm.md §6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from logra_pl.callbacks.contract import require_view, view_of
from logra_pl.callbacks.mismatch import RolloutMismatch
from logra_pl.errors import ConfigError, check_choice, check_int, check_range
from logra_pl.runtime import compat
from logra_pl.runtime.ranks import all_reduce_sum
from logra_pl.sketch.probe import ProbeMode, predicted_kl_terms, realized_kl_terms


@dataclass
class BudgetSchedule:
    """KL budget per update ``n`` (from 1).

    Arguments:
        kind: ``cosine`` (δmax → δmin over ``horizon`` updates, then δmin), ``linear`` (likewise, straight),
            ``constant`` (δmax), or ``none`` (no control: α = 1).
        delta_max: budget at the first update.
        delta_min: budget from update ``horizon`` on.
        horizon: updates of the anneal ``H``.
    """

    kind: Literal["cosine", "linear", "constant", "none"] = "cosine"
    delta_max: float = 2e-4
    delta_min: float = 2e-5
    horizon: int = 300

    def __post_init__(self) -> None:
        check_choice("schedule.kind", self.kind, ("cosine", "linear", "constant", "none"))
        check_range("schedule.delta_max", self.delta_max, 0.0, low_open=True)
        check_range("schedule.delta_min", self.delta_min, 0.0, low_open=True)
        check_int("schedule.horizon", self.horizon, 1)
        if self.delta_min > self.delta_max:
            raise ConfigError(
                f"schedule.delta_min={self.delta_min:g} exceeds schedule.delta_max={self.delta_max:g}: the budget "
                "anneals from delta_max down to delta_min; swap them (or use kind: constant)"
            )

    def progress(self, n: int) -> float:
        """``min((n−1)/(H−1), 1)`` (1 from the start when H = 1)."""
        return 1.0 if self.horizon == 1 else min(max(n - 1, 0) / (self.horizon - 1), 1.0)

    def __call__(self, n: int) -> float | None:
        """The budget of update ``n``; None for ``kind="none"``."""
        if self.kind == "none":
            return None
        if self.kind == "constant":
            return self.delta_max
        prog = self.progress(n)
        if self.kind == "linear":
            return self.delta_max + (self.delta_min - self.delta_max) * prog
        return self.delta_min + 0.5 * (self.delta_max - self.delta_min) * (1.0 + math.cos(math.pi * prog))


def step_multiplier(pred: float, budget: float, alpha_max: float) -> float:
    """``α = min(α_max, sqrt(budget/pred))``; ``pred = 0`` gives 1. A NaN or negative ``pred`` is the caller's error."""
    if pred == 0.0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / pred))


def _full_precision(device: torch.device) -> torch.autocast:
    """Autocast off: the probe's and the calibration's forwards in the policy's own dtype.

    Under ``bf16-mixed`` the optimizer step (where the probe runs) is inside Lightning's autocast and the calibration
    forward (``on_train_batch_end``) is not. bf16 keeps 8 bits of mantissa: on a policy whose logits span a few units,
    as a trained one's do, the rounding swamps a 1e-4 update, and the realized KL of bf16 "before" against fp32 "after"
    logits was 12-48% off α²·pred (≤ 1.9% in fp32; ``tests/models/test_large_model_path.py``). Under FSDP's
    ``param_dtype`` the gathered parameters stay bf16 for both forwards.
    """
    return torch.autocast(device_type=device.type, enabled=False)


def _mean_over_ranks(trainer: Any, terms: torch.Tensor, device: torch.device) -> float:
    """The mean of per-position KL ``terms`` over every rank's positions (0 when no rank has any)."""
    total = torch.tensor([float(terms.sum()), float(terms.numel())], dtype=torch.float64)
    total = all_reduce_sum(trainer, total, device)  # on the device: NCCL has no CPU tensors
    return float(total[0] / total[1]) if float(total[1]) > 0 else 0.0


def _rank_world(trainer: Any) -> tuple[int, int]:
    if trainer is None:
        return 0, 1
    return int(trainer.global_rank), int(trainer.world_size)


def _global_row(local_row: int, n: int, rank: int, world: int) -> int:
    """Index in the step's global batch of a rank's local response row (rank ``r`` holds every ``world``-th prompt)."""
    j, k = divmod(local_row, n)
    return (world * j + rank) * n + k


class PredictedKLControl(pl.Callback):
    """Probe each proposal before it is applied and set its step multiplier α from the predicted KL.

    Works with every update method that makes proposals (:attr:`~logra_pl.methods.UpdateMethod.makes_proposals`):
    LoGRA (``α`` scales the factors ``U``), dense AdamW and LoRA (``α`` scales AdamW's step, i.e. its ``lr`` for this
    update). The probe is the method's :meth:`~logra_pl.methods.UpdateMethod.logit_tangent` of the proposal; the
    budget schedule's position is the method's :attr:`~logra_pl.methods.UpdateMethod.applied_updates` plus one.

    The probe runs on the first ``probe_responses`` responses of the step's global batch — wherever they were
    sampled: the prompt loaders give rank ``r`` every ``world``-th prompt, so global response ``(world·j + r)·n + k``
    is local response ``j·n + k`` of rank ``r`` — on generated-token positions only (at most ``max_probe_tokens``
    per rank), at the sampling temperature. The prediction is thus the same on 1 rank or N (a rank with nothing
    to probe still runs the forward its sharded model needs, on no positions). A NaN or
    negative prediction skips the update (weights untouched) and is counted. With a
    :class:`RolloutMismatch` in the trainer's callbacks the budget is reduced by its EMA; without one, the
    budget is used as is. Callback order does not matter.

    Arguments:
        schedule: the KL budget per update.
        alpha_max: cap on α.
        probe_responses: responses probed per update.
        max_probe_tokens: cap on probed positions.
        probe: ``jvp`` (forward-mode AD with math attention) or ``fd`` (central finite difference).
        fd_step: step of the finite difference, in units of the nominal step.
        calibrate: after the update, measure the realized KL on the probe contexts from full distributions and
            log it as ``kl/realized`` next to ``kl/predicted_scaled``, and the update's first-order gain per unit of
            it, ``kl/gain_per_sqrt_kl`` = ``method.last_gain / sqrt(kl/realized)``, where the method measures its
            gain. With ``schedule.kind="none"`` (no control, α = 1) and ``calibrate``, the probe still runs so that
            the uncontrolled run's predicted and realized KL are logged — KL measurement for any method, weights as
            without the callback (without ``calibrate``, ``none`` costs nothing).
        max_overshoot: the line search (None: off). Before the step is applied, the KL it really takes on the probe
            positions is measured from the logits of the moved policy (:meth:`UpdateMethod.logits_at
            <logra_pl.methods.UpdateMethod.logits_at>`, one forward, weights untouched); while it exceeds
            ``max_overshoot`` × the effective budget, α is rescaled to ``α·sqrt(budget / realized)`` (the α at
            which a locally quadratic KL would meet the budget) and measured again. The quadratic prediction holds
            near α = 0 only: an α that a flat probe inflates can take a step whose KL is hundreds of times its
            budget, and the line search bounds it. The search only ever shrinks α.
        max_backtracks: rescalings the line search tries; a step still above the bound after them is skipped
            (weights untouched, counted in ``kl/skipped_updates``).
        search_responses: responses of the step's batch the line search measures on (the first ones, as the
            probe's; None: the probe's own ``probe_responses``). More than the probe's catch a step that moves the
            policy where the probed responses barely move (a step made mostly of a first moment's history), at one
            more forward over them per update and one per try.
    """

    READS = ("policy", "method", "step_context")  # what it reads of the policy contract (docs/extending.md)

    def __init__(
        self,
        schedule: BudgetSchedule | None = None,
        alpha_max: float = 3.0,
        probe_responses: int = 2,
        max_probe_tokens: int = 4096,
        probe: ProbeMode = "jvp",
        fd_step: float = 1e-3,
        calibrate: bool = False,
        max_overshoot: float | None = None,
        max_backtracks: int = 3,
        search_responses: int | None = None,
    ) -> None:
        check_range("alpha_max", alpha_max, 0.0, low_open=True)
        if max_overshoot is not None:
            check_range("max_overshoot", max_overshoot, 1.0)
        check_int("max_backtracks", max_backtracks, 0)
        if search_responses is not None:
            check_int("search_responses", search_responses, 1)
        check_int("probe_responses", probe_responses, 1)
        check_int("max_probe_tokens", max_probe_tokens, 1)
        check_choice("probe", probe, ("jvp", "fd"))
        check_range("fd_step", fd_step, 0.0, low_open=True)
        self.schedule = schedule or BudgetSchedule()
        self.alpha_max = alpha_max
        self.probe_responses = probe_responses
        self.max_probe_tokens = max_probe_tokens
        self.probe = probe
        self.fd_step = fd_step
        self.calibrate = calibrate
        self.max_overshoot = max_overshoot
        self.max_backtracks = max_backtracks
        self.search_responses = search_responses
        self.updates = 0
        self.skipped = 0
        self.history: list[dict[str, float]] = []
        self._pending: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- probe
    def _probe_inputs(
        self, ctx: Any, device: torch.device, trainer: Any = None, responses: int | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Model inputs of the first ``responses`` (default ``probe_responses``) responses of the global batch and
        the flat indices of their generated positions."""
        responses = self.probe_responses if responses is None else responses
        packed = ctx.packed
        rank, world = _rank_world(trainer)
        n = max(1, len(ctx.rollout) // max(1, len(ctx.items)))  # responses per prompt (rows grouped by prompt)
        rows = [b for b in range(packed.input_ids.shape[0]) if _global_row(b, n, rank, world) < responses]
        probed = bool(rows)
        rows = rows or [0]  # nothing to probe here: run the forward on one row, read no position
        ids = packed.input_ids[rows]
        # The sampled positions of each probed row (a multi-turn row's inserted tokens are not the policy's).
        sampled = [torch.nonzero(packed.response_mask[r]).flatten().tolist() for r in rows] if probed else [[]]
        positions, budget = [], self.max_probe_tokens
        width = ids.shape[1]
        for b, columns in enumerate(sampled):
            take = columns[: max(budget, 0)]
            start = int(packed.starts[rows[b]])
            positions += [b * width + start + j for j in take]
            budget -= len(take)
        inputs = {
            "input_ids": ids.to(device),
            "attention_mask": packed.attention_mask[rows].to(device),
            "position_ids": packed.position_ids[rows].to(device),
        }
        return inputs, torch.tensor(positions, dtype=torch.long, device=device)

    def predict(self, pl_module: Any, proposal: Any, ctx: Any) -> tuple[float, dict[str, Any]]:
        """Mean predicted KL per probed position at α = 1 (averaged over ranks), and what calibration needs."""
        inputs, flat = self._probe_inputs(ctx, pl_module.device, compat.trainer_of(pl_module))
        method = pl_module.method
        with _full_precision(pl_module.device):
            logits, tangent = method.logit_tangent(pl_module.policy, proposal, inputs, self.probe, self.fd_step)
        vocab = logits.shape[-1]
        z = logits.reshape(-1, vocab)[flat]
        t = tangent.reshape(-1, vocab)[flat]
        pred = _mean_over_ranks(pl_module.trainer, predicted_kl_terms(z, t, ctx.temperature), pl_module.device)
        return pred, {"inputs": inputs, "flat": flat, "logits": z.detach(), "temperature": ctx.temperature}

    def realized_at(self, pl_module: Any, proposal: Any, probe: dict[str, Any], alpha: float) -> float:
        """Mean KL per probed position (averaged over ranks) between the policy now and the policy ``proposal``
        at ``alpha`` would make, from full distributions; the weights are left as they are."""
        method = pl_module.method
        try:
            with _full_precision(pl_module.device):
                moved = method.logits_at(pl_module.policy, proposal, probe["inputs"], alpha)
        except NotImplementedError as err:
            raise ConfigError(
                f"PredictedKLControl(max_overshoot=...) measures each step before it is applied, and the update "
                f"method {type(method).__name__} cannot say what its step would do ({err}); implement "
                "UpdateMethod.logits_at, or leave max_overshoot unset"
            ) from err
        after = moved.reshape(-1, moved.shape[-1])[probe["flat"]]
        terms = realized_kl_terms(probe["logits"], after, probe["temperature"])
        return _mean_over_ranks(pl_module.trainer, terms, pl_module.device)

    def search_contexts(self, pl_module: Any, temperature: float) -> dict[str, Any]:
        """The line search's own contexts: the first ``search_responses`` responses of the step's batch, with the
        policy's logits at their generated positions now (before the step)."""
        ctx = view_of(pl_module, self.READS).step_context
        inputs, flat = self._probe_inputs(ctx, pl_module.device, compat.trainer_of(pl_module), self.search_responses)
        with torch.no_grad(), _full_precision(pl_module.device):
            logits = pl_module.policy(**inputs, use_cache=False).logits
        z = logits.reshape(-1, logits.shape[-1])[flat]
        return {"inputs": inputs, "flat": flat, "logits": z, "temperature": temperature}

    def line_search(
        self, pl_module: Any, proposal: Any, probe: dict[str, Any], alpha: float, budget: float
    ) -> tuple[float | None, int, float]:
        """``(α, backtracks, realized)``: the largest tried α whose realized KL on the probe is within
        ``max_overshoot·budget``, starting from ``alpha`` and rescaling by ``sqrt(budget / realized)``; α is None
        when none of ``1 + max_backtracks`` tries is (or a realized KL is not finite)."""
        assert self.max_overshoot is not None
        limit = self.max_overshoot * budget
        if self.search_responses is not None and self.search_responses != self.probe_responses:
            probe = self.search_contexts(pl_module, probe["temperature"])
        realized = self.realized_at(pl_module, proposal, probe, alpha)
        backtracks = 0
        while math.isfinite(realized) and realized > limit and backtracks < self.max_backtracks:
            alpha *= math.sqrt(budget / realized)
            backtracks += 1
            realized = self.realized_at(pl_module, proposal, probe, alpha)
        return (alpha if math.isfinite(realized) and realized <= limit else None), backtracks, realized

    # ------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module without the policy contract, and say before training when the run's update method makes
        no proposals (either way the callback would do nothing)."""
        view = require_view(pl_module, "PredictedKLControl", self.READS)
        method = view.method
        if stage == "fit" and method is not None and not getattr(method, "makes_proposals", False):
            rank_zero_warn(
                f"PredictedKLControl: the update method {getattr(method, 'name', '?')!r} ({type(method).__name__}) "
                "makes no proposals, so no update is controlled or measured; remove the callback, or give the "
                "method a proposal (UpdateMethod.makes_proposals)"
            )

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        proposal = getattr(optimizer, "proposal", None)
        view = view_of(pl_module, self.READS)
        ctx = view.step_context if view is not None else None
        method = view.method if view is not None else None
        if proposal is None or ctx is None or method is None or not getattr(method, "makes_proposals", False):
            return
        self.updates += 1
        # The schedule's position is the index of the update this proposal would become: updates applied so far,
        # plus one. Proposals vetoed here or rejected by the guard do not advance it (the paper's horizons count
        # optimizer updates, D.1).
        budget = self.schedule(method.applied_updates + 1)
        if budget is None:
            if self.calibrate:  # no control (α = 1), but the predicted and realized KL are still measured
                self._measure_uncontrolled(pl_module, proposal, ctx)
            return
        mismatch = next((cb for cb in trainer.callbacks if isinstance(cb, RolloutMismatch)), None)
        if mismatch is not None:
            mismatch.observe(ctx, trainer)  # idempotent: the same m whichever callback runs first
        effective = budget if mismatch is None else mismatch.effective_budget(budget)
        pred, probe = self.predict(pl_module, proposal, ctx)
        bs = len(ctx.rollout)
        log = {"kl/predicted": pred, "kl/budget": budget, "kl/effective_budget": effective}
        if not math.isfinite(pred) or pred < 0:
            self.skipped += 1
            proposal.skip(f"predicted KL is {pred}: update skipped by PredictedKLControl")
            rank_zero_warn(f"update {self.updates}: predicted KL {pred} — skipping the update, weights untouched")
            log["kl/skipped_updates"] = float(self.skipped)
            pl_module.log_dict(log, on_step=True, batch_size=bs)
            self._pending = None
            ctx.update_kls.append(0.0)  # skipped: the weights did not move
            return
        alpha: float | None = step_multiplier(pred, effective, self.alpha_max)
        measured = None
        if self.max_overshoot is not None and pred > 0:
            alpha, backtracks, measured = self.line_search(pl_module, proposal, probe, alpha, effective)
            log.update({"kl/backtracks": float(backtracks), "kl/line_search_realized": measured})
            if alpha is None:
                self.skipped += 1
                reason = (
                    f"the step's KL, measured before the merge, stayed at {measured:.3g} > {self.max_overshoot:g} × "
                    f"budget {effective:.3g} after {backtracks} backtracks: update skipped by PredictedKLControl"
                )
                proposal.skip(reason)
                rank_zero_warn(f"update {self.updates}: {reason}; weights untouched")
                log["kl/skipped_updates"] = float(self.skipped)
                pl_module.log_dict(log, on_step=True, batch_size=bs)
                self._pending = None
                ctx.update_kls.append(0.0)
                return
        proposal.alpha = alpha
        log.update(
            {"kl/alpha": alpha, "kl/predicted_scaled": alpha * alpha * pred, "kl/skipped_updates": float(self.skipped)}
        )
        pl_module.log_dict(log, on_step=True, batch_size=bs)
        proposal.priced_kl = alpha * alpha * pred if measured is None else measured
        ctx.update_kls.append(proposal.priced_kl)
        self._record(proposal, probe, pred, alpha, effective)
        if measured is not None:
            self.history[-1].update(backtracks=float(backtracks), line_search_realized=measured)

    def _measure_uncontrolled(self, pl_module: Any, proposal: Any, ctx: Any) -> None:
        """``kind="none"`` with ``calibrate``: probe the proposal at its nominal size (α stays 1) and queue the
        realized-KL measurement, so an uncontrolled run reports the KL it takes (the "no control" ablation)."""
        pred, probe = self.predict(pl_module, proposal, ctx)
        log = {"kl/predicted": pred, "kl/predicted_scaled": pred, "kl/alpha": proposal.alpha}
        pl_module.log_dict(log, on_step=True, batch_size=len(ctx.rollout))
        if not math.isfinite(pred) or pred < 0:
            self._pending = None  # nothing to calibrate against; the guard judges the update as usual
            ctx.update_kls.append(math.nan)  # not priced: a KL bound cannot judge this update
            return
        proposal.priced_kl = proposal.alpha * proposal.alpha * pred
        ctx.update_kls.append(proposal.priced_kl)
        self._record(proposal, probe, pred, proposal.alpha, float("nan"))

    def _record(self, proposal: Any, probe: dict[str, Any], pred: float, alpha: float, budget: float) -> None:
        """Append the update to ``history`` and, with ``calibrate``, queue its realized-KL measurement (after the
        update, in ``on_train_batch_end``). ``budget`` is NaN for an uncontrolled update."""
        if self.calibrate:
            self._pending = {**probe, "predicted_scaled": alpha * alpha * pred, "proposal": proposal, "budget": budget}
        else:
            self._pending = None
        self.history.append({"predicted": pred, "alpha": alpha, "effective_budget": budget})

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Calibration: the realized KL of the applied update on the same probe positions."""
        pending, self._pending = self._pending, None
        view = view_of(pl_module, self.READS)
        if pending is None or view is None or not view.method.applied(pending["proposal"]):
            return  # not the step's last update, or not applied (rejected by the guard, skipped): nothing changed
        with torch.no_grad(), _full_precision(pl_module.device):
            after = pl_module.policy(**pending["inputs"], use_cache=False).logits
        after = after.reshape(-1, after.shape[-1])[pending["flat"]]
        realized = _mean_over_ranks(
            trainer, realized_kl_terms(pending["logits"], after, pending["temperature"]), pl_module.device
        )
        pl_module.log("kl/realized", realized, on_step=True, batch_size=1)
        gain = view.method.last_gain
        if gain is not None and realized > 0:  # the direction's worth: first-order gain per unit of policy change
            pl_module.log("kl/gain_per_sqrt_kl", gain / math.sqrt(realized), on_step=True, batch_size=1)
        ctx = view.step_context
        if ctx is not None and ctx.update_kls:
            ctx.update_kls[-1] = realized  # measured beats predicted
        if self.history:
            self.history[-1]["realized"] = realized
            self.history[-1]["predicted_scaled"] = pending["predicted_scaled"]

    def calibration(self) -> dict[str, float]:
        """Over calibrated updates: median ``|realized − α²·pred| / realized`` and mean realized / mean budget.

        An update predicted to move nothing (``α²·pred = 0``: a zero proposal, e.g. a minibatch whose every sequence
        GSPO's clip stopped) is left out: its realized KL is floating-point noise, not a calibration error."""
        rows = [h for h in self.history if "realized" in h and h["realized"] > 0 and h["predicted_scaled"] > 0]
        if not rows:
            return {}
        errors = sorted(abs(h["realized"] - h["predicted_scaled"]) / h["realized"] for h in rows)
        mid = len(errors) // 2
        median = errors[mid] if len(errors) % 2 else 0.5 * (errors[mid - 1] + errors[mid])
        mean_realized = sum(h["realized"] for h in rows) / len(rows)
        mean_budget = sum(h["effective_budget"] for h in rows) / len(rows)
        return {
            "updates": float(len(rows)),
            "median_rel_error": median,
            "mean_realized": mean_realized,
            "mean_effective_budget": mean_budget,
            "realized_over_budget": mean_realized / mean_budget,
        }

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cal = self.calibration()
        if cal:
            against = (
                f" vs mean effective budget {cal['mean_effective_budget']:.3g} ({cal['realized_over_budget']:.2f}x)"
                if math.isfinite(cal["mean_effective_budget"])
                else " (no budget: schedule kind none, α = 1)"
            )
            rank_zero_info(
                f"KL calibration over {int(cal['updates'])} updates: median |realized − α²·pred|/realized "
                f"{cal['median_rel_error']:.2%}; mean realized KL {cal['mean_realized']:.3g}{against}"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        """Budget position, skip count, and the per-update record the calibration summary is computed from."""
        return {"updates": self.updates, "skipped": self.skipped, "history": [dict(h) for h in self.history]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = int(state_dict["updates"])
        self.skipped = int(state_dict["skipped"])
        self.history = [dict(h) for h in state_dict.get("history", [])]
