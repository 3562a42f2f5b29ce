"""The base paper recipe's own two launch commands, as its header writes them, run on this CPU for 2 updates.

``tests/test_paper_recipes.py`` checks the recipes' text (they parse, build, hold the paper's settings, name commands
that fit them). This runs them: ``logra-pl serve`` and ``logra-pl fit`` taken token by token from the header of
``configs/paper/math_1.5b_logra.yaml``, with only the overrides this machine forces, each named below with its
reason. Everything else (the FSDP2 strategy block with bf16 compute over fp32 master weights and activation
checkpointing, REINFORCE + TIS, the running baseline, predicted-KL control, the rollout-mismatch budget, factor
sync to a served engine with a float32 shadow copy, the math verifier, HF export, atomic checkpoints) is the
recipe's, so recipe rot (a renamed key, a callback argument that no longer exists, a serve flag that changed)
fails here before it fails on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.serve import Server, free_port
from test_paper_recipes import BASE, ROOT, _command, _header, _paper_topology

from logra_pl.rollout.remote import RemoteEngine, RemoteSettings
from logra_pl.rollout.vllm_worker import tensor_digest

pytestmark = [pytest.mark.slow, pytest.mark.system]

POLICY = "tiny:small"  # a 5M-parameter Qwen2 built offline, with a BPE tokenizer and a chat template
UPDATES = 2

# `logra-pl serve` flags this machine forces, with the reason; None drops the flag.
SERVE_FORCED: dict[str, str | None] = {
    "--model": POLICY,  # no hub here: a small policy built offline
    "--dtype": "float32",  # vLLM on this CPU computes in float32
    "--data-parallel-size": "1",  # one engine instead of four (2 cores)
    "--devices": None,  # no GPUs to pin
    "--max-model-len": "1024",  # the small policy's context (max_position_embeddings)
    "--port": None,  # a free port, given by the Server helper
}


def _fit_forced(url: str, data: Path) -> list[str]:
    """`logra-pl fit` overrides this machine forces (appended after the header's arguments, so they win)."""
    return [
        "--trainer.accelerator=cpu",  # no GPU
        "--trainer.devices=1",  # one training process on 2 cores
        "--trainer.strategy.init_args.data_parallel_size=1",  # = trainer.devices
        f"--model.policy={POLICY}",  # the served engine's model
        f"--model.engine.init_args.urls=[{url}]",  # the one engine
        f"--data.init_args.path={data / 'dapo.parquet'}",  # local files in DAPO-Math-17k's and MATH-500's formats
        f"--data.init_args.eval_path={data / 'math500.jsonl'}",
        "--data.init_args.prompts_per_step=4",  # minutes, not hours, on 2 cores
        "--model.rollout.max_new_tokens=48",  # the small policy's context, and time
        f"--trainer.max_steps={UPDATES}",
        "--trainer.enable_progress_bar=false",
    ]


def _dapo_rows(n: int) -> list[dict]:
    """DAPO-Math-17k's schema: its instruction in the prompt, the answer as ``reward_model.ground_truth``."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [
                {
                    "content": "Solve the following math problem step by step. The last line of your response "
                    f"should be of the form Answer: $Answer (without quotes).\n\nWhat is {p} + {p + 2}?\n\n"
                    'Remember to put your answer on its own line after "Answer:".',
                    "role": "user",
                }
            ],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * p + 2), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"uid-{p:04d}"},
        }
        for p in range(n)
    ]


def _math500_rows(n: int) -> list[dict]:
    return [
        {
            "problem": f"Find $x$ if $x + {i} = {2 * i + 3}$.",
            "answer": str(i + 3),
            "solution": f"Subtract {i}: $x = {i + 3}$.",
            "subject": "Algebra",
            "level": 1,
            "unique_id": f"test/algebra/{100 + i}.json",
        }
        for i in range(n)
    ]


def _with(flags: list[str], forced: dict[str, str | None]) -> list[str]:
    """``flags`` (``--name value`` pairs) with the forced ones replaced or dropped."""
    out: list[str] = []
    pairs = list(zip(flags[0::2], flags[1::2], strict=True))
    for name, value in pairs:
        if name not in forced:
            out += [name, value]
        elif forced[name] is not None:
            out += [name, str(forced[name])]
    return out


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_the_base_recipes_two_commands_run_on_this_cpu(tmp_path: Path) -> None:
    header = _paper_topology(_header(BASE))
    serve, fit = _command(header, "serve"), _command(header, "fit")
    assert serve[:2] == ["logra-pl", "serve"] and fit[1:3] == ["logra-pl", "fit"]
    env_name, _, env_value = fit[0].partition("=")
    assert env_name == "CUDA_VISIBLE_DEVICES"
    # Every flag the header gives serve is either kept or forced here for a stated reason.
    serve_flags = _with(serve[2:], SERVE_FORCED)
    kept = set(serve[2::2]) - set(SERVE_FORCED)
    assert {"--sync-mode", "--master-dtype"} <= kept, "the exact sync the recipe's engines run is kept"

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(_dapo_rows(12)), data / "dapo.parquet")
    (data / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _math500_rows(4)))
    work = tmp_path / "work"  # the command's relative paths (configs/..., runs/paper) as from a checkout
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")

    server = Server(tmp_path, *serve_flags, port=free_port())
    server.start(timeout=600)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"))
        env[env_name] = env_value
        cmd = [sys.executable, "-m", "logra_pl.cli", *fit[2:], *_fit_forced(server.url, data)]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert f"updates: {UPDATES}" in out

        run = work / "runs" / "paper" / "math_1.5b_logra" / "version_0"
        scalars = _scalars(run)
        # The recipe's step control ran on each update: a predicted KL, scaled to the cosine schedule's budget.
        assert [s for s, _ in scalars["kl/alpha"]] == list(range(UPDATES))  # logged at the step it applies to
        budget = scalars["kl/effective_budget"]
        for (_, predicted), (_, effective), (_, alpha) in zip(
            scalars["kl/predicted_scaled"], budget, scalars["kl/alpha"], strict=True
        ):
            assert predicted <= effective * (1 + 1e-6) or alpha == pytest.approx(3.0)  # α capped at alpha_max
        # RolloutMismatch ran each update (it observes only EOS-terminated replies, which 48 tokens may not reach).
        assert [s for s, _ in scalars["mismatch/ema"]] == list(range(UPDATES))
        # Factor sync: each update went to the engines as rank-256 factors, none resent whole (on tiny:small's narrow
        # matrices rank 256 is near full rank, so the factors are only a little smaller than the weights).
        assert scalars["sync/full_resyncs"][-1][1] == 0
        assert all(
            p < f for (_, p), (_, f) in zip(scalars["sync/payload_bytes"], scalars["sync/full_bytes"], strict=True)
        )
        # The recipe's checkpoint and export.
        ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert ckpt["global_step"] == UPDATES
        exported = json.loads((run / "hf" / "final" / "config.json").read_text())
        assert exported["torch_dtype" if "torch_dtype" in exported else "dtype"] == "bfloat16"
        # The engine's float32 shadow copy holds the trainer's final fp32 master weights, bit for bit.
        state = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items()}
        names = sorted(k for k in state if k.endswith("proj.weight"))
        engine = RemoteEngine(RemoteSettings(urls=[server.url]), 0)
        try:
            assert engine.weights_digest(names) == {n: tensor_digest({n: state[n]}) for n in names}
        finally:
            engine.close()
    finally:
        server.kill()
