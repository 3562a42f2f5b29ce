"""The YAML configs compose: overlays on the base equal the full configs, callback recipes append, every key commented.

All parsing is in-process (``LoGRACLI(args=[...], run=False)``: parse and instantiate, no training), so the file
runs in seconds once torch and lightning are imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import yaml

import logra_pl.callbacks
from logra_pl.callbacks import UpdateCheckpoint
from logra_pl.cli import LoGRACLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
RECIPES = ROOT / "callbacks"
BASE = CONFIGS / "tiny_cpu.yaml"
# overlay -> the full config that base + overlay must resolve to
OVERLAYS = {"adamw": CONFIGS / "tiny_cpu_adamw.yaml", "vllm": CONFIGS / "tiny_cpu_vllm.yaml"}
# Overlays with no full config of their own (the parity protocol's methods: benchmarks/ablate.py --grid parity; the
# rule the ablations and the behaviour records pin), and
# the overlays each one is applied after (on the base).
PROTOCOL_OVERLAYS = {"paper_logra": (), "logra_levers": ("paper_logra",), "rowadam_demo": ()}
# Overlays that switch a feature on, or swap one part (the reward), over the base (no full config of their own): they
# parse, instantiate and hold only what differs from the base.
FEATURE_OVERLAYS = (
    "dapo_shaping",
    "reward_model",
    "llm_judge",
    "calculator",
    "higher_lower",
    "input_scaled",
    "outputs_side",
    "packed_projections",
    "outputs_side_r96",
)
# Overlays that replace the base's logger (no full config of their own) -> the Lightning logger class they build.
LOGGER_OVERLAYS = {"wandb": "WandbLogger", "mlflow": "MLFlowLogger"}
# The loss menu's recipes (issue 25), each on the base alone: the loss class, its arguments (every one written out,
# since a later file's new class_path keeps an earlier file's same-named arguments), the group baseline.
LOSS_OVERLAYS = {
    "gspo": ("GSPO", {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}),
    "cispo": ("CISPO", {"eps_high": 0.28, "eps_low": None, "aggregation": "token_mean"}),
    "dapo_clip_higher": ("PPOClip", {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "token_mean"}),
    "dr_grpo": ("PPOClip", {"clip_eps": 0.2, "aggregation": "seq_mean_token_sum_norm", "aggregation_length": None}),
}
# configs/paper/ are GPU recipes (and overlays on them): tests/test_paper_recipes.py covers them.
CONFIG_FILES = sorted(p for p in CONFIGS.rglob("*.yaml") if p.relative_to(CONFIGS).parts[0] != "paper")
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))
# Variant recipes: another callback's class with a few values changed (every argument still listed), e.g. KL
# measurement without control. name -> the values that differ from the class's defaults.
VARIANTS: dict[str, dict[str, Any]] = {"kl_measure.yaml": {"schedule": {"kind": "none"}, "calibrate": True}}
PRIMARY_RECIPES = [path for path in RECIPE_FILES if path.name not in VARIANTS]
# The callbacks configured by a recipe: every Lightning callback logra_pl.callbacks exports, except the checkpoint
# one, which every run gets from the `checkpoint:` section.
CALLBACK_CLASSES = sorted(
    (
        obj
        for name in logra_pl.callbacks.__all__
        if isinstance(obj := getattr(logra_pl.callbacks, name), type)
        and issubclass(obj, pl.Callback)
        and obj is not UpdateCheckpoint
    ),
    key=lambda cls: cls.__name__,
)


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when `args` is given while sys.argv holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["logra-pl"])


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _args(*configs: Path) -> list[str]:
    return [arg for config in configs for arg in ("--config", str(config))]


@functools.cache
def _resolved(*configs: Path) -> dict[str, Any]:
    """The resolved configuration of ``--config A --config B ...`` as plain data, without the file list itself."""
    cli = LoGRACLI(args=_args(*configs), run=False)
    data = _strip_paths(cli.config.as_dict())
    data.pop("config")
    return data


def _strip_paths(value: Any) -> Any:
    """Drop jsonargparse's ``__path__`` bookkeeping (which file a sub-config came from)."""
    if isinstance(value, dict):
        return {k: _strip_paths(v) for k, v in value.items() if k != "__path__"}
    if isinstance(value, list | tuple):
        return [_strip_paths(v) for v in value]
    return value


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b[0].c": leaf}`` for nested dicts and lists."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}".lstrip(".")).items()}
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def _recipe(path: Path) -> tuple[type, dict[str, Any]]:
    spec = yaml.safe_load(path.read_text())
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name), spec["init_args"]


def _plain(value: Any) -> Any:
    """An attribute as the YAML would write it: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


# ------------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("config", CONFIG_FILES, ids=_ids(CONFIG_FILES))
def test_every_config_parses(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each full config alone, each overlay (overlays/, ablations/) on the base, parses and instantiates."""
    monkeypatch.chdir(tmp_path)  # a logger may open its store when built (MLflow: runs/mlruns)
    configs = (BASE, config) if config.parent.name in ("overlays", "ablations") else (config,)
    if config.parent.name == "overlays" and config.stem in PROTOCOL_OVERLAYS:
        below = tuple(CONFIGS / "overlays" / f"{name}.yaml" for name in PROTOCOL_OVERLAYS[config.stem])
        configs = (BASE, *below, config)
        _skip_unmerged_logra_keys(config)
    cli = LoGRACLI(args=_args(*configs), run=False)
    assert isinstance(cli.trainer, pl.Trainer)
    assert isinstance(cli.model, pl.LightningModule)


def _skip_unmerged_logra_keys(config: Path) -> None:
    """Skip (not pass) an overlay whose ``model.logra`` keys LoGRAConfig does not have yet: configs/overlays/
    logra_levers.yaml names the update-rule levers of issue 23 before their branch is merged."""
    from logra_pl.sketch import LoGRAConfig

    logra = (yaml.safe_load(config.read_text()).get("model") or {}).get("logra") or {}
    unknown = sorted(set(logra) - {f.name for f in dataclasses.fields(LoGRAConfig)})
    if unknown:
        pytest.skip(f"{config.name}: model.logra keys {unknown} are not in LoGRAConfig yet (lever branch unmerged)")


def test_every_overlay_has_its_full_config() -> None:
    stems = sorted(p.stem for p in (CONFIGS / "overlays").glob("*.yaml"))
    assert stems == sorted([*OVERLAYS, *PROTOCOL_OVERLAYS, *FEATURE_OVERLAYS, *LOGGER_OVERLAYS, *LOSS_OVERLAYS])


@pytest.mark.parametrize("overlay", sorted(LOGGER_OVERLAYS))
def test_logger_overlay_replaces_only_the_logger(overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow opens its file store (runs/mlruns) when the logger is built
    path = CONFIGS / "overlays" / f"{overlay}.yaml"
    base, composed = _flat(_resolved(BASE)), _flat(_resolved(BASE, path))
    changed = sorted(k for k in base.keys() | composed.keys() if base.get(k, "<absent>") != composed.get(k, "<absent>"))
    assert changed and all(key.startswith("trainer.logger.") for key in changed), changed
    cli = LoGRACLI(args=_args(BASE, path), run=False)
    assert type(cli.trainer.logger).__name__ == LOGGER_OVERLAYS[overlay]


@pytest.mark.parametrize("overlay", sorted(LOSS_OVERLAYS))
def test_loss_overlay_builds_its_loss_with_every_argument_written_out(overlay: str) -> None:
    """Base + overlay builds the named loss with the named values, a GroupBaseline over 4 responses per prompt; the
    overlay lists every argument of the class (so no value of the base's ReinforceTIS section leaks into it)."""
    cls_name, expected = LOSS_OVERLAYS[overlay]
    path = CONFIGS / "overlays" / f"{overlay}.yaml"
    cli = LoGRACLI(args=_args(BASE, path), run=False)
    loss = cli.model.loss_config
    assert type(loss).__name__ == cls_name
    assert {k: loss.init_args()[k] for k in expected} == expected
    assert type(cli.model.baseline).__name__ == "GroupBaseline"
    assert cli.model.rollout_settings.responses_per_prompt == 4
    written = yaml.safe_load(path.read_text())["model"]["loss"]["init_args"]
    assert list(written) == list(loss.init_args()), "the overlay must list every argument, in the class's order"


def test_a_loss_class_changed_in_a_file_keeps_same_named_arguments_one_named_on_the_command_line_does_not(
    tmp_path: Path,
) -> None:
    """Why the loss overlays write every argument out (docs/algorithm.md §8, GSPO): a later file's new class_path
    keeps the base's `aggregation: token_mean`; `--model.loss GSPO` builds GSPO's own defaults."""
    partial = tmp_path / "partial.yaml"
    partial.write_text("model:\n  loss:\n    class_path: logra_pl.losses.GSPO\n    init_args:\n      eps_low: 0.001\n")
    kept = LoGRACLI(args=_args(BASE, partial), run=False).model.loss_config
    assert type(kept).__name__ == "GSPO" and kept.eps_low == 0.001 and kept.shared.aggregation == "token_mean"
    named = LoGRACLI(args=[*_args(BASE), "--model.loss=GSPO"], run=False).model.loss_config
    assert named.shared.aggregation == "seq_mean_token_mean" and named.eps_low == 3e-4


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_on_base_resolves_to_full_config(overlay: str) -> None:
    composed = _resolved(BASE, CONFIGS / "overlays" / f"{overlay}.yaml")
    full = _resolved(OVERLAYS[overlay])
    a, b = _flat(composed), _flat(full)
    pairs = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(a.keys() | b.keys())}
    diff = {k: pair for k, pair in pairs.items() if pair[0] != pair[1]}
    assert not diff, f"base + overlays/{overlay}.yaml differs from {OVERLAYS[overlay].name} (composed, full): {diff}"
    assert composed == full


@pytest.mark.parametrize("overlay", sorted([*OVERLAYS, *FEATURE_OVERLAYS, *LOGGER_OVERLAYS]))
def test_overlay_holds_only_differences(overlay: str) -> None:
    """No overlay key restates the base's value (lists count as one value; a `key+:` list is always new)."""
    base = _flat(_resolved(BASE))
    spec = yaml.safe_load((CONFIGS / "overlays" / f"{overlay}.yaml").read_text())

    def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}.{key}".lstrip(".")).items()}
        return {prefix: value}

    same = [
        key
        for key, value in leaves(spec).items()
        if not isinstance(value, list) and key in base and _plain(base[key]) == value
    ]
    assert not same, f"overlays/{overlay}.yaml restates the base's values of {same}"


# ------------------------------------------------------------------------------------------------------ recipes
def test_recipes_are_yaml_only() -> None:
    """callbacks/ must never become a Python package: it would shadow the PyPI package `callbacks`."""
    assert not list(RECIPES.glob("*.py"))
    assert (RECIPES / "README.md").is_file()


def test_one_recipe_per_callback() -> None:
    classes = [_recipe(path)[0] for path in PRIMARY_RECIPES]
    assert sorted(classes, key=lambda cls: cls.__name__) == CALLBACK_CLASSES
    assert set(VARIANTS) <= {path.name for path in RECIPE_FILES}
    assert all(_recipe(RECIPES / name)[0] in CALLBACK_CLASSES for name in VARIANTS)
    readme = (RECIPES / "README.md").read_text()
    missing = [path.name for path in RECIPE_FILES if path.name not in readme]
    assert not missing, f"callbacks/README.md does not list {missing}"


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=_ids(RECIPE_FILES))
def test_recipe_lists_every_argument_at_its_default(recipe: Path) -> None:
    """Exactly the class's __init__ parameters, in order, each at its default (so recipes cannot rot); a variant
    recipe differs from the defaults in its declared values only."""
    cls, init_args = _recipe(recipe)
    changed = VARIANTS.get(recipe.name, {})
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert list(init_args) == [p.name for p in params]
    hints = typing.get_type_hints(cls.__init__)
    for param in params:
        value = init_args[param.name]
        if isinstance(value, dict):  # a dataclass argument written out field by field, e.g. schedule
            (dataclass,) = [t for t in typing.get_args(hints[param.name]) if dataclasses.is_dataclass(t)]
            default = dataclasses.asdict(dataclass()) if param.default is None else _plain(param.default)
            assert list(value) == [f.name for f in dataclasses.fields(dataclass)], param.name
            assert value == {**default, **changed.get(param.name, {})}, param.name
        else:
            assert value == changed.get(param.name, _plain(param.default)), param.name


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=_ids(RECIPE_FILES))
def test_recipe_appended_instantiates_its_callback(recipe: Path) -> None:
    """`--trainer.callbacks+=<recipe>` builds the class with the recipe's values (list emptied first: the base
    already holds most of these callbacks, and Lightning refuses a second stateful copy)."""
    cls, init_args = _recipe(recipe)
    cli = LoGRACLI(args=[*_args(BASE), "--trainer.callbacks=[]", f"--trainer.callbacks+={recipe}"], run=False)
    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, cls)]
    assert {name: _plain(getattr(callback, name)) for name in init_args} == init_args


def test_recipe_appends_to_the_base_callbacks() -> None:
    """On top of a config's list, `+=` keeps its callbacks in order and adds the recipe's last."""
    base = [type(cb) for cb in LoGRACLI(args=_args(BASE), run=False).trainer.callbacks]
    cli = LoGRACLI(args=[*_args(BASE), f"--trainer.callbacks+={RECIPES / 'policy_sync.yaml'}"], run=False)
    names = [cb["class_path"].rpartition(".")[2] for cb in cli.config.as_dict()["trainer"]["callbacks"]]
    assert names == ["RunSummary", "HFExport", "MemoryMonitor", "PredictedKLControl", "RolloutMismatch", "PolicySync"]
    built = [type(cb) for cb in cli.trainer.callbacks]
    assert built.count(logra_pl.callbacks.PolicySync) == 1
    assert [t for t in built if t is not logra_pl.callbacks.PolicySync] == base


def test_all_recipes_together() -> None:
    appended = [f"--trainer.callbacks+={recipe}" for recipe in PRIMARY_RECIPES]
    cli = LoGRACLI(args=[*_args(BASE), "--trainer.callbacks=[]", *appended], run=False)
    for cls in CALLBACK_CLASSES:
        assert sum(isinstance(cb, cls) for cb in cli.trainer.callbacks) == 1, cls.__name__


def test_kl_measurement_joins_the_adamw_config_with_one_flag() -> None:
    """callbacks/kl_measure.yaml on configs/tiny_cpu_adamw.yaml (which has no KL callback): one ``+=`` gives a
    PredictedKLControl that measures (calibrate) without controlling (kind none), next to the config's callbacks."""
    adamw = CONFIGS / "tiny_cpu_adamw.yaml"
    base = [type(cb) for cb in LoGRACLI(args=_args(adamw), run=False).trainer.callbacks]
    cli = LoGRACLI(args=[*_args(adamw), f"--trainer.callbacks+={RECIPES / 'kl_measure.yaml'}"], run=False)
    (kl,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, logra_pl.callbacks.PredictedKLControl)]
    assert kl.schedule.kind == "none" and kl.calibrate and kl.schedule(1) is None
    assert [type(cb) for cb in cli.trainer.callbacks if cb is not kl] == base
    assert cli.model.method.makes_proposals


def test_second_copy_of_a_stateful_callback_is_refused() -> None:
    """What callbacks/README.md warns about: the base already has a RolloutMismatch."""
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `RolloutMismatch`"):
        LoGRACLI(args=[*_args(BASE), f"--trainer.callbacks+={RECIPES / 'rollout_mismatch.yaml'}"], run=False)


def test_recipe_with_an_unknown_key_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("class_path: logra_pl.callbacks.RunSummary\ninit_args:\n  window: 10\n  windw: 5\n")
    with pytest.raises(SystemExit):
        LoGRACLI(args=[*_args(BASE), "--trainer.callbacks=[]", f"--trainer.callbacks+={bad}"], run=False)
    err = capsys.readouterr().err
    assert "unknown option 'trainer.callbacks.windw' (did you mean 'trainer.callbacks.window'?)" in err, err
    assert "logra_pl.callbacks.RunSummary) takes: window" in err and len(err.splitlines()) <= 5, err


# ----------------------------------------------------------------------------------------------------- comments
KEY_VALUE = re.compile(r"^\s*[A-Za-z_][\w.]*\+?:\s+(?P<value>\S.*)$")


@pytest.mark.parametrize("path", CONFIG_FILES + RECIPE_FILES, ids=_ids(CONFIG_FILES + RECIPE_FILES))
def test_every_key_is_commented(path: Path) -> None:
    """Each `key: value` line carries a `# meaning; default` comment. List items and keys that only open a nested
    block (`model:`, `init_args:`) are exempt: the keys inside them carry the comments."""
    bare = [
        f"{number}: {line}"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if (match := KEY_VALUE.match(line)) and not match["value"].startswith("#") and "#" not in line
    ]
    assert not bare, f"{path.relative_to(ROOT)}: keys without a comment:\n" + "\n".join(bare)
