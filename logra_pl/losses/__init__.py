"""Policy-gradient losses and advantage baselines (algorithm.md §8), as objects chosen by ``class_path`` or short name.

- :mod:`~logra_pl.losses.functional` — the arithmetic, one formula per pure function (the surrogates, their
  statistics, aggregation, the KL estimators and penalty, PPO's plan, group baselines);
- :mod:`~logra_pl.losses.base` — :class:`Loss`, the whole contract the module uses, with the settings every loss
  shares declared once (aggregation, ``mask_truncated``, the KL-to-reference penalty); :func:`build_loss`;
- :mod:`~logra_pl.losses.policy` — the menu: :class:`ReinforceTIS` (default, ``reinforce_tis``), :class:`PPOClip`
  (``ppo``, with DAPO's clip-higher), :class:`GSPO` (``gspo``), :class:`CISPO` (``cispo``);
- :mod:`~logra_pl.losses.baselines` — :class:`AdvantageBaseline` (rewards → advantages, with its own state):
  :class:`RunningBaseline` (``running``), :class:`GroupBaseline` (``group``), :class:`RLOOBaseline` (``rloo``);
  :func:`build_baseline`.

Every loss is a *sum* over valid tokens of ``weights``-scaled terms divided by ``num_tokens`` — the token count of the
whole update — so that summing microbatch losses gives the update's loss exactly; the aggregation modes enter through
one seam (:meth:`Loss.row_scale`), so every loss — the built-in ones and yours — aggregates every way. The registry of
an earlier layout (``LossSpec``, ``register_loss``, ``LossConfig(kind=...)``, ``Baseline(kind=...)``) is deprecated
and lives in ``logra_pl/_graveyard/losses.py``; its names still resolve here.
"""

from logra_pl.losses.base import (
    Aggregation,
    Configured,
    KLEstimator,
    Loss,
    Reference,
    ReferenceDevice,
    SharedSettings,
    build_loss,
    check_loss,
)
from logra_pl.losses.baselines import (
    AdvantageBaseline,
    GroupBaseline,
    OutcomeMode,
    RLOOBaseline,
    RunningBaseline,
    build_baseline,
    check_baseline,
)
from logra_pl.losses.functional import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    UpdateTotals,
    aggregation_scale,
    cispo_loss,
    cispo_stats,
    clip_fraction,
    group_baseline,
    gspo_loss,
    gspo_stats,
    kl_estimate,
    kl_penalty,
    length_weights,
    ppo_clip_loss,
    ppo_stats,
    reinforce_tis_loss,
    sequence_log_ratio,
    shuffled_plan,
    truncation_mask,
)
from logra_pl.losses.policy import CISPO, GSPO, PPOClip, ReinforceTIS, TrainerRatioLoss

__all__ = [
    "AGGREGATIONS",
    "CISPO",
    "GSPO",
    "KL_ESTIMATORS",
    "AdvantageBaseline",
    "Aggregation",
    "Configured",
    "GroupBaseline",
    "KLEstimator",
    "Loss",
    "OutcomeMode",
    "PPOClip",
    "RLOOBaseline",
    "Reference",
    "ReferenceDevice",
    "ReinforceTIS",
    "RunningBaseline",
    "SharedSettings",
    "TrainerRatioLoss",
    "UpdateTotals",
    "aggregation_scale",
    "build_baseline",
    "build_loss",
    "check_baseline",
    "check_loss",
    "cispo_loss",
    "cispo_stats",
    "clip_fraction",
    "group_baseline",
    "gspo_loss",
    "gspo_stats",
    "kl_estimate",
    "kl_penalty",
    "length_weights",
    "ppo_clip_loss",
    "ppo_stats",
    "reinforce_tis_loss",
    "sequence_log_ratio",
    "shuffled_plan",
    "truncation_mask",
]
