"""The dense baseline's update norm, recomputed from AdamW's state, equals the before/after difference."""

from __future__ import annotations

import math

import pytest
import torch

from logra_pl.optim import AdamWConfig, adamw_update_norm


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
