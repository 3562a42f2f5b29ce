"""The callbacks on a LightningModule that is not a policy module: those that read the policy update refuse it at
setup, naming what it lacks; MemoryMonitor measures it (a real Trainer, Lightning's own BoringModel)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from logra_pl.callbacks import HFExport, MemoryMonitor, PolicySync, PredictedKLControl, RolloutMismatch
from logra_pl.train.view import PolicyModuleView, missing_from_view
from tests.conftest import quick_trainer


@pytest.mark.parametrize(
    ("callback", "name", "lacks"),
    [
        (PredictedKLControl(), "PredictedKLControl", "policy, method, step_context"),
        (RolloutMismatch(), "RolloutMismatch", "step_context"),
        (PolicySync(), "PolicySync", ", ".join(PolicyModuleView.__annotations__)),
        (HFExport(every_n_updates=1), "HFExport", "policy, tokenizer, method"),
    ],
    ids=["kl-control", "mismatch", "sync", "export"],
)
def test_a_callback_that_reads_the_policy_refuses_another_module_naming_what_it_lacks(
    callback, name: str, lacks: str, tmp_path: Path
) -> None:
    """Each names the attributes it reads that the module lacks, in one line (BoringModel has none of them)."""
    with pytest.raises(TypeError) as info:
        quick_trainer(tmp_path, 2, [callback]).fit(BoringModel())
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{name} works with a policy module: BoringModel has no {lacks} (")
    assert "logra_pl.train.view.PolicyModuleView" in text


def test_a_module_with_part_of_the_contract_is_told_only_what_it_lacks(tmp_path: Path) -> None:
    """A module of your own that has ``policy`` and ``method`` but no ``step_context``: PredictedKLControl names the
    one attribute missing, not the whole contract."""

    class Partial(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.policy, self.method = self.layer, None

    expected = r"Partial has no step_context \(it reads policy, method, step_context of the contract,"
    with pytest.raises(TypeError, match=expected):
        quick_trainer(tmp_path, 2, [PredictedKLControl()]).fit(Partial())


def test_memory_monitor_measures_any_module(tmp_path: Path) -> None:
    monitor = MemoryMonitor()
    quick_trainer(tmp_path, 2, [monitor]).fit(BoringModel())
    assert len(monitor.history) == 2
    # BoringModel: one Linear(32, 2) in float32 and SGD without momentum: 66 parameters, 264 bytes.
    assert monitor.last["memory/state/weights"] == 264.0
    assert monitor.last["memory/peak_rss_bytes"] > 0


def test_the_contract_is_the_protocols_annotations() -> None:
    assert missing_from_view(BoringModel()) == list(PolicyModuleView.__annotations__)
