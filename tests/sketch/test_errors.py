"""Bad input gets an error that names the offending module or value and the fix."""

from __future__ import annotations

import pytest

from logra_pl.sketch import LoGRAConfig, LoGRAConfigError, LoGRASketcher, make_projection


def test_target_matching_nothing(qwen2_factory) -> None:
    with pytest.raises(LoGRAConfigError, match=r"\['qkv_proj'\] match no module.*q_proj"):
        LoGRASketcher(qwen2_factory(), LoGRAConfig(targets=("q_proj", "qkv_proj")))


def test_non_linear_target(qwen2_factory) -> None:
    with pytest.raises(LoGRAConfigError, match=r"'input_layernorm'.*Qwen2RMSNorm.*only nn.Linear"):
        LoGRASketcher(qwen2_factory(), LoGRAConfig(targets=("q_proj", "input_layernorm")))


@pytest.mark.parametrize("rank", [0, -3, 2.5, True])
def test_rank_not_positive_integer(rank) -> None:
    with pytest.raises(LoGRAConfigError, match=f"rank must be a positive integer, got {rank!r}"):
        LoGRAConfig(rank=rank)


def test_rank_above_d_in(qwen2_factory) -> None:
    # hidden 128, intermediate 192: down_proj has d_in 192, the attention/gate/up projections 128.
    with pytest.raises(LoGRAConfigError, match=r"logra.rank=160 exceeds d_in=128 of 'model.layers.0.self_attn.q_proj'"):
        LoGRASketcher(qwen2_factory(), LoGRAConfig(rank=160))
    LoGRASketcher(qwen2_factory(), LoGRAConfig(rank=160, targets=("down_proj",)))  # 160 <= 192 is fine
    with pytest.raises(LoGRAConfigError, match="exceeds the input dimension 10"):
        make_projection(0, 11, 10)


def test_unknown_distribution() -> None:
    with pytest.raises(LoGRAConfigError, match="unknown projection distribution 'uniform'"):
        LoGRAConfig(distribution="uniform")
    with pytest.raises(LoGRAConfigError, match="unknown projection distribution 'sparse'"):
        make_projection(0, 2, 4, "sparse")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"update_rule": "lion"}, "unknown update_rule 'lion'"),
        ({"step_mode": "auto"}, "unknown step_mode 'auto'"),
        ({"beta2": 1.0}, "beta2 must lie in"),
        ({"factor_dtype": "int8"}, "unknown factor_dtype 'int8'"),
        ({"targets": ()}, "targets must be a non-empty list"),
        ({"update_ratio": 0.0}, r"update_ratio must lie in \(0, inf\)"),
        ({"update_ratio": float("nan")}, "update_ratio must be a finite number"),
    ],
)
def test_other_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(LoGRAConfigError, match=message):
        LoGRAConfig(**kwargs)


def test_unknown_config_keys_named() -> None:
    with pytest.raises(LoGRAConfigError, match=r"unknown LoGRA config keys \['rnak'\]"):
        LoGRAConfig.from_dict({"rnak": 8})
    assert LoGRAConfig.from_dict(LoGRAConfig(rank=4).to_dict()) == LoGRAConfig(rank=4)


def test_stale_proposal_is_refused(qwen2_factory) -> None:
    sketcher = LoGRASketcher(qwen2_factory(), LoGRAConfig(rank=4))
    proposal = sketcher.propose()
    sketcher.apply(proposal)
    with pytest.raises(ValueError, match="proposal for update 0 applied at update 1"):
        sketcher.apply(proposal)
