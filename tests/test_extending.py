"""docs/extending.md: every example in docs/examples runs for real, and the guide lists exactly those files."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from logra_pl.cli import LoGRACLI
from logra_pl.errors import ConfigError
from logra_pl.losses import Loss
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.rollout.base import RolloutEngine
from logra_pl.rollout.registry import ENGINES
from logra_pl.sketch import LoGRAConfig

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "extending.md"
EXAMPLES = ROOT / "docs" / "examples"
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")

# A listing in the guide: the marker line, then a fenced python block holding the file's text.
LISTING = re.compile(r"<!-- file: (?P<path>[^ ]+) -->\n```python\n(?P<body>.*?)```\n", re.DOTALL)
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```\n", re.DOTALL)


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch):
    """``examples("name")`` imports docs/examples/name.py as the top-level module ``name``, as a user's code would be.

    Registrations an example or a dotted path made (engines) are removed afterwards.
    """
    monkeypatch.syspath_prepend(str(EXAMPLES))
    engines = set(ENGINES)

    def load(name: str) -> ModuleType:
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve() == EXAMPLES / f"{name}.py"
        return module

    yield load
    for name in set(ENGINES) - engines:
        ENGINES.pop(name)


def tiny_module(**overrides) -> LoGRAPolicyModule:
    settings = dict(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=4,
    )
    settings.update(overrides)
    return LoGRAPolicyModule(**settings)


def cli_run(tmp_path: Path, *flags: str) -> LoGRACLI:
    """``logra-pl fit --config configs/tiny_cpu.yaml`` for 2 updates on small data, plus ``flags``."""
    return LoGRACLI(
        args=[
            "fit",
            f"--config={CONFIG}",
            "--model.warm_start=null",
            "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.val_check_interval=100",
            "--model.rollout.max_new_tokens=3",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
            *flags,
        ]
    )


# ------------------------------------------------------------------------------------------------ the guide itself


def test_the_guide_lists_every_example_file_verbatim() -> None:
    text = GUIDE.read_text()
    listings = [(m["path"], m["body"]) for m in LISTING.finditer(text)]
    paths = [path for path, _ in listings]
    assert len(paths) == len(set(paths)), f"a file is listed twice: {paths}"
    files = sorted(p.relative_to(ROOT).as_posix() for p in EXAMPLES.glob("*.py"))
    assert sorted(paths) == files, "the guide must list every docs/examples/*.py file, and only those"
    for path, body in listings:
        assert body == (ROOT / path).read_text(), f"{path} differs from its listing in docs/extending.md"
    # A python block that opens with a module docstring is a file listing: it must carry the marker.
    listed = {m.start("body") for m in LISTING.finditer(text)}
    for block in PYTHON_BLOCK.finditer(text):
        if block.group(1).startswith('"""'):
            assert block.start(1) in listed, f"unmarked file listing in the guide: {block.group(1)[:80]!r}"


# ------------------------------------------------------------------------------------ all five examples, in Python


def test_every_example_in_one_python_run(tmp_path: Path, rl_run, examples) -> None:
    histogram_mod, k2, verifier_mod = (
        examples("reward_histogram"),
        examples("k2_loss"),
        examples("length_penalty_verifier"),
    )
    data_mod, timed = examples("arithmetic_data"), examples("timed_engine")
    with pytest.raises(ConfigError, match=r"loss\.kl_coef must lie in \[0, inf\), got -1"):
        k2.ReinforceK2(kl_coef=-1)  # the loss checks its own arguments, before any model loads
    histogram = histogram_mod.RewardHistogram(bins=4)
    data = data_mod.ArithmeticDataModule(train_size=32, eval_size=8, prompts_per_step=8)
    loss = k2.ReinforceK2(kl_coef=0.5)
    module = tiny_module(
        loss=loss,
        verifier=verifier_mod.CorrectWithLengthPenalty(per_char=0.1),
        engine=timed.TimedSettings(history=100),
    )
    trainer = rl_run(module, tmp_path, 2, callbacks=[histogram], data=data)
    ctx, metrics = module.step_context, trainer.callback_metrics

    # The callback counted every response of both updates and logged one share per bin.
    assert sum(histogram.counts) == 2 * len(ctx.rewards)
    shares = [float(metrics[f"reward_hist/{k / 4:.2f}-{(k + 1) / 4:.2f}"]) for k in range(4)]
    assert sum(shares) == pytest.approx(1.0)
    # The loss was the example's, one update per rollout (the default plan): its statistic is logged.
    assert module.loss_config is loss and isinstance(loss, Loss) and module.global_step == 2
    assert set(ctx.loss_stats) == {"k2"} and float(metrics["train/k2"]) >= 0.0
    # The prompts came from the data module, and the rewards from the verifier (run in the scoring workers).
    assert len(ctx.items) == 8 and all(it["task"] == "addition" and it in data.train_items for it in ctx.items)
    check_rewards(module)
    assert {"reward/correct", "reward/length_penalty"} <= set(metrics)
    # The engine sampled every rollout.
    engine = module.engine
    assert isinstance(engine, timed.TimedEngine) and isinstance(engine, RolloutEngine)
    assert engine.latencies.maxlen == 100 and engine.receivers == 1
    assert len(engine.latencies) == 2 and engine.tokens[-1] == ctx.rollout.num_response_tokens
    assert ctx.rollout.timings["timed_engine_s"] == engine.latencies[-1]


def check_rewards(module: LoGRAPolicyModule) -> None:
    """The last update's rewards are the configured verifier's, recomputed here from the decoded responses."""
    ctx = module.step_context
    texts = module.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    items = [ctx.items[i] for i in ctx.rollout.prompt_index]
    assert ctx.rewards.tolist() == [module.verifier(t, it) for t, it in zip(texts, items, strict=True)]
    assert module.scorer.errors == 0


# ---------------------------------------------------------------------------------------- the examples, by the CLI


def test_cli_data_source_and_verifier(tmp_path: Path, examples) -> None:
    data_mod, verifier_mod = examples("arithmetic_data"), examples("length_penalty_verifier")
    cli = cli_run(
        tmp_path,
        "--data.class_path=arithmetic_data.ArithmeticDataModule",
        "--data.init_args.train_size=64",
        "--data.init_args.eval_size=8",
        "--data.init_args.prompts_per_step=8",
        "--model.verifier.class_path=length_penalty_verifier.CorrectWithLengthPenalty",
        "--model.verifier.init_args.per_char=0.1",
    )
    data, module = cli.datamodule, cli.model
    assert isinstance(data, data_mod.ArithmeticDataModule) and len(data.train_items) == 64
    verifier = module.verifier
    assert isinstance(verifier, verifier_mod.CorrectWithLengthPenalty) and verifier.per_char == 0.1
    ctx = module.step_context
    # The last update trained on the example's items, scored by the example's verifier (in the scoring workers).
    assert len(ctx.items) == 8 and all(it["task"] == "addition" and it in data.train_items for it in ctx.items)
    check_rewards(module)
    assert {"reward/correct", "reward/length_penalty"} <= set(cli.trainer.callback_metrics)


def test_cli_callback_loss_and_engine(tmp_path: Path, examples) -> None:
    histogram_mod, k2, timed = examples("reward_histogram"), examples("k2_loss"), examples("timed_engine")
    cli = cli_run(
        tmp_path,
        "--data.train_size=64",
        "--data.eval_size=8",
        "--data.prompts_per_step=8",
        "--trainer.callbacks+=reward_histogram.RewardHistogram",
        "--trainer.callbacks.init_args.bins=2",
        "--model.loss=k2_loss.ReinforceK2",
        "--model.loss.kl_coef=0.5",
        "--model.engine.class_path=timed_engine.TimedSettings",
        "--model.engine.init_args.history=1",
    )
    module, trainer = cli.model, cli.trainer
    histograms = [cb for cb in trainer.callbacks if isinstance(cb, histogram_mod.RewardHistogram)]
    assert len(histograms) == 1 and histograms[0].bins == 2
    assert sum(histograms[0].counts) == 2 * len(module.step_context.rewards)
    assert {"reward_hist/0.00-0.50", "reward_hist/0.50-1.00"} <= set(trainer.callback_metrics)
    assert any(type(cb).__name__ == "RunSummary" for cb in trainer.callbacks)  # appended to the config's callbacks
    assert isinstance(module.loss_config, k2.ReinforceK2) and module.loss_config.kl_coef == 0.5
    assert cli.config.fit.model.loss.class_path == "k2_loss.ReinforceK2"  # the saved config names the class
    assert "train/k2" in trainer.callback_metrics
    # The engine was built from its YAML settings: it kept the last generate call only.
    assert module.engine_spec == timed.TimedSettings(history=1)
    assert isinstance(module.engine, timed.TimedEngine) and len(module.engine.latencies) == 1


# ------------------------------------------------------------------------------------- 6. an update method
def test_sgd_method_steps_exactly_and_trains_through_the_cli(examples, tmp_path: Path) -> None:
    import torch

    from logra_pl.methods.guard import DivergenceGuard

    sgd = examples("sgd_method")
    # One step on a real backward pass: W ← W − lr·G on the targets, nothing else changes.
    policy, _ = __import__("logra_pl.models.load", fromlist=["load_policy"]).load_policy("tiny")
    method = sgd.PlainSGD(lr=0.05)
    opt = method.configure_optimizers(policy, ["q_proj", "down_proj"], DivergenceGuard())
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    policy(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert sorted(grads) == sorted(method.params) and len(grads) == 4  # 2 layers × q_proj, down_proj
    result = method.step(opt, None, lambda t: t)
    assert result.rejected is None
    expected_norm = 0.05 * torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
    assert abs(result.update_norm - float(expected_norm)) < 1e-9
    for n, p in policy.named_parameters():
        want = before[n] - 0.05 * grads[n] if n in grads else before[n]
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-7), n
    # The guard refuses a step larger than its bound, and the weights stay.
    policy(input_ids=ids, labels=ids).loss.backward()
    method.guard = DivergenceGuard(max_update_ratio=1e-9)
    kept = {n: p.detach().clone() for n, p in policy.named_parameters()}
    assert method.step(opt, None, lambda t: t).rejected is not None
    assert all(torch.equal(p.detach(), kept[n]) for n, p in policy.named_parameters())

    # Through the CLI, by class_path with its own init args: it trains the target matrices of model.targets.
    cli = cli_run(
        tmp_path, "--model.method=sgd_method.PlainSGD", "--model.method.lr=0.05", "--model.targets=[q_proj,v_proj]"
    )
    module = cli.model
    assert isinstance(module.method, sgd.PlainSGD) and module.method.lr == 0.05
    assert sorted(module.method.params) == sorted(
        f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")
    )
    assert module.global_step == 2 and module.rejections.total == 0
    assert "plain SGD (lr 0.05)" in module.method.report(module.policy, module.targets)


def test_the_guides_loss_yaml_selects_the_example(tmp_path: Path, examples, monkeypatch: pytest.MonkeyPatch) -> None:
    """The YAML of section 2, as the guide prints it, over the base config: the example's loss with its argument."""
    k2 = examples("k2_loss")
    monkeypatch.setattr("sys.argv", ["logra-pl"])
    text = GUIDE.read_text().split("## 2. A loss", 1)[1].split("## 3.", 1)[0]
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL) if "class_path: k2_loss" in b]
    overlay = tmp_path / "loss.yaml"
    overlay.write_text(block)
    assert yaml.safe_load(block)["model"]["loss"]["init_args"] == {"kl_coef": 0.5}
    cli = LoGRACLI(args=["--config", CONFIG, "--config", str(overlay)], run=False)
    loss = cli.model.loss_config
    assert type(loss) is k2.ReinforceK2 and (loss.kl_coef, loss.length_reference) == (0.5, None)
    # A short name selects a built-in loss at its defaults; a class name takes arguments.
    cli = LoGRACLI(args=["--config", CONFIG, "--model.loss=PPOClip", "--model.loss.clip_eps=0.1"], run=False)
    assert repr(cli.model.loss_config) == "PPOClip(clip_eps=0.1, epochs=2, minibatches=2, length_reference=None)"
