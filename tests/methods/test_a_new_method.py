"""A new update method is one file: written into a package of the test's own (nothing of logra-pl touched), it trains,
is planned by ``logra-pl plan``, checkpoints and resumes through the CLI, bit for bit."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from logra_pl.cli import LoGRACLI
from logra_pl.errors import ResumeMismatchError
from logra_pl.methods.memory_plan import main as plan_main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
LR = "--model.method.lr=0.05"

# The whole method: heavy-ball SGD on the target matrices, with a momentum buffer (state a resume must restore), its
# memory plan and one option of its own for `logra-pl plan`.
METHOD = '''
"""Heavy-ball SGD on the module's target matrices."""

from __future__ import annotations

import math

import torch

from logra_pl.config import register
from logra_pl.methods import StepResult, UpdateMethod
from logra_pl.methods.base import relative
from logra_pl.sketch import select_targets
from logra_pl.sketch.memory import MemoryReport


@register("heavy_ball")
class HeavyBall(UpdateMethod):
    """``v ← μ·v + G``, ``W ← W − lr·v`` on the target matrices."""

    name = "heavy_ball"

    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        self.lr, self.momentum = lr, momentum
        self.params: dict[str, torch.nn.Parameter] = {}

    @classmethod
    def plan_options(cls, parser):
        parser.add_argument("--heavy-ball-momentum", type=float, default=0.9, help="0: no buffer")

    @classmethod
    def planned(cls, settings):
        return cls(momentum=settings.options.get("heavy_ball_momentum", 0.9))

    def configure_optimizers(self, policy, targets, guard):
        policy.requires_grad_(False)
        self.params = {f"{n}.weight": m.weight.requires_grad_(True) for n, m in select_targets(policy, targets).items()}
        self.guard = guard
        return torch.optim.SGD(list(self.params.values()), lr=self.lr, momentum=self.momentum)

    def step(self, optimizer, scheduler, all_reduce_sum):
        before = [p.detach().clone() for p in self.params.values()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sq = sum(float((p.detach() - b).double().square().sum()) for p, b in zip(self.params.values(), before))
        return StepResult(None, math.sqrt(sq))

    def trained_tensors(self, policy):
        return {name: p.detach() for name, p in self.params.items()}

    def changed_numel(self, policy):
        return sum(p.numel() for p in self.params.values())

    def plan_memory(self, shapes):
        grads = sum(shapes.shard_bytes(m.weight) for m in shapes.matrices.values())
        return MemoryReport(weights=shapes.weights, gradients=grads, optimizer_state=grads if self.momentum else 0)

    def trained_parameter_count(self, policy):
        return self.changed_numel(policy)

    def report(self, policy, targets):
        return f"heavy-ball SGD (lr {self.lr:g}, momentum {self.momentum:g}) on {', '.join(targets)}"
'''


@pytest.fixture
def new_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The method's file in a package of the test's own, importable; its dotted class path."""
    package = tmp_path / "my_methods"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "heavy_ball.py").write_text(textwrap.dedent(METHOD))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_methods.heavy_ball.HeavyBall"


def fit(save_dir: Path, path: str, steps: int, *flags: str) -> LoGRACLI:
    return LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            "--model.warm_start=null",
            f"--trainer.max_steps={steps}",
            "--trainer.enable_progress_bar=false",
            "--trainer.val_check_interval=100",
            "--model.rollout.max_new_tokens=3",
            f"--trainer.logger.init_args.save_dir={save_dir}",
            f"--model.method={path}",
            *flags,
        ]
    )


def test_a_method_in_its_own_file_trains_plans_checkpoints_and_resumes(
    new_method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Planned: `logra-pl plan` lists it beside the built-in ones, with its own option, and counts its buffer.
    plan_main(["--model", "tiny", "--method", "adamw", "--method", new_method, "--json", str(tmp_path / "p.json")])
    table = capsys.readouterr().out
    assert new_method in table and "adamw" in table
    plan_main(["--model", "tiny", "--method", new_method, "--heavy-ball-momentum", "0", "--json", str(tmp_path / "q")])
    with_buffer = json.loads((tmp_path / "p.json").read_text())[new_method]
    without = json.loads((tmp_path / "q").read_text())[new_method]
    assert with_buffer["optimizer_state"] == with_buffer["gradients"] > 0 and without["optimizer_state"] == 0

    # Trained through the CLI for 3 updates, checkpointing after update 2; resumed from there, it ends bit for bit
    # where the run did (the checkpoint of a run cut off mid-way: the one every resume test uses).
    keep = ("--checkpoint.every_n_updates=2", "--checkpoint.save_top_k=-1")
    straight = fit(tmp_path / "straight", new_method, 3, LR, *keep)
    assert type(straight.model.method).__name__ == "HeavyBall" and straight.model.global_step == 3
    ckpt = Path(straight.trainer.checkpoint_callback.dirpath) / "update=2.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["logra_pl"]["method"] == new_method  # the checkpoint says which method wrote it
    assert saved["optimizer_states"][0]["state"], "the momentum buffers are in the checkpoint"
    resumed = fit(tmp_path / "resumed", new_method, 3, LR, f"--ckpt_path={ckpt}")
    assert resumed.model.global_step == 3
    want = straight.model.policy.state_dict()
    for name, tensor in resumed.model.policy.state_dict().items():
        assert torch.equal(tensor, want[name]), f"{name} differs after the resume"
    # A resume under another method is refused, naming both.
    with pytest.raises((SystemExit, ResumeMismatchError)) as refused:
        fit(tmp_path / "other", "sgd", 3, f"--ckpt_path={ckpt}")
    said = capsys.readouterr().err + str(refused.value)
    assert "model.method" in said and "HeavyBall" in said, said
