"""``EngineLink`` without a Trainer: what each method sends a real HF engine, and the stale-engine repair rules."""

from __future__ import annotations

import torch
from helpers.optim import StepThrough

from logra_pl.errors import StaleEngineError
from logra_pl.methods import DenseAdamW, LoGRAMethod
from logra_pl.methods.guard import DivergenceGuard
from logra_pl.models.load import load_policy
from logra_pl.rollout.base import Rollout, SamplingConfig, StaleableEngine, SyncReport
from logra_pl.rollout.hf import HFEngine
from logra_pl.sketch import LoGRAConfig
from logra_pl.train.engine_link import EngineLink


def _lm_backward(policy: torch.nn.Module, seed: int) -> None:
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(seed))
    policy(input_ids=ids, labels=ids).loss.backward()


def test_logra_payload_and_dense_tensors_keep_a_real_engine_equal(tiny_model_dir) -> None:
    for method in (LoGRAMethod(LoGRAConfig(rank=16, update_ratio=1e-2)), DenseAdamW()):
        policy, tok = load_policy(str(tiny_model_dir))
        engine = HFEngine(policy, tok.eos_token_id, tok.pad_token_id)
        link = EngineLink(engine, method, policy)
        built = method.configure_optimizers(policy, ["q_proj", "up_proj"], DivergenceGuard())
        opt = built["optimizer"] if isinstance(built, dict) else built
        sched = built["lr_scheduler"]["scheduler"] if isinstance(built, dict) else None
        for update in range(2):
            _lm_backward(policy, update)
            result = method.step(StepThrough(opt), sched, lambda t: t)
            assert result.rejected is None and result.update_norm > 0
            assert (result.payload is not None) == method.ships_factors
            change = "factors" if method.ships_factors else "tensors"
            reports, seconds = link.send(change, [result.payload]).result()
            assert len(reports) == 1 and reports[0].bytes > 0 and seconds >= 0
        mine, theirs = policy.state_dict(), engine.model.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), type(method).__name__
        changed = [k for k in mine if not torch.equal(mine[k], load_policy(str(tiny_model_dir))[0].state_dict()[k])]
        assert changed and all(k.endswith(("q_proj.weight", "up_proj.weight")) for k in changed)


class _Served:
    """An engine that can go stale, as a served one does: it refuses to generate until it is fully loaded."""

    context_limit, shares_weights, receivers = 1 << 20, False, 1

    def __init__(self) -> None:
        self.never_synced, self.current, self.loads, self.refusals = True, False, 0, 0

    def check_current(self) -> bool:
        return self.current

    def stale_engines(self) -> list[str]:
        return [] if self.current else ["http://engine-0"]

    def generate(self, prompts, sampling, prompt_seeds=None) -> Rollout:
        if not self.current:
            self.refusals += 1
            raise StaleEngineError("engine holds other weights")
        return Rollout(
            [p for p in prompts],
            [[1] for _ in prompts],
            [[-0.5] for _ in prompts],
            ["stop"] * len(prompts),
            list(range(len(prompts))),
        )

    def load_weights(self, tensors) -> SyncReport:
        self.loads += 1
        self.never_synced, self.current = False, True
        return SyncReport(bytes=sum(t.numel() * t.element_size() for t in tensors.values()))

    def apply_payload(self, payload) -> SyncReport:
        return SyncReport(bytes=0)

    def place(self, device) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_stale_engine_is_repaired_and_only_repairs_are_counted(tiny_model_dir) -> None:
    policy, _ = load_policy(str(tiny_model_dir))
    engine = _Served()
    assert isinstance(engine, StaleableEngine)
    link = EngineLink(engine, DenseAdamW(), policy)
    sampling = SamplingConfig(max_new_tokens=1)
    assert len(link.generate([[3, 4]], sampling)) == 1
    assert engine.loads == 1 and link.resyncs == 0  # the first full load is not a repair
    engine.current = False  # an update was lost
    link.generate([[3, 4]], sampling)
    assert engine.loads == 2 and link.resyncs == 1 and engine.refusals == 0
    # An engine that refuses even after a full load: three tries, then the error names it.
    engine.generate = lambda *a, **k: (_ for _ in ()).throw(StaleEngineError("still other weights"))
    try:
        link.generate([[3]], sampling)
    except StaleEngineError as err:
        assert "3 full resyncs" in str(err) and "still other weights" in str(err)
    else:
        raise AssertionError("a permanently stale engine must stop the run")
