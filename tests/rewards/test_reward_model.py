"""RewardModelVerifier: a real (tiny, random, offline) Qwen2ForSequenceClassification scoring responses — batched
scores against an independent forward, normalisation, heads, errors, and 3 updates through ``logra-pl fit``."""

from __future__ import annotations

import glob
import math
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from logra_pl.cli import LoGRACLI
from logra_pl.errors import ConfigError
from logra_pl.rewards import BoundedVerifier, RewardModelVerifier, WeightedRewards
from logra_pl.rewards.reward_model import RunningMoments, prompt_text
from tests.helpers.cli import quick_fit_args

RESPONSES = ["4", "the sum is 12", "<answer>7</answer>", "", "1 + 2 + 3 = 6, so 6", "x"]


def _close(expected: object) -> object:
    """Equal to float32 rounding (a batched forward sums in another order than one sequence alone)."""
    return pytest.approx(expected, rel=1e-5, abs=1e-5)


def _item(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}], "answer": "4", "task": "t", "id": question}


ITEMS = [_item(q) for q in ("2 + 2?", "5 + 7?", "3 + 4?", "1 + 1?", "1 + 2 + 3?", "9 - 9?")]


def _build(folder: Path, tokenizer_dir: Path, num_labels: int = 1, head_std: float = 5.0) -> Path:
    """A random tiny Qwen2 reward model (a decoder with a scalar head) and the project's offline tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        id2label={i: f"label_{i}" for i in range(num_labels)},
        label2id={f"label_{i}": i for i in range(num_labels)},
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a wide head: scores far outside [0, 1], so a clamp would show
        model.score.weight.normal_(0.0, head_std)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("rm"), tiny_model_dir)


def _independent_scores(folder: Path, chat: bool, index: int = 0) -> list[float]:
    """Each response alone, no padding: the backbone's last hidden state at the last token, times the head — written
    here from the model's parts, not through the verifier or the model's own pooling."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen2ForSequenceClassification.from_pretrained(folder).eval()
    out = []
    for response, item in zip(RESPONSES, ITEMS, strict=True):
        if chat:
            conversation = [*item["messages"], {"role": "assistant", "content": response}]
            ids = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
            ids = ids.input_ids
        else:
            ids = tokenizer(item["messages"][0]["content"], response).input_ids
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            out.append(float(hidden @ model.score.weight[index]))
    return out


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "text-pair"])
def test_batched_scores_equal_an_independent_forward(rm_dir: Path, chat: bool) -> None:
    expected = _independent_scores(rm_dir, chat)
    assert max(abs(s) for s in expected) > 1.0  # real-valued: a clamp to [0, 1] would change them
    for batch_size in (1, 4, len(RESPONSES)):  # one by one, ragged batches (right padding), one batch
        verifier = RewardModelVerifier(str(rm_dir), device="cpu", batch_size=batch_size, chat_template=chat)
        assert verifier.score_batch(RESPONSES, ITEMS) == _close(expected)
    assert verifier(RESPONSES[1], ITEMS[1]) == _close(expected[1])


def test_through_the_runner_in_process_with_correctness(rm_dir: Path) -> None:
    expected = _independent_scores(rm_dir, chat=True)
    verifier = RewardModelVerifier(str(rm_dir), device="cpu", batch_size=4)
    with BoundedVerifier(verifier, timeout_s=5.0, workers=2, correct_threshold=0.5) as bounded:
        scores = bounded.run(RESPONSES, ITEMS)
        assert not bounded._pool.started  # scored in this process, once per batch: no model in any worker
    assert scores.rewards == _close(expected)
    assert scores.correct == [s >= 0.5 for s in scores.rewards]
    assert scores.failed == 0


def test_fixed_and_running_normalisation(rm_dir: Path) -> None:
    raw = _independent_scores(rm_dir, chat=True)
    fixed = RewardModelVerifier(str(rm_dir), device="cpu", normalize="fixed", mean=1.5, std=4.0)
    assert fixed.score_batch(RESPONSES, ITEMS) == _close([(s - 1.5) / 4.0 for s in raw])

    running = RewardModelVerifier(str(rm_dir), device="cpu", normalize="running")
    first = running.score_batch(RESPONSES[:2], ITEMS[:2])
    second = running.score_batch(RESPONSES[2:], ITEMS[2:])

    def standardised(seen: list[float], batch: list[float]) -> list[float]:  # plain two-pass mean and std
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((v - mean) ** 2 for v in seen) / len(seen))
        return [(v - mean) / std for v in batch]

    assert first == _close(standardised(raw[:2], raw[:2]))
    assert second == _close(standardised(raw, raw[2:]))  # statistics of every score so far
    # The statistics are state: a verifier restored from it normalises the next batch exactly as the first one does.
    restored = RewardModelVerifier(str(rm_dir), device="cpu", normalize="running")
    restored.load_state_dict(running.state_dict())
    assert restored.score_batch(RESPONSES[:3], ITEMS[:3]) == running.score_batch(RESPONSES[:3], ITEMS[:3])
    assert RewardModelVerifier(str(rm_dir), normalize="none").state_dict() == {}


def test_running_moments_merge_batches_exactly() -> None:
    values = [3.0, -1.5, 2.25, 10.0, 0.0, -7.0, 1.0]
    moments = RunningMoments()
    for batch in (values[:1], values[1:4], [], values[4:]):
        moments.add(batch)
    mean = sum(values) / len(values)
    assert moments.count == len(values)
    assert moments.mean == pytest.approx(mean, abs=1e-12)
    assert moments.std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)), abs=1e-12)


def test_a_multi_output_head_needs_its_label(rm_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _build(tmp_path / "two", tiny_model_dir, num_labels=2)
    with pytest.raises(ConfigError, match=r"has 2 outputs \(\['label_0', 'label_1'\]\): name the one to read"):
        RewardModelVerifier(str(folder), device="cpu").score_batch(RESPONSES[:1], ITEMS[:1])
    by_name = RewardModelVerifier(str(folder), device="cpu", label="label_1").score_batch(RESPONSES, ITEMS)
    by_index = RewardModelVerifier(str(folder), device="cpu", label=1).score_batch(RESPONSES, ITEMS)
    assert by_name == by_index == _close(_independent_scores(folder, chat=True, index=1))
    with pytest.raises(ConfigError, match="has no label 'good'"):
        RewardModelVerifier(str(folder), device="cpu", label="good").score_batch(RESPONSES[:1], ITEMS[:1])


def test_a_missing_model_stops_the_run_with_its_reason(tmp_path: Path) -> None:
    missing = RewardModelVerifier(str(tmp_path / "no_such_rm"), device="cpu")
    with BoundedVerifier(missing, timeout_s=5.0) as bounded, pytest.raises(ConfigError, match="no such folder"):
        bounded.run(["x"], [ITEMS[0]])  # not one response's failure: the run stops at once
    with pytest.raises(ConfigError, match="std must lie in"):
        RewardModelVerifier("x", normalize="fixed", std=0.0)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        RewardModelVerifier("x", dtype="float8")


def test_a_copy_never_carries_the_loaded_model(rm_dir: Path) -> None:
    import pickle

    verifier = RewardModelVerifier(str(rm_dir), device="cpu")
    verifier.score_batch(RESPONSES[:1], ITEMS[:1])
    assert verifier._loaded is not None
    assert pickle.loads(pickle.dumps(verifier))._loaded is None  # hyper-parameters in checkpoints stay small


def test_weighted_rewards_with_a_reward_model_part_score_in_batches(rm_dir: Path) -> None:
    from logra_pl.rewards import ExactMatch

    raw = _independent_scores(rm_dir, chat=True)
    combined = WeightedRewards(
        {"rm": RewardModelVerifier(str(rm_dir), device="cpu"), "exact": ExactMatch()},
        {"rm": 0.5, "exact": 2.0},
        correct_part="exact",
    )
    assert callable(combined.score_batch)
    assert WeightedRewards({"exact": ExactMatch()}).score_batch is None  # per call, in workers, as before
    scores = BoundedVerifier(combined, timeout_s=5.0).run(RESPONSES, ITEMS)
    exact = [float(r.strip() == "4") for r in RESPONSES]
    assert scores.rewards == _close([0.5 * s + 2.0 * e for s, e in zip(raw, exact, strict=True)])
    assert scores.correct == [e == 1.0 for e in exact]
    assert scores.components["exact"] == _close(sum(exact) / len(exact))


def test_prompt_text_of_an_item() -> None:
    assert prompt_text({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]})
    assert prompt_text({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}) == "a\n\nb"
    assert prompt_text({"question": "q"}) == "q"


def _scalars(save_dir: Path) -> dict[str, list[float]]:
    files = glob.glob(str(save_dir / "**" / "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(sorted(files)[-1])
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_three_updates_through_the_cli(rm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    cli = LoGRACLI(
        args=[
            *quick_fit_args(3, tmp_path / "runs"),
            "--model.verifier.class_path=logra_pl.rewards.RewardModelVerifier",
            f"--model.verifier.init_args.model={rm_dir}",
            "--model.verifier.init_args.device=cpu",
            "--model.verifier.init_args.batch_size=4",
        ]
    )
    module = cli.model
    assert cli.trainer.global_step == 3 and module.method.applied_updates == 3
    ctx = module.step_context
    # The rewards the last update trained on are the reward model's scores of its responses, unclamped.
    texts = module.tokenizer.batch_decode(ctx.rollout.response_ids, skip_special_tokens=True)
    items = [ctx.items[i] for i in ctx.rollout.prompt_index]
    again = RewardModelVerifier(str(rm_dir), device="cpu").score_batch(texts, items)
    assert ctx.rewards.tolist() == _close(again)
    assert all(math.isfinite(r) for r in ctx.rewards.tolist()) and ctx.all_scored
    scalars = _scalars(tmp_path / "runs")
    means = scalars["train/reward_mean"]
    assert len(means) == 3 and all(math.isfinite(m) for m in means)
    assert any(not 0.0 <= m <= 1.0 for m in means)  # real-valued: not clamped to [0, 1]
    assert means[-1] == _close(sum(again) / len(again))
    assert scalars["verifier/failure_rate"] == [0.0, 0.0, 0.0]
