"""The profiler ranges of the sketch core: each of LoGRA's phases is found by name in a torch profiler recording,
once per call, and costs nothing when no profiler records."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile

from logra_pl.models import load_policy
from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.sketch.probe import logit_tangent
from logra_pl.sketch.trace import traced


def test_each_phase_is_a_named_range_once_per_call(tiny_model_dir) -> None:
    model, _ = load_policy(tiny_model_dir, dtype=torch.float32)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=4, update_ratio=1e-3))
    matrices = len(sketcher.matrices)
    gen = torch.Generator().manual_seed(0)
    microbatches = [torch.randint(0, model.config.vocab_size, (2, 9), generator=gen) for _ in range(3)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in microbatches:
            model(input_ids=ids, labels=ids).loss.backward()
        proposal = sketcher.propose()
        assert proposal is not None
        modules = {name: m.module for name, m in sketcher.matrices.items()}
        logit_tangent(model, modules, proposal, {"input_ids": microbatches[0]})
        assert sketcher.apply(proposal) is not None
        with torch.no_grad():  # a rollout-like forward: the hook does not project, so no range
            model(input_ids=microbatches[0])
    counts = Counter(e.name for e in prof.events() if e.name.startswith("logra."))
    assert counts == {
        "logra.sketch.project": matrices * len(microbatches),
        "logra.sketch.accumulate": matrices * len(microbatches),
        "logra.propose": 1,
        "logra.kl_probe": 1,
        "logra.apply": 1,
    }
    assert matrices > 1


def test_no_range_is_opened_while_nothing_records() -> None:
    assert isinstance(traced("logra.sketch.project"), nullcontext)
    with profile(activities=[ProfilerActivity.CPU]):
        assert not isinstance(traced("logra.sketch.project"), nullcontext)
    assert isinstance(traced("logra.sketch.project"), nullcontext)


def test_a_cost_count_hears_the_ranges_without_a_profiler(tiny_model_dir) -> None:
    """``listening()``: every range opened by the sketch core is on ``open_ranges()`` while it runs (what
    ``benchmarks/update_cost.py`` charges calls to), nested ones innermost last; nothing is kept outside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from logra_pl.sketch import trace

    seen: Counter[tuple[str, ...]] = Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[trace.open_ranges()] += 1
            return func(*args, **(kwargs or {}))

    model, _ = load_policy(tiny_model_dir, dtype=torch.float32)
    sketcher = LoGRASketcher(model, LoGRAConfig(rank=4, update_ratio=1e-3))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert trace.open_ranges() == ()
    with Record(), trace.listening():
        model(input_ids=ids, labels=ids).loss.backward()
        with traced("outer"):
            assert trace.open_ranges() == ("outer",)
            sketcher.propose()
    assert trace.open_ranges() == ()  # listening ended: the stack is gone
    assert {r for r in seen if r} == {
        ("logra.sketch.project",),
        ("logra.sketch.accumulate",),
        ("outer", "logra.propose"),
    }
    assert seen[()] > 0  # the layers' own calls belong to no range
