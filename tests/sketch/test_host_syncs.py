"""propose() and apply() read device values on the host once each, not once per matrix (see logra_pl.sketch.host)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from logra_pl.sketch import LoGRAConfig, LoGRASketcher, lifted_sq_norm, projection_gram
from logra_pl.sketch import sketcher as sketcher_module
from logra_pl.sketch.host import host_values


class CountScalarReads(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense``: every ``float(t)``, ``bool(t)``, ``t.item()`` (a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_host_values_equal_float_of_each_tensor() -> None:
    groups = (
        [torch.tensor(True), torch.tensor(False)],
        [torch.tensor(0.1, dtype=torch.float32), torch.tensor(float("inf"))],
        [],
        [torch.tensor(0.1, dtype=torch.float64), torch.tensor([float("nan")], dtype=torch.float64)],
    )
    values = host_values(*groups)
    assert [len(v) for v in values] == [2, 2, 0, 1 + 1]
    for group, got in zip(groups, values, strict=True):
        for t, v in zip(group, got, strict=True):
            expected = float(t)
            assert (math.isnan(v) and math.isnan(expected)) or v == expected
    assert host_values() == [] and host_values([]) == [[]]


def test_lifted_norm_from_gram_is_the_same_value() -> None:
    gen = torch.Generator().manual_seed(0)
    d, p = torch.randn(30, 8, generator=gen), torch.randn(8, 50, generator=gen)
    assert torch.equal(lifted_sq_norm(d, p), lifted_sq_norm(d, gram=projection_gram(p)))
    with pytest.raises(ValueError, match="Gram"):
        lifted_sq_norm(d)


@pytest.mark.parametrize("dense_params", [(), ("*norm.weight",)])
def test_one_host_transfer_each_in_propose_and_apply(qwen2_factory, monkeypatch, dense_params) -> None:
    model = qwen2_factory(seed=0)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=8, dense_params=dense_params))
    calls: list[int] = []

    def counted(*groups):
        calls.append(sum(len(g) for g in groups))
        return host_values(*groups)

    monkeypatch.setattr(sketcher_module, "host_values", counted)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        reads = CountScalarReads()
        with reads:
            proposal = sketcher.propose()
            assert proposal is not None and len(calls) == 1
            assert sketcher.apply(proposal) is not None and len(calls) == 2
        assert reads.count == 0  # no per-matrix float(t) left
        calls.clear()
    assert sketcher.num_applied == 2 and not sketcher._grams  # the Gram matrices live for one update only
