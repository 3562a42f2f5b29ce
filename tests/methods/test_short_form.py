"""The short form of an update method (``model.optimizer`` with the ``model.logra`` / ``adamw`` / ``lora`` / ``sgd``
sections), deprecated: configs, flags, the module's keyword arguments and old checkpoints still give the same method,
each with one ``FutureWarning`` that shows the form to write (``logra_pl/_graveyard/methods.py``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import yaml

from logra_pl.cli import LoGRACLI
from logra_pl.methods import DenseAdamW, LoGRAMethod, LoRAMethod
from logra_pl.methods.adamw import AdamWConfig
from logra_pl.module import LoGRAPolicyModule
from logra_pl.sketch import LoGRAConfig

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "behaviour" / "legacy"
sys.path.insert(0, str(ROOT / "benchmarks"))
from grid import short_method_form  # noqa: E402  (the grids' own reader of the short form)


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "update method" in str(w.message)
    ]


def test_an_old_config_gives_the_same_method_with_one_deprecation_line(tmp_path: Path) -> None:
    new = yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text())
    old = dict(new, model=short_method_form(new["model"], base=True))
    assert old["model"]["optimizer"] == "logra" and "method" not in old["model"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        translated = LoGRACLI(args=["--config", str(path)], run=False).model.method
    lines = _deprecations(caught)
    assert len(lines) == 1 and "model.method: {class_path: logra_pl.methods.LoGRAMethod" in lines[0], lines
    current = LoGRACLI(args=["--config", str(ROOT / "configs" / "tiny_cpu.yaml")], run=False).model.method
    assert isinstance(translated, LoGRAMethod) and translated.config == current.config


def test_old_flags_and_keyword_arguments_give_the_same_method() -> None:
    from logra_pl._graveyard.methods import translate_argv

    with pytest.warns(FutureWarning, match="the flags to write from now on"):
        flags = translate_argv(["fit", "--model.optimizer", "lora", "--model.lora.rank=8", "--model.adamw.lr", "1e-3"])
    assert flags == [
        "fit",
        "--model.method=logra_pl.methods.LoRAMethod",
        "--model.method.lora.rank=8",
        "--model.method.adamw.lr",
        "1e-3",
    ]
    with pytest.warns(FutureWarning, match="read as model.method: logra_pl.methods.DenseAdamW"):
        module = LoGRAPolicyModule(optimizer="adamw", adamw=AdamWConfig(lr=1e-3))
    assert isinstance(module.method, DenseAdamW) and module.method.adamw.lr == 1e-3
    with pytest.warns(FutureWarning):
        lora = LoGRAPolicyModule(optimizer="lora", logra=LoGRAConfig(rank=4))  # a section the method does not take
    assert type(lora.method) is LoRAMethod


def test_a_checkpoint_of_the_short_form_loads_as_its_method() -> None:
    """``load_from_checkpoint`` of a CLI checkpoint whose hyper-parameters hold ``optimizer: logra`` and the
    ``logra`` section (the paper's rule it ran): the same method and settings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = LoGRAPolicyModule.load_from_checkpoint(LEGACY / "cli_update2.ckpt", map_location="cpu")
    assert isinstance(module.method, LoGRAMethod)
    cfg = module.method.config
    assert (cfg.rank, cfg.update_rule, cfg.step_mode, cfg.update_ratio) == (64, "rowadam", "ratio", 0.01)
    assert len(_deprecations(caught)) == 1
