"""``DivergenceGuard``: the settings of the check that keeps a diverging policy out of the weights.

After the update is formed and before it touches the weights, both optimizers ask one question: would this
update move the trained weights by more than ``max_update_ratio`` of their norm, or make any weight non-finite?
If so it is rejected — LoGRA does not merge the proposal (:mod:`logra_pl.sketch.guard`), AdamW does not take the
step (:func:`logra_pl.methods.adamw.adamw_step_preview`) — so the weights stay exactly as they were. Every update
that is not applied (a guard rejection, or a LoGRA skip for a non-finite sketch or prediction) prints a console line;
``max_consecutive`` of them in a row stop the run with :class:`~logra_pl.errors.PolicyDivergedError`, and the
last checkpoint stays the last good one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from logra_pl.errors import PolicyDivergedError, check_int, check_range

log = logging.getLogger("logra_pl.module")  # the console lines keep the module's logger name


@dataclass
class DivergenceGuard:
    """When an update is rejected, and when rejections stop the run.

    Arguments:
        enabled: check every update (the check costs a few r×r products per matrix for LoGRA, one pass over the
            trained parameters for AdamW).
        max_update_ratio: largest accepted ``‖ΔW‖_F / ‖W‖_F`` of one update over all trained matrices. The
            default 1.0 is generous — healthy runs move far less (the tiny demo ~1e-2 per update, the paper's
            update ratio 6e-5) — so it only catches a step as large as the weights themselves.
        max_consecutive: updates in a row that may be rejected or skipped before the run stops.
    """

    enabled: bool = True
    max_update_ratio: float = 1.0
    max_consecutive: int = 5

    def __post_init__(self) -> None:
        check_range("guard.max_update_ratio", self.max_update_ratio, 0.0, low_open=True)
        check_int("guard.max_consecutive", self.max_consecutive, 1)


class RejectionCount:
    """Updates that were not applied (guard rejections and LoGRA skips) over the run, and in a row.

    Arguments:
        max_consecutive: rejections in a row that stop the run.
    """

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.total = 0
        self.in_a_row = 0

    def record(self, rejected: str | None, update: int, knob: str, checkpoint: str, say: bool) -> None:
        """Count update ``update``'s outcome; say it on the console (``say``); stop a run that keeps diverging.

        Raises:
            PolicyDivergedError: ``max_consecutive`` updates in a row were not applied (``knob`` is the setting to
                lower; ``checkpoint`` the file that holds the last good weights).
        """
        if rejected is None:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        limit = self.max_consecutive
        if say:
            log.warning(
                "update %d not applied (weights unchanged): %s [%d in a row; the run stops at %d]",
                update,
                rejected,
                self.in_a_row,
                limit,
            )
        if self.in_a_row >= limit:
            raise PolicyDivergedError(
                f"policy diverged at update {update}: {limit} updates in a row were not applied (last: {rejected}). "
                f"Lower {knob} or enable PredictedKLControl; no rejected update reached the weights, and {checkpoint} "
                "holds the last good ones"
            )

    def state_dict(self) -> dict[str, int]:
        return {"rejected_updates": self.total, "rejected_in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total = int(state.get("rejected_updates", 0))
        self.in_a_row = int(state.get("rejected_in_a_row", 0))
