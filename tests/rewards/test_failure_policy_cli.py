"""Verifiers of a user's own module through ``logra-pl fit --config configs/tiny_cpu.yaml``: one that raises on every
call, one that returns NaN and one that hangs stop the run (exit ≠ 0) within 3 updates, in at most 10 console lines
that name the verifier and its first error; one that returns 5.0 is logged as 5.0 and trained on, and one that fails
on some responses trains on the others only."""

from __future__ import annotations

import glob
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from logra_pl.cli import LoGRACLI

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = [
    "--trainer.enable_progress_bar=false",
    "--model.warm_start=null",
    "--data.train_size=64",
    "--data.eval_size=8",
    "--data.eval_batch_size=8",
    "--data.prompts_per_step=8",
    "--model.rollout.max_new_tokens=4",
]
USER_MODULE = textwrap.dedent(
    '''
    import time


    class RaisesAlways:
        def __call__(self, response, item):
            raise ValueError("no answer key in this item")


    class ReturnsNaN:
        def __call__(self, response, item):
            return float("nan")


    class Hangs:
        def __call__(self, response, item):
            time.sleep(600)
            return 1.0


    class FiveNeverRight:
        """5.0 for every response; its own verdict: never correct (pass@1 follows it, not the threshold)."""

        def __call__(self, response, item):
            return 5.0

        def correct(self, response, item, reward):
            return False


    class FailsOnEveryThirdLength:
        """Raises when the response's length is a multiple of 3, else its length (a real-valued reward)."""

        def __call__(self, response, item):
            if len(response) % 3 == 0:
                raise RuntimeError(f"cannot score {response!r}")
            return float(len(response))
    '''
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "my_verifiers.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    return folder


def _scalars(save_dir: Path) -> dict[str, list[tuple[int, float]]]:
    files = glob.glob(str(save_dir / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(sorted(files)[-1])
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("verifier", "first_error", "kind"),
    [
        ("RaisesAlways", "ValueError: no answer key in this item", "errors"),
        ("ReturnsNaN", "returned nan", "nan"),
        ("Hangs", "no reward within scoring.timeout_s = 1 s", "timeouts"),
    ],
)
def test_a_broken_verifier_stops_the_run(
    user_module: Path, tmp_path: Path, verifier: str, first_error: str, kind: str
) -> None:
    script = Path(sys.executable).with_name("logra-pl")  # the console script a user runs
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "logra_pl.cli"]
    args = [*command, "fit", f"--config={CONFIG}", *SMALL]
    args += ["--trainer.max_steps=10", "--trainer.val_check_interval=100", "--checkpoint.every_n_updates=1"]
    args += [f"--model.verifier.class_path=my_verifiers.{verifier}", "--model.scoring.timeout_s=1"]
    args += [f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(user_module)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = done.stdout.splitlines()
    assert done.returncode != 0, done.stdout[-3000:]
    # Everything printed once training started (the model summary's last line is "LoGRA trains ...").
    start = next(k for k, line in enumerate(lines) if line.startswith("LoGRA trains"))
    after = lines[start + 1 :]
    assert len(after) <= 10, "\n".join(after)
    text = "\n".join(after)
    stop = next(line for line in after if line.startswith("logra-pl: stopped: the verifier"))
    assert f"my_verifiers.{verifier}" in stop and "2 updates in a row" in stop
    assert first_error in text
    if kind == "errors":  # the first failure's traceback, down to the user's own line
        assert 'raise ValueError("no answer key in this item")' in text and "my_verifiers.py" in text
    # One summary line per update, each naming the kind; the run stopped at update 2 (of at most 3).
    summaries = [line for line in after if re.match(r"update \d+: \d+ of 8 responses have no reward", line)]
    assert [int(line.split()[1].rstrip(":")) for line in summaries] == [1, 2]
    assert all(f"{kind} " in line for line in summaries)
    # The last checkpoint is update 1's: the failing update 2 trained nothing and wrote nothing.
    (ckpt,) = glob.glob(str(tmp_path / "runs" / "**" / "last.ckpt"), recursive=True)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == 1 and state["logra_pl"]["failed_in_a_row"] == 1
    scalars = _scalars(tmp_path / "runs")
    assert scalars["verifier/failure_rate"] == [(0, 1.0)]
    assert scalars[f"verifier/{kind}"][0][1] >= 4  # at least the share that made the update certain to fail


def test_a_verifier_returning_five_is_logged_and_trained_on(user_module: Path, tmp_path: Path) -> None:
    cli = LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            *SMALL,
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--model.verifier.class_path=my_verifiers.FiveNeverRight",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    scalars = _scalars(tmp_path / "runs")
    assert scalars["train/reward_mean"] == [(0, 5.0), (1, 5.0), (2, 5.0)]  # not clamped to 1.0
    assert all(norm > 0 for _, norm in scalars["train/update_norm"])  # trained on
    assert cli.model.method.applied_updates == 3 and cli.model.step_context.all_scored
    assert [v for _, v in scalars["val/reward_mean"]] == [5.0]
    assert [v for _, v in scalars["val/pass@1"]] == [0.0]  # 5.0 ≥ the threshold 1.0, but the verifier says not correct
    assert scalars["verifier/failure_rate"] == [(0, 0.0), (1, 0.0), (2, 0.0)]


def test_responses_the_verifier_fails_on_are_left_out(user_module: Path, tmp_path: Path) -> None:
    cli = LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            *SMALL,
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=100",
            "--model.scoring.max_failure_rate=1.0",
            "--model.scoring.max_failed_updates=5",
            "--model.verifier.class_path=my_verifiers.FailsOnEveryThirdLength",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    module = cli.model
    ctx = module.step_context
    texts = module.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    failed = [len(t) % 3 == 0 for t in texts]
    assert ctx.scored.tolist() == [not f for f in failed]
    for k, text in enumerate(texts):
        if failed[k]:
            assert math.isnan(ctx.rewards[k]) and ctx.advantages[k] == 0.0 and ctx.loss_mask[k].sum() == 0
        else:
            assert ctx.rewards[k] == float(len(text))
    scored = [float(len(t)) for t, f in zip(texts, failed, strict=True) if not f]
    scalars = _scalars(tmp_path / "runs")
    step, mean = scalars["train/reward_mean"][-1]
    assert step == 1 and mean == pytest.approx(sum(scored) / len(scored) if scored else math.nan, nan_ok=True)
    assert scalars["verifier/failure_rate"][-1][1] == pytest.approx(sum(failed) / len(failed))
    assert module.method.applied_updates == 2
