"""LoGRA state round-trips through a checkpoint; a mismatched config is refused with a clear message."""

from __future__ import annotations

import copy

import pytest
import torch

from logra_pl.sketch import LoGRAConfig, LoGRAConfigError, LoGRASketcher


def _update(model, sketcher: LoGRASketcher, seed: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    assert sketcher.step() is not None


def test_resume_reproduces_uninterrupted_run(qwen2_factory, tmp_path) -> None:
    cfg = LoGRAConfig.paper(rank=8, base_seed=11, update_ratio=1e-3)
    straight = qwen2_factory(seed=0)
    s1 = LoGRASketcher(straight, cfg)
    for i in range(4):
        _update(straight, s1, i)

    first = qwen2_factory(seed=0)
    s2 = LoGRASketcher(first, cfg)
    for i in range(2):
        _update(first, s2, i)
    torch.save({"model": first.state_dict(), "logra": s2.state_dict()}, tmp_path / "ckpt.pt")

    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = qwen2_factory(seed=0)
    resumed.load_state_dict(ckpt["model"])
    s3 = LoGRASketcher(resumed, copy.deepcopy(cfg))
    s3.load_state_dict(ckpt["logra"])
    assert s3.update_index == 2 and s3.num_applied == 2
    assert all(torch.equal(s3.row_stats[n], v) for n, v in s2.row_stats.items())
    for i in range(2, 4):
        _update(resumed, s3, i)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    for name in s1.row_stats:
        assert torch.equal(s1.row_stats[name], s3.row_stats[name])


def test_state_holds_everything(qwen2_factory) -> None:
    model = qwen2_factory(seed=1)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=8, base_seed=5))
    _update(model, sketcher, 0)
    state = sketcher.state_dict()
    assert state["config"]["base_seed"] == 5 and state["config"]["rank"] == 8
    assert state["update_index"] == 1 and state["num_applied"] == 1 and state["num_skipped"] == 0
    assert set(state["row_stats"]) == set(sketcher.matrices)
    assert all(float(v.abs().sum()) > 0 for v in state["row_stats"].values())


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"rank": 4}, "rank"),
        ({"base_seed": 1}, "base_seed"),
        ({"distribution": "gaussian"}, "distribution"),
        ({"distribution": "hadamard"}, "distribution"),
        ({"refresh_every": 2}, "refresh_every"),
        ({"refresh": False}, "refresh_every"),
        ({"targets": ("q_proj", "v_proj")}, "targets"),
    ],
)
def test_mismatched_config_is_refused(qwen2_factory, change: dict, word: str) -> None:
    model = qwen2_factory(seed=2)
    saved = LoGRASketcher(model, LoGRAConfig.paper(rank=8)).state_dict()
    other = LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig.paper(**{"rank": 8, **change}))
    with pytest.raises(LoGRAConfigError, match=word):
        other.load_state_dict(saved)
    assert other.update_index == 0  # nothing half-loaded


def test_state_of_another_model_is_refused(qwen2_factory) -> None:
    saved = LoGRASketcher(qwen2_factory(seed=3), LoGRAConfig.paper(rank=8)).state_dict()
    other = LoGRASketcher(qwen2_factory(seed=3, num_hidden_layers=1), LoGRAConfig.paper(rank=8))
    with pytest.raises(LoGRAConfigError, match="matrices differ"):
        other.load_state_dict(saved)
    wider = LoGRASketcher(qwen2_factory(seed=3, intermediate_size=256), LoGRAConfig.paper(rank=8))
    with pytest.raises(LoGRAConfigError, match="shape"):
        wider.load_state_dict(saved)
