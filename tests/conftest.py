"""Shared fixtures: tiny real transformers models, built offline."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Before transformers/huggingface_hub are imported: they read these once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from helpers.machine import MachineShare
from transformers import Qwen2Config, Qwen2ForCausalLM

# pytest-timeout's default (pyproject.toml) fits the fast tier, so a new slow test there is a decision; a system-tier
# test without a timeout of its own gets this one (FSDP ranks, engine restarts and kill -9 resumes take minutes).
SYSTEM_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each ``system`` test without its own ``timeout`` mark the system tier's limit."""
    for item in items:
        if item.get_closest_marker("system") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SYSTEM_TIMEOUT_S))


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)  # set on pytest-xdist's workers only
    if worker is not None:
        config.stash[_SHARE] = MachineShare(Path(tempfile.gettempdir()) / f"logra-pl-tests-{worker['testrunuid']}")


_SHARE = pytest.StashKey[MachineShare]()


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Take this test's share of the machine around its whole protocol (module fixtures set up in its setup
    included), outside pytest-timeout's clock: waiting for another worker's ``cores(2)`` test is not this test's
    time."""
    share = item.config.stash.get(_SHARE, None)
    if share is None:
        return (yield)
    marker = item.get_closest_marker("cores")
    with share.hold(exclusive=marker is not None and marker.args[0] >= 2):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build models into a per-session cache unless the caller chose one (CI reuses ~/.cache/logra-pl)."""
    if "LOGRA_PL_CACHE" not in os.environ:
        os.environ["LOGRA_PL_CACHE"] = str(tmp_path_factory.mktemp("logra-cache"))
    return Path(os.environ["LOGRA_PL_CACHE"])


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: int) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 (2 layers, head_dim 64, grouped-query attention) in eval mode (no dropout)."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)).to(dtype)
    return model.eval()


@pytest.fixture
def qwen2_factory():
    """Build tiny random Qwen2 models: ``qwen2_factory(seed=..., **config_overrides)``."""
    return tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model_dir(_cache_dir: Path) -> Path:
    """The ``tiny`` preset built once per session (tokenizer trained on reasoning-gym text)."""
    from logra_pl.models import build_tiny_model

    return build_tiny_model("tiny")


SMALL_CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def chain_sum_data(train_size: int = 128, eval_size: int = 16, prompts_per_step: int = 8):
    """Short ``chain_sum`` problems (answers of 1-3 tokens) as a data module, the tests' usual RL data."""
    from logra_pl.data import ReasoningGymDataModule

    return ReasoningGymDataModule(
        {"chain_sum": {"config": SMALL_CHAIN_SUM}},
        train_size=train_size,
        eval_size=eval_size,
        prompts_per_step=prompts_per_step,
        eval_batch_size=eval_size,
    )


def quick_trainer(root: Path, steps: int, callbacks=(), **overrides):
    """A one-process CPU Trainer for ``steps`` updates: no logger, checkpoints, progress bar or validation."""
    import lightning.pytorch as pl

    settings = dict(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=list(callbacks),
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


@pytest.fixture(scope="session")
def rl_run():
    """``rl_run(module, root, steps, callbacks=(), ckpt_path=None, data=None, **trainer_overrides) -> Trainer``."""

    def run(module, root: Path, steps: int, callbacks=(), ckpt_path=None, data=None, **overrides):
        trainer = quick_trainer(root, steps, callbacks, **overrides)
        # Our checkpoints hold settings objects (dataclasses) besides tensors: load them in full.
        weights_only = False if ckpt_path else None
        trainer.fit(module, datamodule=data or chain_sum_data(), ckpt_path=ckpt_path, weights_only=weights_only)
        return trainer

    return run
