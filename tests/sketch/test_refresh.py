"""``logra.refresh_every`` (algorithm.md §2): a new projection every N updates; ``refresh`` stays its old spelling.

The seeds are checked against the spec's rule written out here: projection index ``(u // N)·N`` (``0`` for
``N = 0``), then ``projection_seed(base, index, name)``; the old rule was ``u if refresh else 0``.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save as st_save

from logra_pl.errors import ResumeMismatchError
from logra_pl.runs.resume import check_resume
from logra_pl.sketch import LoGRAConfig, LoGRAConfigError, LoGRASketcher, Payload, projection_seed
from logra_pl.sketch.payload import PAYLOAD_FORMAT
from logra_pl.sketch.projection import projection_index

NAME = "model.layers.1.mlp.down_proj"
OLD_HEADER_KEYS = ["format", "update_index", "base_seed", "rank", "distribution", "refresh", "alpha"]


def _spec_index(u: int, every: int) -> int:
    return 0 if every == 0 else u - u % every


def test_projection_index_steps_every_n_updates() -> None:
    assert [projection_index(u, 1) for u in range(5)] == [0, 1, 2, 3, 4]
    assert [projection_index(u, 3) for u in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert [projection_index(u, 0) for u in range(4)] == [0, 0, 0, 0]
    assert all(projection_index(u, n) == _spec_index(u, n) for u in range(50) for n in range(7))


@pytest.mark.parametrize(
    ("refresh", "every", "resolved"),
    [(None, None, 0), (True, None, 1), (False, None, 0), (None, 0, 0), (None, 1, 1), (None, 7, 7), (True, 7, 7)],
)
def test_both_spellings_resolve(refresh, every, resolved: int) -> None:
    cfg = LoGRAConfig(refresh=refresh, refresh_every=every)
    assert cfg.refresh_every == resolved and cfg.refresh is (resolved != 0)
    assert LoGRAConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg, rank=8).refresh_every == resolved  # what with_targets and friends do
    # N = 0 or 1 writes the dict of before the setting (checkpoints unchanged); N >= 2 adds refresh_every.
    assert ("refresh_every" in cfg.to_dict()) is (resolved >= 2)


@pytest.mark.parametrize(("refresh", "every"), [(False, 3), (False, 1), (True, 0)])
def test_contradicting_spellings_are_refused_naming_both(refresh: bool, every: int) -> None:
    with pytest.raises(LoGRAConfigError, match=rf"logra\.refresh={refresh} contradicts logra\.refresh_every={every}"):
        LoGRAConfig(refresh=refresh, refresh_every=every)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_refresh_every_is_refused(bad) -> None:
    with pytest.raises(LoGRAConfigError, match="refresh_every must be a non-negative integer"):
        LoGRAConfig(refresh_every=bad)


def _step(model, sketcher: LoGRASketcher, seed: int):
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    payload = sketcher.step()
    assert payload is not None
    return payload


@pytest.mark.parametrize("every", [0, 1, 3])
def test_sketcher_and_payload_change_seeds_exactly_every_n_updates(qwen2_factory, every: int) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8, base_seed=4, refresh_every=every, distribution="hadamard"))
    installed = []
    for u in range(7):
        assert sketcher.update_index == u
        assert sketcher.seed_for(NAME) == projection_seed(4, _spec_index(u, every), NAME)
        installed.append(sketcher.matrices[NAME].projection)
        if u % 2:  # skipped updates count too: the index is the update attempt's
            sketcher.skip("test")
            continue
        payload = _step(model, sketcher, u)
        assert payload.refresh_every == every
        received = Payload.from_bytes(payload.to_bytes())
        assert received.refresh_every == every
        for name in payload.factors:
            assert received.seed(name) == payload.seed(name) == projection_seed(4, _spec_index(u, every), name)
    # A new P object only when the seed changed (the sketcher draws each basis once).
    fresh = [u for u in range(1, 7) if installed[u] is not installed[u - 1]]
    assert fresh == {0: [], 1: [1, 2, 3, 4, 5, 6], 3: [3, 6]}[every]


def _old_payload_bytes(refresh: bool, update_index: int) -> bytes:
    """A payload as written before refresh_every existed (the header of that version, key for key)."""
    header = {"format": PAYLOAD_FORMAT, "update_index": update_index, "base_seed": 2, "rank": 2}
    header |= {"distribution": "rademacher", "refresh": refresh, "alpha": 1.0}
    return st_save({NAME: torch.ones(3, 2, dtype=torch.bfloat16)}, metadata={"logra": json.dumps(header)})


@pytest.mark.parametrize("refresh", [True, False])
def test_old_payload_bytes_mean_what_they_meant(refresh: bool) -> None:
    old = Payload.from_bytes(_old_payload_bytes(refresh, 5))
    assert old.refresh_every == (1 if refresh else 0)
    assert old.seed(NAME) == projection_seed(2, 5 if refresh else 0, NAME)  # the old rule
    # And a payload at N = 0 or 1 writes those bytes again: nothing an older receiver cannot read.
    new = Payload({NAME: torch.ones(3, 2, dtype=torch.bfloat16)}, 5, 2, 2, "rademacher", refresh_every=int(refresh))
    assert new.to_bytes() == _old_payload_bytes(refresh, 5)
    assert list(new.header()) == OLD_HEADER_KEYS


def test_payload_carries_refresh_every_and_checks_it() -> None:
    factors = {NAME: torch.ones(3, 2, dtype=torch.bfloat16)}
    payload = Payload(factors, 7, 2, 2, "hadamard", refresh=True, refresh_every=3)
    assert payload.header()["refresh_every"] == 3 and payload.seed(NAME) == projection_seed(2, 6, NAME)
    assert Payload.from_bytes(payload.to_bytes()).seed(NAME) == projection_seed(2, 6, NAME)
    with pytest.raises(ValueError, match="contradicts"):
        Payload(factors, 7, 2, 2, "hadamard", refresh=False, refresh_every=3)
    header = {**payload.header(), "refresh_every": -2}
    with pytest.raises(ValueError, match="refresh_every must be a non-negative integer"):
        Payload.from_bytes(st_save(factors, metadata={"logra": json.dumps(header)}))


def test_checkpoints_of_either_spelling_resume_and_n_is_structural(qwen2_factory) -> None:
    model = qwen2_factory(seed=2)
    saved = LoGRASketcher(model, LoGRAConfig(rank=8, refresh=True)).state_dict()
    assert "refresh_every" not in saved["config"] and saved["config"]["refresh"] is True  # the old dict
    LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh_every=1)).load_state_dict(saved)
    other = LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh_every=10))
    with pytest.raises(LoGRAConfigError, match=r"refresh_every: checkpoint 1 vs current 10"):
        other.load_state_dict(saved)
    fixed = copy.deepcopy(saved)
    fixed["config"]["refresh"] = False
    LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh_every=0)).load_state_dict(fixed)
    LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8)).load_state_dict(fixed)  # today's default: one basis
    with pytest.raises(LoGRAConfigError, match=r"refresh_every: checkpoint 0 vs current 1"):
        LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh=True)).load_state_dict(fixed)
    with pytest.raises(LoGRAConfigError, match=r"refresh_every: checkpoint 1 vs current 0"):
        LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8)).load_state_dict(saved)  # a run of the old default
    every3 = LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh_every=3)).state_dict()
    assert every3["config"]["refresh_every"] == 3
    with pytest.raises(LoGRAConfigError, match=r"refresh_every: checkpoint 3 vs current 1"):
        LoGRASketcher(qwen2_factory(seed=2), LoGRAConfig(rank=8, refresh=True)).load_state_dict(every3)


def test_run_settings_compare_across_spellings() -> None:
    """The CLI's resume check: an old run's ``refresh: true`` is ``refresh_every: 1``; saying neither is today's
    default, one fixed basis (``refresh: false``, ``refresh_every: 0``), which such a run must now write out."""
    old = {"model": {"logra": {"rank": 64, "refresh": True}}}
    for now in ({"refresh_every": 1}, {"refresh": True}, {"refresh": True, "refresh_every": None}):
        check_resume(old, {"model": {"logra": {"rank": 64, **now}}})
    with pytest.raises(ResumeMismatchError, match=r"model\.method\.logra\.refresh_every: checkpoint 1, now 0"):
        check_resume(old, {"model": {"logra": {"rank": 64}}})
    with pytest.raises(ResumeMismatchError, match=r"model\.method\.logra\.refresh_every: checkpoint 1, now 10"):
        check_resume(old, {"model": {"logra": {"rank": 64, "refresh_every": 10}}})
    fixed = {"model": {"logra": {"rank": 64, "refresh": False}}}
    for now in ({}, {"refresh": None, "refresh_every": None}, {"refresh_every": 0}):
        check_resume(fixed, {"model": {"logra": {"rank": 64, **now}}})
    with pytest.raises(ResumeMismatchError, match=r"model\.method\.logra\.refresh_every: checkpoint 0, now 1"):
        check_resume(fixed, {"model": {"logra": {"rank": 64, "refresh_every": 1}}})


def test_resume_mid_period_reproduces_the_uninterrupted_run(qwen2_factory, tmp_path) -> None:
    """Hadamard, N = 3, stopped at update 2 (inside the first period) and resumed: the same bits as straight."""
    cfg = LoGRAConfig(rank=8, base_seed=3, update_ratio=1e-3, distribution="hadamard", refresh_every=3)
    straight = qwen2_factory(seed=0)
    s1 = LoGRASketcher(straight, cfg)
    for i in range(5):
        _step(straight, s1, i)
    first = qwen2_factory(seed=0)
    s2 = LoGRASketcher(first, cfg)
    for i in range(2):
        _step(first, s2, i)
    torch.save({"model": first.state_dict(), "logra": s2.state_dict()}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = qwen2_factory(seed=0)
    resumed.load_state_dict(ckpt["model"])
    s3 = LoGRASketcher(resumed, LoGRAConfig.from_dict(ckpt["logra"]["config"]))
    s3.load_state_dict(ckpt["logra"])
    assert s3.matrices[NAME].seed == projection_seed(3, 0, NAME)  # update 2 still uses update 0's basis
    for i in range(2, 5):
        _step(resumed, s3, i)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_first_moment_is_carried_only_when_the_basis_changes(qwen2_factory, monkeypatch) -> None:
    """With ``beta1 > 0`` and ``N = 3``, the moment moves to a new basis at updates 3 and 6 only, and with a
    Hadamard ``P`` (``P Pᵀ = (d_in/r)·I``) the least-squares carry is ``m · P_old P_newᵀ · r/d_in``."""
    import logra_pl.sketch.groups as groups_module

    original = groups_module.transfer_moment
    calls: list[int] = []

    def counting(moment, old, new, squared=False):  # a stack of a group's matrices at a time
        assert not squared, "RowAdam keeps no per-entry second moment to carry"
        calls.extend([sketcher.update_index] * moment.shape[0])
        carried = original(moment, old, new)
        scale = old.shape[-2] / old.shape[-1]
        expected = moment.double() @ (old.double() @ new.double().mT) * scale
        torch.testing.assert_close(carried.double(), expected, rtol=1e-5, atol=1e-9)
        return carried

    monkeypatch.setattr(groups_module, "transfer_moment", counting)
    model = qwen2_factory(seed=1)
    cfg = LoGRAConfig(
        rank=8, update_rule="rowadam", beta1=0.9, moment_dtype="float32", update_ratio=1e-3, distribution="hadamard",
        refresh_every=3,
    )  # fmt: skip
    sketcher = LoGRASketcher(model, cfg)
    for u in range(7):
        _step(model, sketcher, u)
    matrices = len(sketcher.matrices)
    assert calls == [3] * matrices + [6] * matrices
