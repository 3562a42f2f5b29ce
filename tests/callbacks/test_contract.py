"""The callbacks on a LightningModule that is not a policy module: those that read the policy update refuse it at
setup, naming what it lacks; MemoryMonitor measures it (a real Trainer, Lightning's own BoringModel)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from logra_pl.callbacks import (
    HFExport,
    MemoryMonitor,
    NextBatchGain,
    PolicySync,
    PredictedKLControl,
    RolloutMismatch,
)
from logra_pl.callbacks.contract import PolicyModuleView, missing_from_view
from logra_pl.callbacks.diagnostics import SketchDiagnostics
from tests.conftest import quick_trainer


@pytest.mark.parametrize(
    ("callback", "name", "lacks"),
    [
        (PredictedKLControl(), "PredictedKLControl", "policy, method, step_context"),
        (RolloutMismatch(), "RolloutMismatch", "step_context"),
        (PolicySync(), "PolicySync", ", ".join(PolicySync.READS)),
        (HFExport(every_n_updates=1), "HFExport", "policy, tokenizer, method"),
        (SketchDiagnostics(), "SketchDiagnostics", ", ".join(SketchDiagnostics.READS)),
        (NextBatchGain(), "NextBatchGain", "method"),
    ],
    ids=["kl-control", "mismatch", "sync", "export", "diagnostics", "next-batch-gain"],
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
    assert "logra_pl.callbacks.contract.PolicyModuleView" in text


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


def test_every_callback_declares_what_it_reads_of_the_contract() -> None:
    """A callback class that reads an attribute of the contract (``pl_module.<name>``, ``view.<name>``, or
    ``getattr(pl_module, "<name>")``) names it in its ``READS`` (its own or a base's; ``READS_IF_PRESENT``: read only
    when the module has it), so a module of one's own
    learns at setup what it must have, and no callback reads past the contract unannounced."""
    contract = set(PolicyModuleView.__annotations__)
    folder = Path(__file__).resolve().parents[2] / "logra_pl" / "callbacks"
    undeclared, checked = {}, 0
    for path in sorted(folder.glob("*.py")):
        module = importlib.import_module(f"logra_pl.callbacks.{path.stem}")
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            read = set()
            for sub in ast.walk(node):
                named = isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                if named and sub.value.id in ("pl_module", "view") and sub.attr in contract:
                    read.add(sub.attr)
                if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "getattr" and len(sub.args) >= 2:
                    owner, name = sub.args[0], sub.args[1]
                    if getattr(owner, "id", None) == "pl_module" and getattr(name, "value", None) in contract:
                        read.add(name.value)
            if not read:
                continue
            checked += 1
            cls = getattr(module, node.name)
            declared = set(getattr(cls, "READS", ())) | set(getattr(cls, "READS_IF_PRESENT", ()))
            if read - declared:
                undeclared[f"{path.stem}.{node.name}"] = sorted(read - declared)
    assert checked >= 8 and not undeclared, undeclared
