"""ReasoningGymDataModule: weighted, deduplicated, eval-disjoint chat prompts from real reasoning-gym tasks."""

from __future__ import annotations

import pytest
import reasoning_gym

from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import ConfigError

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def test_mixture_sizes_dedup_and_disjoint_splits() -> None:
    dm = ReasoningGymDataModule(
        {"chain_sum": {"weight": 3.0, "config": SMALL}, "leg_counting": {"weight": 1.0}},
        train_size=400,
        eval_size=40,
        prompts_per_step=16,
        seed=3,
        system_prompt="simple",
    )
    dm.setup()
    tasks = [it["metadata"]["source_dataset"] for it in dm.train_items]
    assert tasks.count("chain_sum") == 300 and tasks.count("leg_counting") == 100
    assert len(dm.eval_items) == 40
    train_q = [it["question"] for it in dm.train_items]
    eval_q = [it["question"] for it in dm.eval_items]
    assert len(set(train_q)) == len(train_q) and len(set(eval_q)) == len(eval_q)
    assert not set(train_q) & set(eval_q)
    first = dm.train_items[0]["messages"]
    assert first[0] == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["simple"]}
    assert first[-1] == {"role": "user", "content": dm.train_items[0]["question"]}
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, list) and len(batch) == 16 and "answer" in batch[0]
    assert len(next(iter(dm.val_dataloader()))) == 40


def test_seeded_and_reproducible() -> None:
    a = ReasoningGymDataModule(["chain_sum"], train_size=50, eval_size=10, prompts_per_step=8, seed=1)
    b = ReasoningGymDataModule(["chain_sum"], train_size=50, eval_size=10, prompts_per_step=8, seed=1)
    c = ReasoningGymDataModule(["chain_sum"], train_size=50, eval_size=10, prompts_per_step=8, seed=2)
    for dm in (a, b, c):
        dm.setup()
    assert [i["question"] for i in a.train_items] == [i["question"] for i in b.train_items]
    assert [i["question"] for i in a.train_items] != [i["question"] for i in c.train_items]
    assert [x["question"] for x in next(iter(a.train_dataloader()))] == [
        x["question"] for x in next(iter(b.train_dataloader()))
    ]


def test_shuffle_seed_changes_the_prompt_stream_only() -> None:
    """``shuffle_seed`` gives each seed of an experiment its own training order over the same problems and the same
    held-out set; unset, the order follows ``seed`` as before."""
    kwargs = {"train_size": 64, "eval_size": 10, "prompts_per_step": 8, "seed": 0}
    base = ReasoningGymDataModule(["chain_sum"], **kwargs)
    same = ReasoningGymDataModule(["chain_sum"], shuffle_seed=0, **kwargs)
    other = ReasoningGymDataModule(["chain_sum"], shuffle_seed=1, **kwargs)
    for dm in (base, same, other):
        dm.setup()
    assert [i["question"] for i in other.eval_items] == [i["question"] for i in base.eval_items]
    assert sorted(i["question"] for i in other.train_items) == sorted(i["question"] for i in base.train_items)

    def stream(dm: ReasoningGymDataModule) -> list[str]:
        return [x["question"] for batch in dm.train_dataloader() for x in batch]

    assert stream(same) == stream(base)
    assert stream(other) != stream(base) and set(stream(other)) <= {i["question"] for i in base.train_items}
    with pytest.raises(ConfigError, match="shuffle_seed"):
        ReasoningGymDataModule(["chain_sum"], shuffle_seed=-1, **kwargs)


def test_unknown_task_lists_available() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reasoning-gym task\(s\) \['chain_summ'\]; available tasks: .*chain_sum"
    ):
        ReasoningGymDataModule(["chain_summ"])


def test_empty_dataset_is_a_clear_error() -> None:
    # One-digit two-term sums have ~200 distinct questions; asking for more than exist after the eval split
    # leaves fewer distinct training problems than one step needs.
    tiny_space = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    dm = ReasoningGymDataModule(
        {"chain_sum": {"config": tiny_space}}, train_size=500, eval_size=190, prompts_per_step=64
    )
    with pytest.raises(ValueError, match=r"only \d+ distinct training problems.*fewer than prompts_per_step=64"):
        dm.setup()


def test_bad_task_entries() -> None:
    with pytest.raises(ValueError, match="unknown keys \\['wieght'\\]"):
        ReasoningGymDataModule({"chain_sum": {"wieght": 2}})
    with pytest.raises(ValueError, match="weight must be > 0"):
        ReasoningGymDataModule({"chain_sum": {"weight": 0}})
    with pytest.raises(ValueError, match="nothing to validate"):
        dm = ReasoningGymDataModule(["chain_sum"], train_size=20, eval_size=0, prompts_per_step=4)
        dm.setup()
        dm.val_dataloader()


def test_module_and_data_seeds_may_differ_with_a_logger(tmp_path) -> None:
    """``model.seed`` and ``data.seed`` are independent: Lightning's hparams merge refused differing ``seed`` values
    when both were logged (seeding the sampling without changing the prompts, as benchmarks/ablate.py does)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from logra_pl.module import LoGRAPolicyModule
    from logra_pl.train.settings import RolloutSettings

    module = LoGRAPolicyModule(policy="tiny", seed=1, rollout=RolloutSettings(max_new_tokens=4), microbatch_size=4)
    data = ReasoningGymDataModule(["chain_sum"], train_size=16, eval_size=4, prompts_per_step=4, seed=0)
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=TensorBoardLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    assert module.hparams["seed"] == 1 and data.hparams["seed"] == 0


def test_eval_tune_fraction_tags_a_fixed_even_split() -> None:
    """``eval_tune_fraction=0.5``: every second eval problem is a tuning one, the same problems in every build; 0
    (the default) tags nothing and leaves the problems themselves unchanged."""
    from logra_pl.data.loaders import tag_eval_subsets
    from logra_pl.errors import ConfigError

    kwargs = {"train_size": 50, "eval_size": 10, "prompts_per_step": 8, "seed": 1}
    split = ReasoningGymDataModule(["chain_sum"], eval_tune_fraction=0.5, **kwargs)
    plain = ReasoningGymDataModule(["chain_sum"], **kwargs)
    split.setup()
    plain.setup()
    assert [it["eval_subset"] for it in split.eval_items] == ["report", "tune"] * 5
    assert all("eval_subset" not in it for it in plain.eval_items)
    assert [it["question"] for it in split.eval_items] == [it["question"] for it in plain.eval_items]
    assert [it["question"] for it in split.train_items] == [it["question"] for it in plain.train_items]
    items = [{"id": str(i)} for i in range(10)]
    tag_eval_subsets(items, 0.3)  # floor(10 * 0.3) = 3 tuning items, spread through the order
    assert [i for i, it in enumerate(items) if it["eval_subset"] == "tune"] == [3, 6, 9]
    with pytest.raises(ConfigError, match="eval_tune_fraction"):
        ReasoningGymDataModule(["chain_sum"], eval_tune_fraction=1.0, **kwargs)
