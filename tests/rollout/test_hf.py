"""HFEngine: exact sampled-token log-probs, seeded sampling, its own weights, updated by payloads."""

from __future__ import annotations

import pytest
import torch

from logra_pl.models import load_policy
from logra_pl.rollout.base import RolloutEngine, SamplingConfig
from logra_pl.rollout.hf import HFEngine, top_p_filter
from logra_pl.sketch import LoGRAConfig, LoGRASketcher
from logra_pl.train.logprobs import pack_responses, response_logprobs


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def _prompts(tok) -> list[list[int]]:
    questions = ["1 + 2 =", "What is 4 - 3 + 5?", "State the final answer: 9 - 9 ="]
    return [
        tok(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for q in questions
    ]


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0)])
def test_engine_logprobs_equal_trainer(policy, temperature: float, top_p: float) -> None:
    model, tok = policy
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=4)
    assert isinstance(engine, RolloutEngine)
    rollout = engine.generate(
        _prompts(tok), SamplingConfig(n=3, temperature=temperature, top_p=top_p, max_new_tokens=10, seed=3)
    )
    assert len(rollout) == 9 and rollout.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    packed = pack_responses(rollout.prompt_ids, rollout.response_ids, tok.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(model, packed, temperature if temperature > 0 else 1.0)
    for b, lps in enumerate(rollout.logprobs):
        assert len(lps) == len(rollout.response_ids[b]) >= 1
        torch.testing.assert_close(trainer[b, : len(lps)], torch.tensor(lps), rtol=0, atol=2e-5)
    for resp, reason in zip(rollout.response_ids, rollout.finish_reasons, strict=True):
        assert (reason == "stop") == (resp[-1] == tok.eos_token_id)
        assert reason == "stop" or len(resp) == 10


def test_sampling_is_seeded(policy) -> None:
    model, tok = policy
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    a = engine.generate(_prompts(tok), SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=11))
    b = engine.generate(_prompts(tok), SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=11))
    c = engine.generate(_prompts(tok), SamplingConfig(n=4, temperature=1.0, max_new_tokens=8, seed=12))
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.01)).tolist() == [[True, False, False, False]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_engine_copy_is_private_and_follows_payloads(policy) -> None:
    model, tok = policy
    trainer_model = type(model)(model.config)
    trainer_model.load_state_dict(model.state_dict())
    engine = HFEngine(trainer_model, tok.eos_token_id, tok.pad_token_id)
    sketcher = LoGRASketcher(trainer_model, LoGRAConfig(rank=8, update_ratio=1e-2))
    ids = torch.tensor(_prompts(tok)[0]).unsqueeze(0)
    for _ in range(3):
        trainer_model(input_ids=ids, labels=ids).loss.backward()
        payload = sketcher.step()
        engine_weight = engine.model.model.layers[0].self_attn.q_proj.weight
        assert not torch.equal(engine_weight, trainer_model.model.layers[0].self_attn.q_proj.weight)
        engine.apply_payload(payload)
        for (name, a), b in zip(trainer_model.state_dict().items(), engine.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    # The engine's copy carries no sketch hooks: generating never touches the trainer's sketches.
    engine.generate(_prompts(tok), SamplingConfig(max_new_tokens=3))
    assert all(float(s.abs().sum()) == 0 for s in sketcher.sketches().values())


def test_prompt_longer_than_context_is_a_clear_error(policy) -> None:
    model, tok = policy
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1 has {limit} tokens.*exceeds the engine's context of {limit}"):
        engine.generate([[1, 2], [5] * limit], SamplingConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], SamplingConfig(max_new_tokens=4))


def test_prompt_seeds_make_sampling_layout_independent(policy) -> None:
    """The same prompt with the same seed gets the same responses alone, in a batch, or split across calls."""
    model, tok = policy
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=2)
    prompts = _prompts(tok)
    seeds = [101, 202, 303]
    cfg = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    together = engine.generate(prompts, cfg, prompt_seeds=seeds)
    split = [engine.generate([p], cfg, prompt_seeds=[s]) for p, s in zip(prompts, seeds, strict=True)]
    assert together.response_ids == [r for part in split for r in part.response_ids]
    reordered = engine.generate(prompts[::-1], cfg, prompt_seeds=seeds[::-1])
    assert reordered.response_ids[:2] == together.response_ids[4:]
    with pytest.raises(ValueError, match="2 prompt seeds for 3 prompts"):
        engine.generate(prompts, cfg, prompt_seeds=[1, 2])
