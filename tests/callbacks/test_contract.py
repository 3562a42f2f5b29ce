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
    ("callback", "name"),
    [
        (PredictedKLControl(), "PredictedKLControl"),
        (RolloutMismatch(), "RolloutMismatch"),
        (PolicySync(), "PolicySync"),
        (HFExport(every_n_updates=1), "HFExport"),
    ],
    ids=["kl-control", "mismatch", "sync", "export"],
)
def test_a_callback_that_reads_the_policy_refuses_another_module_naming_what_it_lacks(
    callback, name: str, tmp_path: Path
) -> None:
    with pytest.raises(TypeError) as info:
        quick_trainer(tmp_path, 2, [callback]).fit(BoringModel())
    text = str(info.value)
    assert text.startswith(f"{name} works with a policy module: BoringModel has no ")
    for attribute in ("method", "step_context", "link", "sampler", "passes"):
        assert attribute in text
    assert "logra_pl.train.view.PolicyModuleView" in text


def test_memory_monitor_measures_any_module(tmp_path: Path) -> None:
    monitor = MemoryMonitor()
    quick_trainer(tmp_path, 2, [monitor]).fit(BoringModel())
    assert len(monitor.history) == 2
    # BoringModel: one Linear(32, 2) in float32 and SGD without momentum: 66 parameters, 264 bytes.
    assert monitor.last["memory/state/weights"] == 264.0
    assert monitor.last["memory/peak_rss_bytes"] > 0


def test_the_contract_is_the_protocols_annotations() -> None:
    assert missing_from_view(BoringModel()) == list(PolicyModuleView.__annotations__)
