"""The dense baseline's update norm, recomputed from AdamW's state, equals the before/after difference."""

from __future__ import annotations

import math

import pytest
import torch

from logra_pl.methods.adamw import AdamWConfig, adamw_update_norm


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_update_norm_equals_weight_difference(weight_decay: float) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(16))]
    opt, sched = AdamWConfig(lr=1e-2, weight_decay=weight_decay).build(params)
    for _ in range(4):
        loss = sum((p**3).sum() for p in params)
        loss.backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        opt.zero_grad()
        diffs = [float((p.detach() - b).double().square().sum()) for p, b in zip(params, before, strict=True)]
        expected = math.sqrt(sum(diffs))
        assert adamw_update_norm(opt) == pytest.approx(expected, rel=1e-5)
        sched.step()
    amsgrad = torch.optim.AdamW(params, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        adamw_update_norm(amsgrad)


def test_logra_optimizer_keeps_no_merged_proposal_alive(qwen2_factory) -> None:
    """After ``step()`` the optimizer holds no reference to the merged proposal: its directions and the projections
    it was made with (the sketcher has drawn the next ones) are freed unless someone else (a step controller
    calibrating the update) holds it, and then ``last_proposal`` still names it."""
    import gc
    import weakref

    from logra_pl.methods.logra import LoGRAOptimizer
    from logra_pl.sketch import LoGRAConfig, LoGRASketcher

    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, LoGRAConfig.paper(rank=4, update_ratio=1e-3))  # a new P every update
    opt = LoGRAOptimizer(sketcher)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))

    def step(held: list) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        # During the closure: the proposal, and a weak reference to the projections it was made with.
        opt.step(closure=lambda: held.extend([opt.proposal, weakref.ref(sketcher.groups[0].projection)]))

    held: list = []
    step(held)
    proposal, projections = held
    assert opt.last_payload is not None and opt.last_proposal is proposal  # held here: still named
    assert projections() is not sketcher.groups[0].projection  # the next update's P is drawn
    assert projections() is not None  # kept alive by the proposal
    del held, proposal
    gc.collect()
    assert opt.last_proposal is None and projections() is None  # nothing kept the proposal or its projections
    step([])
    assert opt.last_payload is not None and opt.last_proposal is None
