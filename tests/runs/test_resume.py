"""Never lose a run: checkpoints before the first validation, ``--ckpt_path last`` after a real ``kill -9``,
and resumes that refuse settings which change what the checkpoint means."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from logra_pl.cli import LoGRACLI, main
from logra_pl.errors import CheckpointNotFoundError, ResumeMismatchError
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
# Validation only at update 100: every checkpoint below comes from the update-count trigger.
FAST = [
    "--trainer.val_check_interval=100",
    "--trainer.enable_progress_bar=false",
    "--model.warm_start.steps=20",
    "--data.train_size=256",
    "--data.eval_size=32",
    "--data.prompts_per_step=16",
    "--model.microbatch_size=8",
    "--checkpoint.every_n_updates=4",
]


def _cli(
    save_dir: Path, *extra: str, kill_at: int | None = None, signum: str = "SIGKILL"
) -> subprocess.CompletedProcess[str]:
    """``logra-pl fit`` in a child process (so it can be killed for real)."""
    args = [sys.executable, "-m", "logra_pl.cli", "fit", f"--config={CONFIG}", *FAST]
    args += [f"--trainer.logger.init_args.save_dir={save_dir}", *extra]
    if kill_at is not None:
        args += ["--trainer.callbacks+=tests.helpers.kill.KillAt", f"--trainer.callbacks.update={kill_at}"]
        args += [f"--trainer.callbacks.signum={signum}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _scalars(folder: Path, tag: str) -> dict[int, float]:
    """Every event file of a run folder, the way TensorBoard reads it (purged steps dropped)."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 updates without interruption: the reference a resumed run must equal."""
    save_dir = tmp_path_factory.mktemp("straight")
    done = _cli(save_dir, "--trainer.max_steps=8")
    assert done.returncode == 0, done.stderr[-3000:]
    return save_dir / "tiny_cpu" / "version_0"


@pytest.mark.system
@pytest.mark.slow
def test_kill9_before_first_validation_then_resume_last_is_bitwise(tmp_path: Path, straight_run: Path) -> None:
    killed = _cli(tmp_path, "--trainer.max_steps=8", kill_at=6)
    assert killed.returncode == -signal.SIGKILL
    run = tmp_path / "tiny_cpu" / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4  # saved at update 4, long before the first validation (update 100)

    resumed = _cli(tmp_path, "--trainer.max_steps=8", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (tmp_path / "tiny_cpu" / "version_1").exists()  # continued in the checkpoint's folder
    mine = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    ref = torch.load(straight_run / "checkpoints" / "last.ckpt", weights_only=False)
    assert mine["global_step"] == ref["global_step"] == 8
    for key, value in ref["state_dict"].items():
        assert torch.equal(mine["state_dict"][key], value), key
    ref_logra, mine_logra = ref["optimizer_states"][0]["logra"], mine["optimizer_states"][0]["logra"]
    assert mine_logra["update_index"] == ref_logra["update_index"] == 8
    for name, v in ref_logra["row_stats"].items():
        assert torch.equal(mine_logra["row_stats"][name], v), name
    assert mine["logra_pl"]["baseline"] == ref["logra_pl"]["baseline"]
    # The logged curve is the uninterrupted one: the steps the kill left after the checkpoint are purged.
    assert _scalars(run, "train/reward_mean") == _scalars(straight_run, "train/reward_mean")
    assert sorted(_scalars(run, "kl/alpha")) == list(range(8))
    # RunSummary and the KL record cover the whole run, not only the resumed session.
    assert "updates: 8 in" in resumed.stderr + resumed.stdout
    assert "KL calibration over 8 updates" in resumed.stderr + resumed.stdout
    assert not list(run.glob("checkpoints/.*tmp*"))  # no temp file of an interrupted write
    assert "not resumable" not in resumed.stderr  # the prompt loader is resumable, and Lightning knows it


@pytest.mark.system
@pytest.mark.slow
def test_sigterm_saves_the_finished_update_exits_143_then_resume_last_is_bitwise(
    tmp_path: Path, straight_run: Path
) -> None:
    """A scheduler's SIGTERM during update 6 (checkpoints every 4): the update finishes, ``last.ckpt`` holds update 6
    (not 4: nothing is lost), the exit status is 143 (the job did not finish), and the resumed run ends where the
    uninterrupted one ends, bit for bit."""
    stopped = _cli(tmp_path, "--trainer.max_steps=8", kill_at=6, signum="SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM: stopped after update 6" in stopped.stderr
    assert "resume with the same command and --ckpt_path last" in stopped.stderr
    run = tmp_path / "tiny_cpu" / "version_0"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert not list(run.glob("checkpoints/.*tmp*"))

    resumed = _cli(tmp_path, "--trainer.max_steps=8", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    mine = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    ref = torch.load(straight_run / "checkpoints" / "last.ckpt", weights_only=False)
    assert mine["global_step"] == ref["global_step"] == 8
    for key, value in ref["state_dict"].items():
        assert torch.equal(mine["state_dict"][key], value), key
    for name, v in ref["optimizer_states"][0]["logra"]["row_stats"].items():
        assert torch.equal(mine["optimizer_states"][0]["logra"]["row_stats"][name], v), name
    assert _scalars(run, "train/reward_mean") == _scalars(straight_run, "train/reward_mean")


def _straight_killed_resumed(
    tmp_path: Path, *args: str, steps: int = 8, kill_at: int = 6, saved_at: int = 4
) -> tuple[Path, Path, dict, dict, dict]:
    """A ``steps``-update run straight through, and one killed (SIGKILL) after update ``kill_at`` then resumed with
    ``--ckpt_path=last``: (the resumed run's folder, the straight run's, the checkpoint the kill left, both final
    checkpoints). ``args`` set ``--trainer.max_steps`` to ``steps`` and a checkpoint interval that saves at
    ``saved_at``. Asserts the kill left update ``saved_at``'s checkpoint and that both end at ``steps`` with equal
    weights."""
    straight = _cli(tmp_path / "straight", *args)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _cli(tmp_path / "killed", *args, kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL
    run = tmp_path / "killed" / "tiny_cpu" / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == saved_at
    resumed = _cli(tmp_path / "killed", *args, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref_run = tmp_path / "straight" / "tiny_cpu" / "version_0"
    mine = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    ref = torch.load(ref_run / "checkpoints" / "last.ckpt", weights_only=False)
    assert mine["global_step"] == ref["global_step"] == steps
    for key, value in ref["state_dict"].items():
        assert torch.equal(mine["state_dict"][key], value), key
    return run, ref_run, saved, mine, ref


@pytest.mark.system
@pytest.mark.slow
def test_kill9_with_asynchronous_rollouts_in_flight_then_resume_last_is_bitwise(tmp_path: Path) -> None:
    """``rollout.max_staleness: 1``: the checkpoint at update 4 waits for the batch in flight and stores it; the run
    killed at update 6 resumes from it and ends where the uninterrupted run ends (weights, rewards, staleness)."""
    stale = ["--model.rollout.max_staleness=1", "--model.rollout.max_stale_kl=0.01", "--trainer.max_steps=8"]
    run, ref_run, saved, _, _ = _straight_killed_resumed(tmp_path, *stale)
    assert sorted(saved["logra_pl"]["async"]["rollouts"]) == ["4", "5"]
    for tag in ("train/reward_mean", "async/staleness", "async/stale_kl", "kl/alpha"):
        assert _scalars(run, tag) == _scalars(ref_run, tag), tag
    assert set(_scalars(ref_run, "async/staleness").values()) == {0.0, 1.0}


@pytest.mark.system
@pytest.mark.slow
def test_kill9_mid_run_with_a_tool_calling_environment_then_resume_last_is_bitwise(tmp_path: Path) -> None:
    """The calculator example (configs/overlays/calculator.yaml: multi-turn conversations, tool calls in worker
    processes, a warm start on its demonstrations) killed at update 3 resumes from update 2 and ends where the
    uninterrupted 5-update run ends: weights, row statistics, rewards, turns and tool counts, and the tool counters
    kept in the checkpoint. (Shorter than the tiny runs above: a multi-turn update costs several rollouts.)"""
    calc = [f"--config={ROOT / 'configs' / 'overlays' / 'calculator.yaml'}", "--trainer.max_steps=5"]
    calc += ["--model.warm_start.steps=60", "--data.prompts_per_step=8", "--checkpoint.every_n_updates=2"]
    run, ref_run, _, mine, ref = _straight_killed_resumed(tmp_path, *calc, steps=5, kill_at=3, saved_at=2)
    for name, v in ref["optimizer_states"][0]["logra"]["row_stats"].items():
        assert torch.equal(mine["optimizer_states"][0]["logra"]["row_stats"][name], v), name
    counters = ref["logra_pl"]["env_state"]
    assert mine["logra_pl"]["env_state"] == counters and counters["calls"] > 0  # the policy did call the tool
    for tag in ("train/reward_mean", "env/turns", "env/tool_calls", "env/tool_errors", "kl/alpha"):
        assert _scalars(run, tag) == _scalars(ref_run, tag), tag
    assert max(_scalars(ref_run, "env/turns").values()) > 1.0


@pytest.mark.slow
def test_resume_refuses_structural_changes_and_notes_the_others(
    straight_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = str(straight_run / "checkpoints" / "last.ckpt")
    base = ["fit", f"--config={CONFIG}", *FAST, f"--trainer.logger.init_args.save_dir={tmp_path}"]
    for flags, listed in [
        (["--model.method.logra.rank=32"], "model.method.logra.rank: checkpoint 64, now 32"),
        (["--model.logra.rank=32"], "model.method.logra.rank: checkpoint 64, now 32"),  # the old flag
        (
            ["--model.method=logra_pl.methods.DenseAdamW"],
            "model.method.class_path: checkpoint 'logra_pl.methods.LoGRAMethod', now 'logra_pl.methods.DenseAdamW'",
        ),
        (
            ["--model.method.logra.rank=32", "--model.loss=ppo"],
            "model.loss.class_path: checkpoint 'logra_pl.losses.ReinforceTIS', now 'logra_pl.losses.PPOClip'",
        ),
        (["--data.seed=3"], "data.seed: checkpoint 0, now 3"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*base, f"--ckpt_path={ckpt}", "--trainer.max_steps=9", *flags])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert listed in err, err
        assert "resume as saved" in err and "start a fresh run" in err
    assert not (tmp_path / "tiny_cpu").exists()  # refused before anything ran
    # Non-structural changes are applied, and said (max_steps = the checkpoint's step: nothing left to train).
    caplog.set_level("INFO", logger="logra_pl")
    cli = LoGRACLI(args=[*base, f"--ckpt_path={ckpt}", "--trainer.max_steps=8", "--model.rollout.max_new_tokens=6"])
    assert cli.model.rollout_settings.max_new_tokens == 6  # the flag wins over the checkpoint's hyper-parameters
    assert cli.trainer.global_step == 8  # the checkpoint was restored
    assert "model.rollout.max_new_tokens: 8 → 6" in caplog.text
    assert "checkpoint.every_n_updates" not in caplog.text  # unchanged settings are not listed


def test_ckpt_path_last_with_no_checkpoint_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointNotFoundError, match=r"no last checkpoint was found; searched .*tiny_cpu/\*/checkpoints/last\*\.ckpt"
    ):
        LoGRACLI(
            args=["fit", f"--config={CONFIG}", f"--trainer.logger.init_args.save_dir={tmp_path}", "--ckpt_path=last"]
        )


def test_notebook_resume_with_another_optimizer_gets_the_listed_error(tmp_path: Path, rl_run) -> None:
    """``trainer.fit(module, ckpt_path=...)`` outside the CLI: the module compares before any state is loaded."""
    settings = dict(policy="tiny", rollout=RolloutSettings(max_new_tokens=4), microbatch_size=8)
    first = LoGRAPolicyModule(optimizer="adamw", **settings)
    trainer = rl_run(first, tmp_path, 1)
    ckpt = tmp_path / "adamw.ckpt"
    trainer.save_checkpoint(ckpt)
    # Even with the hyper-parameters stripped (an older or hand-made checkpoint), the optimizer state tells.
    raw = torch.load(ckpt, weights_only=False)
    raw.pop("hyper_parameters")
    assert raw["logra_pl"]["method"] == "logra_pl.methods.DenseAdamW"  # the class that wrote it
    recorded = tmp_path / "recorded.ckpt"
    torch.save(raw, recorded)
    second = LoGRAPolicyModule(logra=LoGRAConfig(rank=16), **settings)
    expected = "model.method: checkpoint 'logra_pl.methods.DenseAdamW', now 'logra_pl.methods.LoGRAMethod'"
    with pytest.raises(ResumeMismatchError, match=re.escape(expected)):
        rl_run(second, tmp_path, 2, ckpt_path=recorded)
    raw["logra_pl"].pop("method")
    raw["logra_pl"].pop("optimizer")
    raw["logra_pl"].pop("settings")
    torch.save(raw, ckpt)
    second = LoGRAPolicyModule(logra=LoGRAConfig(rank=16), **settings)
    with pytest.raises(ResumeMismatchError, match=re.escape("model.method: checkpoint 'adamw', now 'logra'")):
        rl_run(second, tmp_path, 2, ckpt_path=ckpt)
    third = LoGRAPolicyModule(optimizer="adamw", **{**settings, "policy": "tiny:small"})
    raw = torch.load(tmp_path / "adamw.ckpt", weights_only=False)
    with pytest.raises(ResumeMismatchError):  # stripped checkpoint: policy mismatch shows as a state-dict error
        third.on_load_checkpoint({**raw, "hyper_parameters": {"policy": "tiny", "optimizer": "adamw"}})


def test_checkpoint_files_are_written_atomically(tmp_path: Path) -> None:
    from logra_pl.callbacks.checkpoint import AtomicCheckpointIO, sweep_stale_temps

    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"x": torch.arange(3)}, target)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"x": torch.arange(5), "bad": Boom()}, target)
    assert torch.equal(torch.load(target)["x"], torch.arange(3))  # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # and the failed write left nothing
    # A write killed outright leaves its temp file; the next save in that folder removes it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".last.ckpt.tmp-{int(dead.stdout)}-0123abcd"
    stale.write_bytes(b"partial")
    assert sweep_stale_temps(tmp_path) == [stale]
    assert sorted(glob.glob(str(tmp_path / "*"))) == [str(target)]


def test_find_last_checkpoint_takes_the_newest_across_versions(tmp_path: Path) -> None:
    from logra_pl.runs.resume import find_last_checkpoint, version_of

    family = tmp_path / "runs" / "tiny_cpu"
    old = family / "version_0" / "checkpoints" / "last.ckpt"
    new = family / "version_1" / "checkpoints" / "last.ckpt"
    for path, stamp in ((old, 1_000), (new, 2_000)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (stamp, stamp))
    (family / "version_2" / "checkpoints").mkdir(parents=True)  # a later run that crashed before its first save
    assert find_last_checkpoint([family]) == new
    assert version_of(new) == 1
    sharded = family / "version_3" / "checkpoints" / "last.ckpt"
    sharded.mkdir(parents=True)
    (sharded / "meta.pt").write_bytes(b"x")
    os.utime(sharded / "meta.pt", (3_000, 3_000))
    os.utime(sharded, (3_000, 3_000))
    assert find_last_checkpoint([family]) == sharded


def test_checkpointing_off_saves_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="logra_pl")
    cli = LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            "--trainer.max_steps=2",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.val_check_interval=1",
            "--model.warm_start=null",
            "--data.train_size=64",
            "--data.eval_size=8",
            "--data.prompts_per_step=8",
            "--checkpoint.every_n_updates=1",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    assert cli.trainer.global_step == 2
    assert not list(tmp_path.rglob("*.ckpt"))  # not at updates, validations, epoch ends or the end
    assert "saves no checkpoint" in caplog.text
