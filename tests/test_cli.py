"""``logra-pl fit`` end to end through LightningCLI on the tiny config, and its bad-input errors."""

from __future__ import annotations

import functools
import glob
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from logra_pl.cli import LoGRACLI, main, parse_error_lines

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
FAST = [
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.prompts_per_step=16",
    "--model.microbatch_size=8",
]
SCALARS = [
    "train/reward_mean",
    "train/baseline",
    "train/advantage_mean",
    "train/advantage_std",
    "train/response_length",
    "train/truncation_rate",
    "train/loss",
    "train/update_norm",
    "time/rollout_s",
    "time/train_s",
    "time/update_s",
    "time/tokens_per_s",
    "verifier/errors",
    "val/reward_mean",
    "val/pass@1",
]
# tiny_cpu.yaml also carries PredictedKLControl (calibrating) and RolloutMismatch.
KL_SCALARS = [
    "kl/predicted",
    "kl/alpha",
    "kl/budget",
    "kl/effective_budget",
    "kl/realized",
    "kl/predicted_scaled",
    "mismatch/observed",
    "mismatch/ema",
]


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when `args` is given while sys.argv holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["logra-pl"])


def _scalars(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    files = glob.glob(str(save_dir / "**" / "events.out.tfevents.*"), recursive=True)
    assert files, f"no TensorBoard event file under {save_dir}"
    acc = EventAccumulator(sorted(files)[-1])
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# The AdamW config with KL measurement added by one flag (callbacks/kl_measure.yaml: no control, α = 1).
KL_MEASURED = ["kl/predicted", "kl/alpha", "kl/predicted_scaled", "kl/realized"]
KL_MEASURE = str(Path(CONFIG).parents[1] / "callbacks" / "kl_measure.yaml")


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_three_updates_end_to_end(tmp_path: Path, optimizer: str) -> None:
    config = CONFIG if optimizer == "logra" else CONFIG.replace("tiny_cpu.yaml", "tiny_cpu_adamw.yaml")
    extra = [] if optimizer == "logra" else [f"--trainer.callbacks+={KL_MEASURE}"]
    cli = LoGRACLI(args=["fit", f"--config={config}", *FAST, *extra, f"--trainer.logger.init_args.save_dir={tmp_path}"])
    module = cli.model
    assert cli.trainer.global_step == 3
    scalars = _scalars(tmp_path)
    wanted = SCALARS + (KL_SCALARS if optimizer == "logra" else KL_MEASURED)
    missing = [s for s in wanted if s not in scalars]
    assert not missing, f"missing scalars {missing}; logged {sorted(scalars)}"
    assert [step for step, _ in scalars["train/reward_mean"]] == [0, 1, 2]
    assert all(v > 0 for _, v in scalars["train/update_norm"])
    assert 0.0 <= scalars["val/pass@1"][-1][1] <= 1.0
    # The engine holds exactly the trainer's weights after the last update.
    for (name, a), b in zip(module.policy.state_dict().items(), module.engine.model.state_dict().values(), strict=True):
        assert a.equal(b), name
    # The resolved config is saved with the run.
    assert glob.glob(str(tmp_path / "**" / "config.yaml"), recursive=True)
    assert module.method.applied_updates == 3
    assert [step for step, _ in scalars["kl/alpha"]] == [0, 1, 2] == [step for step, _ in scalars["kl/realized"]]
    for (_, pred), (_, alpha), (_, scaled) in zip(
        scalars["kl/predicted"], scalars["kl/alpha"], scalars["kl/predicted_scaled"], strict=True
    ):
        assert scaled == pytest.approx(alpha**2 * pred, rel=1e-4)
        assert optimizer == "logra" or alpha == 1.0  # measured, not controlled
    if optimizer == "logra":
        assert module.method.sketcher.num_applied == 3


def _parse_error(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """``logra-pl fit`` in process with a mistake: exits with status 2 (jsonargparse's), returns the stderr lines."""
    with pytest.raises(SystemExit) as info:
        main(["fit", *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(lines) <= 5, "\n".join(lines)
    assert not any(line.lstrip().startswith(("usage:", "[--")) for line in lines), "\n".join(lines)
    return lines


def test_mistyped_key_names_the_nearest_valid_one(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.method.logra.rnak", "8", "--trainer.max_steps", "1")
    assert "unknown option 'model.method.logra.rnak' (did you mean 'model.method.logra.rank'?)" in lines[0]
    assert "LoGRAConfig" in lines[1] and "rank" in lines[1]


def test_the_old_kind_keys_name_every_loss_and_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--model.loss.kind gspo`` (the natural guess from old configs) names the form to write and every loss; a
    YAML file's old ``loss: {kind: gspo}`` section names every loss with its class path and the overlays."""
    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.loss.kind", "gspo")
    menu = "one of reinforce_tis, ppo, gspo, cispo"
    assert f"model.loss.kind is the old form: write --model.loss <name>, {menu}" in lines[1]
    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.baseline.kind", "group")
    assert "write --model.baseline <name>, one of running, group, rloo" in lines[1]

    old = tmp_path / "old.yaml"
    old.write_text("model:\n  loss:\n    kind: gspo\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={CONFIG}", f"--config={old}", "--print_config"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "--model.loss gspo" in err and "gspo (logra_pl.losses.GSPO)" in err
    assert "cispo (logra_pl.losses.CISPO)" in err
    assert "configs/overlays/" in err


def test_mistyped_key_in_a_yaml_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overlay = tmp_path / "typo.yaml"
    overlay.write_text("trainer:\n  max_stpes: 4\nmodel:\n  metohd:\n    class_path: sgd\n")
    lines = _parse_error(capsys, f"--config={CONFIG}", f"--config={overlay}")
    assert "did you mean 'trainer.max_steps'?" in lines[0] or "did you mean 'model.method'?" in lines[0], lines


def test_class_path_that_does_not_import(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.verifier.class_path", "nonexistent.Mod")
    assert "model.verifier" in lines[0] and "'nonexistent.Mod'" in lines[0]
    assert "ModuleNotFoundError: No module named 'nonexistent'" in lines[0]


def test_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _parse_error(capsys, "--config", "does-not-exist.yaml")
    assert "--config: no such file:" in lines[0] and "does-not-exist.yaml" in lines[0]


def test_full_report_on_request(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """LOGRA_PL_TRACEBACK=1 gives jsonargparse's own report (usage and the union-type text) back."""
    monkeypatch.setenv("LOGRA_PL_TRACEBACK", "1")
    with pytest.raises(SystemExit):
        main(["fit", f"--config={CONFIG}", "--model.method.logra.rnak", "8"])
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Option 'rnak' is not accepted" in err


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "unrecognized arguments: --trainer.max_stpes 1",
            "unknown option 'trainer.max_stpes' (did you mean 'trainer.max_steps'?)",
        ),
        ("Group 'trainer' does not accept option 'max_stpes'", "(did you mean 'trainer.max_steps'?)"),
        ("Subcommand 'fit' does not accept option 'modle.x'", "unknown option 'modle.x' (did you mean 'model'?)"),
        ("unrecognized arguments: --model.metohd=sgd", "(did you mean 'model.method'?)"),  # swapped letters
        ("Parser key \"config\": File does not exist: '/x/nowhere.yaml'", "--config: no such file: /x/nowhere.yaml"),
        (
            "Parser key \"trainer.max_steps\":\n  Expected a <class 'int'>. Got value: x",
            "trainer.max_steps: Expected a",
        ),
    ],
)
def test_parse_error_lines(message: str, expected: str) -> None:
    """How jsonargparse's messages are summarised, against the CLI's parser (parsed once, no run)."""
    lines = parse_error_lines(message, _cli_parser())
    assert expected in lines[0], lines
    assert len(lines) <= 5 and "--help lists every option" in lines[-1]


@functools.cache
def _cli_parser() -> Any:
    return LoGRACLI(args=[f"--config={CONFIG}"], run=False).parser


def test_tokenizer_without_chat_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    from logra_pl.module import LoGRAPolicyModule

    plain = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    module = LoGRAPolicyModule(policy=str(plain))
    with pytest.raises(ValueError, match="has no chat template"):
        module.configure_model()


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_the_top_level_help_lists_every_verb(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == (2 if not argv else 0)  # no verb at all is a usage error
    text = capsys.readouterr().out
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  ")]
    assert listed == ["fit", "validate", "serve", "plan", "export"]
    assert "logra-pl VERB --help lists its options" in text


def test_verbs_without_a_step_in_this_module_are_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning's ``test`` and ``predict`` would run nothing useful here: refused, naming the verbs there are."""
    for verb, nearest in (("test", ""), ("predict", ""), ("sevre", " (did you mean 'serve'?)")):
        with pytest.raises(SystemExit) as stop:
            main([verb])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"unknown verb '{verb}'{nearest}; the verbs are fit, validate, serve, plan, export" in err
        assert len(err.splitlines()) == 2


def test_every_serve_flag_has_a_help_text_and_says_its_default() -> None:
    from logra_pl.rollout.serve.server import serve_parser

    parser = serve_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = formatter._get_help_string(action)
        assert action.help and len(action.help) > 10, action.dest
        assert "default" in text, (action.dest, text)


PLUGINS = """
from logra_pl.envs.base import Turn


class Guess:  # plain methods, no annotations, its own parameter names
    max_turns = 2

    def start(self, item):
        return list(item["messages"])

    def step(self, item, history):
        return Turn(reward=0.0, done=True)


class Score:
    def __call__(self, text, item):
        return 1.0


class NoStep:
    max_turns = 2

    def start(self, item):
        return list(item["messages"])


class ShortStep(NoStep):
    def step(self, item):
        return None
"""


def test_an_environment_and_a_verifier_without_annotations_are_accepted_and_a_broken_one_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any class with the contract's methods is accepted by class_path (nothing to subclass, no type hints to copy);
    one that lacks a method, or cannot be called as the contract calls it, gets one line naming what is wrong."""
    (tmp_path / "myplugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={CONFIG}", "--model.env=myplugins.Guess", "--model.verifier=myplugins.Score",
              "--print_config"])  # fmt: skip
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: myplugins.Guess" in out and "class_path: myplugins.Score" in out

    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.env=myplugins.NoStep")
    assert "model.env: myplugins.NoStep is not an Environment: it has no step method" in lines[0]
    assert "called as step(item, messages)" in lines[0]
    lines = _parse_error(capsys, f"--config={CONFIG}", "--model.env=myplugins.ShortStep")
    assert "its step(self, item) cannot be called as step(item, messages)" in lines[0]


def test_an_environment_without_annotations_trains_through_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unannotated ``Guess`` (its own parameter names, no type hints) and ``Score`` train one update through
    ``logra-pl fit``, and the checkpoint records them as the run's environment and verifier."""
    (tmp_path / "myplugins.py").write_text(PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [f"--config={CONFIG}", "--model.env=myplugins.Guess", "--model.verifier=myplugins.Score"]
    args += ["--model.warm_start=null", "--trainer.max_steps=1", "--trainer.logger=false"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--data.train_size=16", "--data.eval_size=8"]
    args += ["--data.prompts_per_step=8", "--trainer.limit_val_batches=0"]
    try:
        main(["fit", *args])
    except SystemExit as done:
        assert done.code in (0, None)
    ckpts = sorted(tmp_path.rglob("last.ckpt"))
    assert ckpts, "the run wrote no checkpoint"
    saved = torch.load(ckpts[0], map_location="cpu", weights_only=False)
    assert saved["global_step"] == 1
    assert type(saved["hyper_parameters"]["env"]).__name__ == "Guess" or "myplugins.Guess" in str(
        saved["hyper_parameters"]["env"]
    )


def test_a_broken_environment_stops_the_cli_run_with_a_short_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [f"--config={CONFIG}", "--model.env=tests.helpers.envs.Failing", "--model.warm_start=null"]
    args += ["--trainer.max_steps=1", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    args += ["--data.train_size=16", "--data.eval_size=8", "--data.prompts_per_step=8", "--trainer.limit_val_batches=0"]
    with pytest.raises(SystemExit) as info:
        main(["fit", *args])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    summary = err[err.index(next(line for line in err if line.startswith("logra-pl: stopped:"))) :]
    assert summary[0].startswith(
        "logra-pl: stopped: the environment failed: Failing.step raised RuntimeError: the game server refused the move"
    )
    assert len(summary) <= 10 and not any("Traceback" in line for line in err)
