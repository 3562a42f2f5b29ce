"""``logra_pl/train/batching.py`` and ``logra_pl/train/step.py``'s pure parts, without a Trainer: microbatch plans,
row selection, padded log-probs, prompt encoding and the step context a rollout becomes."""

from __future__ import annotations

import torch

from logra_pl.rollout.base import Rollout
from logra_pl.train.batching import encode_prompts, microbatches, padded_logprobs, select_rows
from logra_pl.train.logprobs import pack_responses
from logra_pl.train.sampler import sampling_seed
from logra_pl.train.step import assemble_step


def _packed(lengths: list[tuple[int, int]]):
    prompts = [list(range(3, 3 + p)) for p, _ in lengths]
    responses = [list(range(50, 50 + r)) for _, r in lengths]
    return pack_responses(prompts, responses, pad_token_id=0), prompts, responses


def test_row_count_plan_is_consecutive_groups() -> None:
    assert microbatches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert microbatches([5, 1, 4], 8) == [[5, 1, 4]]


def test_token_budget_plan_keeps_rows_times_longest_within_budget() -> None:
    packed, _, _ = _packed([(2, 1), (2, 2), (9, 9), (2, 1), (2, 1)])  # row lengths 3, 4, 18, 3, 3
    plan = microbatches(list(range(5)), 4, budget=20, packed=packed)
    assert plan == [[0, 1], [2], [3, 4]]
    lengths = packed.attention_mask.sum(dim=1).tolist()
    for group in plan:  # the budget holds for every group of more than one row (a long row alone may exceed it)
        assert len(group) == 1 or len(group) * max(lengths[r] for r in group) <= 20
    assert microbatches(list(range(5)), 1, budget=1000, packed=packed) == [[0], [1], [2], [3], [4]]  # size still caps


def test_select_rows_and_trim_drop_only_padding() -> None:
    packed, prompts, responses = _packed([(2, 1), (5, 3), (2, 2)])
    out = select_rows(packed, [2, 0], trim=True)
    assert out.input_ids.shape == (2, 4)  # the longest selected row: 2 + 2 tokens
    assert out.input_ids[0, :4].tolist() == prompts[2] + responses[2]
    assert out.input_ids[1, :3].tolist() == prompts[0] + responses[0]
    assert torch.equal(out.response_mask, packed.response_mask[[2, 0]])  # response columns stay
    assert select_rows(packed, [1]).input_ids.shape == packed.input_ids[[1]].shape


def test_padded_logprobs_fill_each_row_from_column_zero_in_the_given_dtype() -> None:
    like = torch.zeros(3, 4, dtype=torch.float64)
    out = padded_logprobs([[-0.5], [-1.25, -2.0, -0.1], []], like)
    assert out.dtype == torch.float64
    assert out.tolist() == [[-0.5, 0, 0, 0], [-1.25, -2.0, -0.1, 0], [0, 0, 0, 0]]
    assert padded_logprobs([[0.1]], torch.zeros(1, 2)).dtype == torch.float32


def test_encode_prompts_uses_the_chat_template_without_extra_special_tokens(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    items = [{"messages": [{"role": "user", "content": "2 + 3 = ?"}]}]
    (ids,) = encode_prompts(tok, items)
    text = tok.apply_chat_template(items[0]["messages"], add_generation_prompt=True, tokenize=False)
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text


def test_assemble_step_packs_the_rollout_and_asks_the_trainer_once() -> None:
    rollout = Rollout(
        prompt_ids=[[3, 4], [5]],
        response_ids=[[7, 8, 2], [9]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
        finish_reasons=["stop", "length"],
        prompt_index=[0, 1],
    )
    calls = []

    def trainer_logprobs(packed, temperature):
        calls.append((packed.input_ids.tolist(), temperature))
        return torch.full_like(packed.response_mask, -1.0)

    ctx = assemble_step(4, [{}, {}], rollout, torch.ones(2), torch.zeros(2), 0, trainer_logprobs, 0.7)
    assert calls == [([[3, 4, 7, 8, 2], [5, 9, 0, 0, 0]], 0.7)]
    assert ctx.update_index == 4 and ctx.temperature == 0.7
    assert torch.equal(ctx.logp_rollout, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))
    assert ctx.eos_terminated.tolist() == [True, False]


def test_sampling_seeds_depend_on_split_update_and_key_only() -> None:
    a = sampling_seed(0, "train", 3, "2 + 2")
    assert a == sampling_seed(0, "train", 3, "2 + 2") and 0 <= a < 2**48
    assert (
        len(
            {
                a,
                sampling_seed(1, "train", 3, "2 + 2"),
                sampling_seed(0, "val0", 3, "2 + 2"),
                sampling_seed(0, "train", 4, "2 + 2"),
                sampling_seed(0, "train", 3, "2 + 3"),
            }
        )
        == 5
    )
