"""HeldOutKL in a real Trainer: the KL of every update on fixed held-out responses, recomputed here from the weights
before and after each update; the contexts are evaluation problems, never trained on, and survive a resume."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from conftest import SMALL_CHAIN_SUM, chain_sum_data

from logra_pl.callbacks import BudgetSchedule, HeldOutKL, PredictedKLControl
from logra_pl.data import ReasoningGymDataModule
from logra_pl.errors import ConfigError
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.sketch import LoGRAConfig
from logra_pl.sketch.probe import realized_kl_terms
from logra_pl.train.logprobs import pack_responses

TEMPERATURE = 0.8


class Weights(pl.Callback):
    """The policy's weights before every training step and after the last one."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.trained: set[str] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.policy.state_dict().items()})
        self.trained |= {" ".join(item["question"].split()) for item in batch}

    def on_train_end(self, trainer, pl_module) -> None:
        self.states.append({k: v.clone() for k, v in pl_module.policy.state_dict().items()})


def _module() -> LoGRAPolicyModule:
    return LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=6, temperature=TEMPERATURE),
        microbatch_size=8,
    )


def _kl_here(module, state_before, state_after, contexts) -> float:
    """The held-out KL of one update, computed here: the two weight sets' logits on the contexts, full distributions."""
    packed = pack_responses(contexts["prompt_ids"], contexts["response_ids"], module.tokenizer.pad_token_id)
    logits = []
    for state in (state_before, state_after):
        module.policy.load_state_dict(state)
        with torch.no_grad():
            out = module.policy(
                input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids
            ).logits
        rows = zip(packed.starts, contexts["response_ids"], strict=True)
        logits.append(torch.cat([out[b, int(s) : int(s) + len(r)] for b, (s, r) in enumerate(rows)]))
    return float(realized_kl_terms(logits[0], logits[1], TEMPERATURE).mean())


def test_heldout_kl_is_the_kl_of_each_update_on_fixed_evaluation_responses(tmp_path, rl_run) -> None:
    pl.seed_everything(0)
    module = _module()
    heldout = HeldOutKL(prompts=4, responses_per_prompt=2, seed=3)
    weights = Weights()
    kl = PredictedKLControl(BudgetSchedule("constant", delta_max=1e-3), alpha_max=1e3, calibrate=True)
    data = chain_sum_data()
    rl_run(module, tmp_path, 3, callbacks=[kl, heldout, weights], data=data)
    contexts = heldout.contexts
    assert len(contexts["response_ids"]) == 8 and all(contexts["response_ids"])
    # The prompts are the data module's first evaluation problems: outside every loss.
    evaluation = {" ".join(item["question"].split()) for item in data.eval_items[:4]}
    decoded = {" ".join(module.tokenizer.decode(p, skip_special_tokens=True).split()) for p in contexts["prompt_ids"]}
    assert all(any(q in text for q in evaluation) for text in decoded)
    assert not evaluation & weights.trained
    assert len(heldout.history) == 3
    for step, measured in enumerate(heldout.history):
        want = _kl_here(module, weights.states[step], weights.states[step + 1], contexts)
        assert want > 0 and measured == pytest.approx(want, rel=1e-5)  # float32 log-probs kept
    # Held to a budget on its own batch, the update moves held-out contexts by a KL of the same order, not the same.
    assert all(0.05 < h / r["realized"] < 20 for h, r in zip(heldout.history, kl.history, strict=True))
    assert all(not math.isclose(h, r["realized"]) for h, r in zip(heldout.history, kl.history, strict=True))


def test_max_positions_cuts_the_responses(tmp_path, rl_run) -> None:
    heldout = HeldOutKL(prompts=4, responses_per_prompt=2, max_positions=9)
    rl_run(_module(), tmp_path, 1, callbacks=[heldout])
    assert sum(len(r) for r in heldout.contexts["response_ids"]) == 9 and len(heldout.history) == 1


def test_contexts_travel_with_the_checkpoint() -> None:
    saved = HeldOutKL(prompts=2)
    saved.contexts = {"prompt_ids": [[5, 6, 7]], "response_ids": [[8, 9]]}
    saved.history = [1e-4, 2e-4]
    restored = HeldOutKL(prompts=2)
    restored.load_state_dict(saved.state_dict())
    assert restored.contexts == saved.contexts and restored.history == saved.history


def test_a_data_module_without_evaluation_problems_is_refused(tmp_path, rl_run) -> None:
    data = ReasoningGymDataModule({"chain_sum": {"config": SMALL_CHAIN_SUM}}, train_size=64, eval_size=0)
    with pytest.raises(ConfigError, match="eval_items"):
        rl_run(_module(), tmp_path, 1, callbacks=[HeldOutKL()], data=data)
