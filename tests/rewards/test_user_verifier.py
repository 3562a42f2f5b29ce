"""A verifier from the user's own module, outside the package, chosen in YAML by class_path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from logra_pl.cli import LoGRACLI
from tests.helpers.cli import quick_fit_args

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def test_a_plain_user_class_is_the_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "my_rewards.py").write_text(
        textwrap.dedent(
            '''
            class ShortAnswer:
                """1 for a response of at most `limit` characters (nothing subclassed, nothing imported)."""

                def __init__(self, limit: int = 2) -> None:
                    self.limit = limit

                def __call__(self, response, item):
                    return 1.0 if len(response.strip()) <= self.limit else 0.0
            '''
        )
    )
    monkeypatch.syspath_prepend(str(package))
    cli = LoGRACLI(
        args=[
            *quick_fit_args(2, tmp_path / "runs", max_new_tokens=3),
            "--model.verifier.class_path=my_rewards.ShortAnswer",
            "--model.verifier.init_args.limit=1",
        ]
    )
    module = cli.model
    assert type(module.verifier).__module__ == "my_rewards" and module.verifier.limit == 1
    # The rewards the run trained on are the user's: recompute them from the last rollout's texts.
    ctx = module.step_context
    texts = module.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    assert ctx.rewards.tolist() == [1.0 if len(t.strip()) <= 1 else 0.0 for t in texts]
    assert module.scorer.errors == 0


def test_a_verifier_that_cannot_be_called_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LoGRACLI(
            args=[
                "fit",
                f"--config={CONFIG}",
                "--model.verifier.class_path=logra_pl.data.ReasoningGymDataModule",
                f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
            ]
        )
    assert "ReasoningGymDataModule does not implement protocol Verifier" in capsys.readouterr().err
