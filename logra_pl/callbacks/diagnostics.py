"""``SketchDiagnostics``: how much of the true gradient LoGRA's rank-r sketches keep (paper D.3, algorithm.md §11).

Every ``every_n_updates`` updates (and at update 1 with ``at_first_update``) the callback takes one extra forward and
backward pass over a fixed probe batch with the sketch hooks removed, which gives the dense gradient ``G``
(d_out × d_in) of every selected matrix. With the projection ``P`` (r × d_in) that the sketcher uses for the same
update, :func:`~logra_pl.sketch.diagnostics.sketch_fidelity` turns each ``(G, P)`` into ``recon_cosine`` =
``cos(G, G Pᵀ P)`` and ``captured_energy`` = ``‖G Q‖ / ‖G‖`` (``Q``: an orthonormal basis of ``P``'s rows).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_pl.callbacks.contract import require_view
from logra_pl.errors import ConfigError, check_int
from logra_pl.losses import UpdateTotals
from logra_pl.runtime import compat
from logra_pl.sketch.diagnostics import SketchFidelity, sketch_fidelity
from logra_pl.sketch.projection import make_projection
from logra_pl.train.backward import microbatch_loss
from logra_pl.train.logprobs import PackedResponses, response_logprobs

PROBE_FORMAT = "logra-pl/sketch-diagnostics/v1"
_PACKED_FIELDS = ("input_ids", "attention_mask", "position_ids", "targets", "response_mask", "starts")


def layer_and_kind(name: str) -> tuple[str, str]:
    """``("3", "q_proj")`` for ``model.layers.3.self_attn.q_proj``: the first all-digit part and the last part.

    A name without a numeric part keeps everything before its last part as the "layer".
    """
    parts = name.split(".")
    layer = next((p for p in parts[:-1] if p.isdigit()), ".".join(parts[:-1]))
    return layer, parts[-1]


def short_names(names: Iterable[str]) -> dict[str, str]:
    """``{canonical name: "<layer>.<kind>"}``, or the canonical names themselves if the short ones collide."""
    names = list(names)
    short = {n: ".".join(layer_and_kind(n)) for n in names}
    return short if len(set(short.values())) == len(names) else {n: n for n in names}


def capture_probe(ctx: Any, responses: int) -> dict[str, Any]:
    """The probe batch: the first ``responses`` rows of a step's rollout, with what the loss needs (CPU tensors).

    Arguments:
        ctx: the module's :class:`~logra_pl.module.StepContext` (packed rows, advantages, rollout log-probs).
        responses: how many responses to keep (fewer if the rollout has fewer).
    """
    k = min(responses, len(ctx.rollout))
    packed = ctx.packed
    width = max(int(packed.attention_mask[:k].sum(dim=1).max()), 1)
    r_width = max(int(packed.extents[:k].max()), 1)
    return {
        "format": PROBE_FORMAT,
        "update": int(ctx.update_index) + 1,
        "input_ids": packed.input_ids[:k, :width].detach().cpu().clone(),
        "attention_mask": packed.attention_mask[:k, :width].detach().cpu().clone(),
        "position_ids": packed.position_ids[:k, :width].detach().cpu().clone(),
        "targets": packed.targets[:k, :r_width].detach().cpu().clone(),
        "response_mask": packed.response_mask[:k, :r_width].detach().cpu().clone(),
        "starts": packed.starts[:k].detach().cpu().clone(),
        "advantages": ctx.advantages[:k].detach().cpu().clone(),
        "logp_rollout": ctx.logp_rollout[:k, :r_width].detach().cpu().clone(),
        "temperature": float(ctx.temperature),
    }


def probe_packed(probe: dict[str, Any]) -> PackedResponses:
    """The probe batch's rows as :class:`~logra_pl.train.logprobs.PackedResponses`."""
    return PackedResponses(*(probe[f] for f in _PACKED_FIELDS))


@contextlib.contextmanager
def _sketch_hooks_removed(sketcher: Any) -> Iterator[None]:
    """Remove every sketch hook for the block (nothing reaches the accumulators), then attach them again."""
    removed = [m for m in sketcher.matrices.values() if m.handle is not None]
    for m in removed:
        m.handle.remove()
        m.handle = None
    try:
        yield
    finally:
        for m in removed:
            m.handle = m.module.register_forward_hook(m.hook)


@contextlib.contextmanager
def _grads_of(weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Let ``weights`` require grad for the block, starting from no ``.grad``; restore both flags and ``.grad``."""
    saved = {n: (w.requires_grad, w.grad) for n, w in weights.items()}
    try:
        for w in weights.values():
            w.grad = None
            w.requires_grad_(True)
        yield
    finally:
        for n, w in weights.items():
            w.requires_grad_(saved[n][0])
            w.grad = saved[n][1]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode for the block; each one's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def dense_gradients(trainer: Any, pl_module: Any, probe: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{name: G}``: the dense gradient of the module's policy-gradient loss on ``probe`` for every sketched matrix.

    One forward+backward over the probe rows (in microbatches of ``model.microbatch_size``) at the current weights,
    in eval mode, with the sketch hooks removed; the loss is the module's loss aggregated (``loss.aggregation``) over
    the probe as if it were one update, without a KL penalty (the policy-gradient term alone). Losses referenced to
    the rollout (REINFORCE+TIS) use the probe's stored rollout log-probs; losses referenced to the trainer (the PPO
    family) use the current log-probs (ratio 1: the unclipped policy gradient). Weights, their ``requires_grad``
    flags and ``.grad``, other parameters' ``.grad``, the sketch accumulators and the global RNG streams are left as
    they were.

    Arguments:
        trainer: the Lightning trainer (its precision plugin gives the forward's autocast context, if any).
        pl_module: a :class:`~logra_pl.module.LoGRAPolicyModule` with a sketcher.
        probe: a batch from :func:`capture_probe`.
    """
    sketcher = pl_module.method.sketcher
    weights = {name: m.module.weight for name, m in sketcher.matrices.items()}
    device = pl_module.device
    loss_fn = pl_module.loss_config
    packed = probe_packed(probe)
    rows = packed.input_ids.shape[0]
    lengths = packed.response_mask.sum(dim=1)
    limit = pl_module.rollout_settings.max_new_tokens
    totals = UpdateTotals(int(lengths.sum()), int((lengths > 0).sum()), int(limit))
    size = max(1, int(pl_module.microbatch_size))
    forward = trainer.precision_plugin.forward_context if trainer is not None else contextlib.nullcontext
    devices = [device] if device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=devices),
        _sketch_hooks_removed(sketcher),
        _eval_mode(pl_module.policy),
        _grads_of(weights),
    ):
        for start in range(0, rows, size):
            part = slice(start, start + size)
            mb = PackedResponses(*(t[part] for t in (getattr(packed, f) for f in _PACKED_FIELDS))).to(device)
            with torch.enable_grad(), forward():
                logp = response_logprobs(pl_module.policy, mb, probe["temperature"])
                reference = probe["logp_rollout"][part].to(device) if loss_fn.reference == "rollout" else logp.detach()
                advantages = probe["advantages"][part].to(device)
                loss, _ = microbatch_loss(loss_fn, logp, reference, advantages, mb.response_mask, mb.lengths, totals)
            torch.autograd.backward(loss, inputs=list(weights.values()))
        grads = {n: w.grad for n, w in weights.items() if w.grad is not None}
    return grads


class SketchDiagnostics(pl.Callback):
    """Measure, on a fixed probe batch, how well each LoGRA sketch keeps the true gradient (paper, appendix D.3).

    At update ``n`` (counted from 1, every attempt, as the projection seeds count it) with ``n % every_n_updates ==
    0``, or ``n == 1`` with ``at_first_update``, the callback computes — before the update merges, at the weights
    the update's sketches were accumulated at — the dense gradient ``G`` of every sketched matrix for the
    module's policy-gradient loss on the probe batch, and with the projection ``P`` of the same update (the
    sketcher's seed for it: ``base_seed``, the projection index ``(u // refresh_every)·refresh_every`` (0 for a
    fixed basis), rank, distribution):

    - ``recon_cosine = cos(G, G Pᵀ P)``, the alignment of the sketch's (SGD) step direction with ``G``;
    - ``captured_energy = ‖G Q‖ / ‖G‖``, ``Q`` an orthonormal basis of ``P``'s rows: the fraction of ``G``'s norm in
      the sketch's subspace.

    ``P`` has iid ``±1/sqrt(r)`` (or ``N(0, 1/r)``) entries, so ``E[PᵀP] = I`` but its rows are not orthonormal
    (a Hadamard ``P`` has orthogonal rows, and then the two values coincide: :mod:`logra_pl.sketch.diagnostics`).
    For a random Gaussian ``G``, ``captured_energy ≈ sqrt(r/d_in)`` while ``recon_cosine ≈ sqrt(r/(d_in + r))``
    (``E‖gPᵀ‖² = ‖P‖² = d_in``, ``E‖gPᵀP‖² = ‖PPᵀ‖² ≈ d_in²/r + d_in`` per row ``g``); the two agree for
    ``r ≪ d_in``. Since ``P`` is drawn without looking at ``G`` (its row space is a uniformly random subspace), the
    same expectations hold for any fixed gradient: what the values mostly show is ``r/d_in`` per matrix, and a
    value far from them points at a projection that is not the update's.

    The probe batch is the first ``probe_responses`` responses of the rollout of the first update the callback
    sees (token ids, advantages, the engine's log-probs, the temperature), reused at every measurement so values
    are comparable across updates, and saved in the callback's checkpoint state so a resumed run measures the same
    batch.

    Cost: one extra forward+backward over the probe batch and one dense gradient per sketched matrix, all held at
    once (as a dense optimizer holds its gradients) — the memory LoGRA otherwise never spends, once every
    ``every_n_updates`` updates. Nothing else changes: the sketch hooks are removed for the pass (the accumulators
    are untouched), weights, optimizer and LoGRA state, ``.grad`` and the global RNG streams are as before, so a
    run with the callback trains bit-identically to one without.

    Logs one point per measurement, written by rank zero straight to the trainer's loggers at the step Lightning
    gives the update's other scalars (not through ``self.log``, which would repeat the value at every following
    step), and into the step's ``StepContext.metrics``: ``logra/recon_cosine`` and ``logra/captured_energy``
    (means over matrices, as in D.3), and with ``per_layer`` ``logra/recon_cosine/<layer>.<kind>`` (``kind``:
    ``q_proj``, ..., ``down_proj``); to a :class:`~lightning.pytorch.loggers.TensorBoardLogger` a heatmap of
    ``recon_cosine`` per layer and kind (``logra/recon_cosine_heatmap``). :attr:`last` holds the latest values (per
    matrix also ``logra/captured_energy/<layer>.<kind>``), :attr:`history` the means of every measurement.

    LoGRA runs only (a method that keeps sketches): with another method it warns once and logs nothing. One
    process only: under FSDP (``logra_fsdp``) or with several processes it raises a :class:`ConfigError` at
    setup, since each rank holds only row shards of the matrices and its own part of the batch.

    Arguments:
        every_n_updates: measure at every update whose number is a multiple of this.
        at_first_update: also measure at update 1.
        probe_responses: responses in the fixed probe batch (the first ones of the first rollout seen).
        image_every: add the heatmap at the first measurement, then at the first measurement on or after each
            multiple of this many updates (units: updates, like ``every_n_updates``); 0 never.
        per_layer: also log ``logra/recon_cosine/<layer>.<kind>`` for every matrix.
    """

    # What it reads of the policy contract (docs/extending.md), checked at setup.
    READS = ("policy", "method", "step_context", "loss_config", "microbatch_size", "rollout_settings")

    def __init__(
        self,
        every_n_updates: int = 50,
        at_first_update: bool = True,
        probe_responses: int = 16,
        image_every: int = 200,
        per_layer: bool = True,
    ) -> None:
        check_int("every_n_updates", every_n_updates, 1)
        check_int("probe_responses", probe_responses, 1)
        check_int("image_every", image_every, 0)
        self.every_n_updates = every_n_updates
        self.at_first_update = at_first_update
        self.probe_responses = probe_responses
        self.image_every = image_every
        self.per_layer = per_layer
        self.probe: dict[str, Any] | None = None
        self.last: dict[str, float] = {}
        self.last_update = 0
        self.history: list[dict[str, float]] = []
        self._image_bucket = -1
        self._warned: set[str] = set()

    def due(self, update: int) -> bool:
        """Whether update ``update`` (from 1) is measured."""
        return update % self.every_n_updates == 0 or (self.at_first_update and update == 1)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            rank_zero_warn(message)

    def _warn_not_logra(self, method: object) -> None:
        self._warn_once(
            "dense",
            f"SketchDiagnostics measures LoGRA sketches; the update method {getattr(method, 'name', '?')!r} "
            f"({type(method).__name__}) keeps none: it logs nothing",
        )

    # ------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if trainer.world_size > 1 or isinstance(strategy, ModelParallelStrategy | FSDPStrategy):
            raise ConfigError(
                f"SketchDiagnostics needs each matrix's whole dense gradient in one process, but this run uses "
                f"{type(strategy).__name__} with {trainer.world_size} process(es), where each rank holds row shards "
                "of the matrices and part of the batch: remove it from trainer.callbacks, or measure on one process "
                "with the default strategy"
            )
        method = require_view(pl_module, "SketchDiagnostics", self.READS).method
        if not method.keeps_sketches:
            self._warn_not_logra(method)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        method = getattr(pl_module, "method", None)
        sketcher = method.sketcher if method is not None else None
        if sketcher is None:
            self._warn_not_logra(method if method is not None else pl_module)
            return
        ctx = getattr(pl_module, "step_context", None)
        if self.probe is None:
            if ctx is None:
                return
            self.probe = capture_probe(ctx, self.probe_responses)
        update = sketcher.update_index + 1
        if not self.due(update):
            return
        values = self.measure(pl_module, trainer)
        metrics = self._metrics(values)
        if not metrics:
            self._warn_once(
                "zero",
                f"SketchDiagnostics at update {update}: the probe batch's gradient is zero in every matrix (all its "
                "advantages zero?), nothing logged; a larger probe_responses takes more rows",
            )
            return
        self.last = metrics
        self.last_update = update
        self.history.append(
            {"update": float(update), **{k: metrics[k] for k in ("logra/recon_cosine", "logra/captured_energy")}}
        )
        logged = {k: metrics[k] for k in ("logra/recon_cosine", "logra/captured_energy")}
        if self.per_layer:
            logged |= {k: v for k, v in metrics.items() if k.startswith("logra/recon_cosine/")}
        if ctx is not None:
            ctx.metrics.update(logged)
        # Written to the loggers at this step only: a value logged through ``self.log`` every N updates would be
        # repeated at every following step of the epoch. The step is the one Lightning gives this update's scalars.
        step = compat.batches_that_stepped(trainer)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=step)
        if self.image_every and update // self.image_every != self._image_bucket:
            self._image_bucket = update // self.image_every
            if trainer.is_global_zero:
                self._add_image(trainer, step)

    # ------------------------------------------------------------------------------------------ measure
    def measure(self, pl_module: Any, trainer: Any = None) -> dict[str, SketchFidelity]:
        """``{canonical name: SketchFidelity}`` of every sketched matrix, now, on the probe batch.

        Arguments:
            pl_module: a :class:`~logra_pl.module.LoGRAPolicyModule` with a sketcher (LoGRA run).
            trainer: its trainer (for the precision plugin's autocast); default: ``pl_module``'s.
        """
        if self.probe is None:
            raise RuntimeError("SketchDiagnostics has no probe batch yet: it captures one at the first update it sees")
        sketcher = pl_module.method.sketcher
        trainer = trainer if trainer is not None else compat.trainer_of(pl_module)
        grads = dense_gradients(trainer, pl_module, self.probe)
        out: dict[str, SketchFidelity] = {}
        for name in sketcher.matrices:
            g = grads.pop(name, None)
            if g is None:
                out[name] = SketchFidelity(float("nan"), float("nan"))
                continue
            side = sketcher.matrices[name].side  # the outputs' side sketches Gᵀ: its fidelity is that of Gᵀ Rᵀ
            out[name] = sketch_fidelity(g if side == "inputs" else g.mT, self.projection(sketcher, name))
            del g
        return out

    @staticmethod
    def projection(sketcher: Any, name: str) -> torch.Tensor:
        """``P`` of matrix ``name`` for the sketcher's current update (the installed one, rebuilt from its seed); with
        ``logra.input_scaling: rms`` the effective ``Q = P·diag(s)`` the sketch and the step use; on the outputs' side
        ``R`` (``r × d_out``)."""
        m = sketcher.matrices[name]
        seed = sketcher.seed_for(name)
        if m.seed == seed:
            p = m.projection
        else:
            cfg = sketcher.config
            p = make_projection(seed, m.rank, m.width, cfg.distribution, device=m.sketch.device)
        scale = getattr(m, "input_scale", None)
        return p if scale is None else p * scale

    def _metrics(self, values: dict[str, SketchFidelity]) -> dict[str, float]:
        finite = {n: v for n, v in values.items() if math.isfinite(v.recon_cosine) and math.isfinite(v.captured_energy)}
        if not finite:
            return {}
        short = short_names(values)
        out = {
            "logra/recon_cosine": sum(v.recon_cosine for v in finite.values()) / len(finite),
            "logra/captured_energy": sum(v.captured_energy for v in finite.values()) / len(finite),
        }
        out |= {f"logra/recon_cosine/{short[n]}": v.recon_cosine for n, v in finite.items()}
        out |= {f"logra/captured_energy/{short[n]}": v.captured_energy for n, v in finite.items()}
        return out

    # -------------------------------------------------------------------------------------------- image
    def figure(self) -> Any:
        """A matplotlib heatmap of the latest ``recon_cosine`` per layer (rows) and matrix kind (columns), annotated."""
        # A bare Figure, not pyplot: no backend switch, no global figure registry, so a notebook that runs this
        # callback keeps its inline plots (matplotlib.use("Agg") here turned them off for the rest of the session).
        from matplotlib.figure import Figure

        prefix = "logra/recon_cosine/"
        cells = {k[len(prefix) :].rpartition("."): v for k, v in self.last.items() if k.startswith(prefix)}
        numeric = {layer: (not layer.isdigit(), int(layer) if layer.isdigit() else 0, layer) for layer, _, _ in cells}
        layers = sorted(numeric, key=numeric.__getitem__)
        kinds = list(dict.fromkeys(kind for _, _, kind in cells))
        grid = torch.full((len(layers), len(kinds)), float("nan"))
        for (layer, _, kind), value in cells.items():
            grid[layers.index(layer), kinds.index(kind)] = value
        fig = Figure(figsize=(1.0 + 0.9 * max(len(kinds), 1), 1.2 + 0.35 * max(len(layers), 1)))
        ax = fig.subplots()
        top = max(float(grid.nan_to_num(0.0).max()), 1e-6)
        image = ax.imshow(grid.numpy(), cmap="viridis", vmin=0.0, vmax=top, aspect="auto")
        size = 7 if len(layers) * len(kinds) <= 120 else 5
        for i in range(len(layers)):
            for j in range(len(kinds)):
                value = float(grid[i, j])
                if math.isfinite(value):
                    color = "black" if value > 0.6 * top else "white"
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=size, color=color)
        ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xlabel("matrix")
        ax.set_ylabel("layer")
        ax.set_title(f"recon cosine at update {self.last_update}", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.05)
        fig.tight_layout()
        return fig

    def _add_image(self, trainer: pl.Trainer, step: int) -> None:
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        fig = self.figure()
        for logger in loggers:
            logger.experiment.add_figure("logra/recon_cosine_heatmap", fig, global_step=step, close=False)

    def png(self) -> bytes:
        """The latest heatmap as PNG bytes (for notebooks and reports)."""
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png")
        return buf.getvalue()

    # ------------------------------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        """The probe batch (so a resumed run measures the same rows), the history and the image position."""
        return {
            "probe": self.probe,
            "history": [dict(h) for h in self.history],
            "last": dict(self.last),
            "last_update": self.last_update,
            "image_bucket": self._image_bucket,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        probe = state_dict.get("probe")
        if probe is not None and probe.get("format") != PROBE_FORMAT:
            raise ConfigError(f"not a SketchDiagnostics probe batch (format {probe.get('format')!r})")
        self.probe = probe
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self.last = dict(state_dict.get("last", {}))
        self.last_update = int(state_dict.get("last_update", 0))
        self._image_bucket = int(state_dict.get("image_bucket", -1))
