"""LoGRAStrategy with real gloo processes on CPU: equal to one process, exact resume, measured all-reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel

from logra_pl.strategy import LoGRAStrategy, decoder_layers, row_offset

pytestmark = [pytest.mark.system, pytest.mark.cores(2)]  # the system tier (make test-system); 2 ranks: runs alone

RUN = str(Path(__file__).with_name("dp_run.py"))


def _start(tmp: Path, devices: int, steps: int, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """Launch ``dp_run.py`` (one thread per rank), its output in ``tmp/name.log``."""
    out = tmp / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with (tmp / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, RUN, str(devices), str(steps), str(out), *extra],
            cwd=tmp,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, out


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    code = proc.wait(timeout=900)
    assert code == 0, out.with_suffix(".log").read_text(errors="replace")[-3000:]
    return torch.load(out)


def _run(tmp: Path, devices: int, steps: int, name: str, *extra: str) -> dict:
    return _finish(*_start(tmp, devices, steps, name, *extra))


def _side_by_side(tmp: Path, *runs: tuple) -> list[dict]:
    """One-rank runs (one thread each) two at a time: the module's tests hold both cores (``cores(2)``)."""
    started = [_start(tmp, *run) for run in runs]
    return [_finish(*s) for s in started]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict:
    tmp = tmp_path_factory.mktemp("dp")
    ckpt, ckpt1, dckpt = tmp / "ckpt", tmp / "ckpt1", tmp / "dckpt"
    budget = ("--loss-menu", "--max-tokens", "70")  # token budgets that pad one rank: the reference pads with it
    outputs = ("--sketch-side", "outputs", "--kl-control", "--moment-reference-kl", "2.5e-5")
    out = {
        "two_ac": _run(tmp, 2, 3, "two_ac", "--activation-checkpointing"),
        "two_bf16": _run(tmp, 2, 3, "two_bf16", "--activation-checkpointing", "--param-dtype", "bfloat16"),
        # 7 updates: also what the grouped step's per-matrix reference run is compared with.
        "two7": _run(tmp, 2, 7, "two7", "--ckpt-dir", str(ckpt), "--snapshot-at", "3"),
        "resumed7": _run(tmp, 2, 7, "resumed7", "--ckpt-resume", str(ckpt / "step=3.ckpt")),
        "adamw": _run(tmp, 2, 2, "adamw", "--optimizer", "adamw", "--kl-control"),
        "dist6": _run(tmp, 2, 6, "dist6", "--ckpt-dir", str(dckpt), "--distributed-ckpt"),
        "dist_resumed6": _run(
            tmp, 2, 6, "dist_resumed6", "--ckpt-resume", str(dckpt / "step=3.ckpt"), "--distributed-ckpt"
        ),
        "menu_two": _run(tmp, 2, 3, "menu_two", *budget),
        # input_scaling: rms, its statistics summed over ranks; the replay of checkpointed layers supplies them.
        "two_scaled": _run(tmp, 2, 3, "two_scaled", "--input-scaling", "--activation-checkpointing"),
        "one_scaled": _run(tmp, 1, 3, "one_scaled", "--input-scaling"),
        # sketch_side: outputs — each rank merges its rows of W as columns of Wᵀ; the probe under the KL controller,
        # whose price of each update decays the moment (a horizon in KL: β1² per update of the 1e-4 budget); the
        # replay of checkpointed layers keeps X for the backward.
        "two_outputs": _run(tmp, 2, 3, "two_outputs", *outputs, "--activation-checkpointing"),
        "one_outputs": _run(tmp, 1, 3, "one_outputs", *outputs),
        # The same two-rank run with its projections kept as their packed draws, rebuilt where they are read.
        "two_outputs_packed": _run(
            tmp, 2, 3, "two_outputs_packed", *outputs, "--activation-checkpointing", "--projection-storage", "packed"
        ),
    }
    out["one6"], out["adamw_one"] = _side_by_side(
        tmp,
        (1, 6, "one6", "--ckpt-dir", str(ckpt1), "--snapshot-at", "3"),
        (1, 2, "adamw_one", "--optimizer", "adamw", "--kl-control"),
    )
    out["one_resumed6"], out["menu_one"] = _side_by_side(
        tmp, (1, 6, "one_resumed6", "--ckpt-resume", str(ckpt1 / "step=3.ckpt")), (1, 3, "menu_one", *budget)
    )
    # The 3-update runs on 1 and 2 ranks are the longer runs as they stood after update 3 (no runs of their own).
    out["one"], out["two"] = _after_3(out["one6"]), _after_3(out["two7"])
    return out


def _after_3(run: dict) -> dict:
    """A 6-update run's record as a 3-update run would have written it (its snapshot after update 3)."""
    return run | run["snapshot"] | {"rows": [r for r in run["rows"] if r[0] < 3]}


def test_two_processes_equal_one(runs) -> None:
    one, two = runs["one"], runs["two"]
    assert one["rows"] == two["rows"]  # the same prompts and the same sampled responses
    assert one["logra"]["num_applied"] == two["logra"]["num_applied"] == 3
    for key, value in one["policy"].items():
        assert float((value - two["policy"][key]).abs().max()) <= 1e-6, key
    changed = [k for k, v in one["policy"].items() if k.endswith("proj.weight")]
    assert changed  # and the run did train the sketched matrices (guard against a vacuous equality)
    # Every rank's engine holds the trainer's (gathered) weights.
    assert all(torch.equal(two["engine"][k], two["policy"][k]) for k in two["policy"])


def test_input_scaled_runs_agree_on_two_ranks(runs) -> None:
    one, two = runs["one_scaled"], runs["two_scaled"]
    assert one["rows"] == two["rows"]
    assert one["logra"]["num_applied"] == two["logra"]["num_applied"] == 3
    assert one["logra"]["input_age"] == two["logra"]["input_age"] == 3
    for name, ema in one["logra"]["input_ema"].items():  # the statistics of every token, whichever rank saw it
        torch.testing.assert_close(ema, two["logra"]["input_ema"][name], rtol=1e-5, atol=0)
        assert bool((ema > 0).any()), name
    for key, value in one["policy"].items():
        assert float((value - two["policy"][key]).abs().max()) <= 1e-6, key
    # The scaled rule is another rule: its weights are not the unscaled run's.
    plain = runs["one"]["policy"]
    assert any(float((one["policy"][k] - plain[k]).abs().max()) > 1e-6 for k in plain if k.endswith("proj.weight"))
    assert all(torch.equal(two["engine"][k], two["policy"][k]) for k in two["policy"])


def test_outputs_side_runs_agree_on_two_ranks(runs) -> None:
    one, two = runs["one_outputs"], runs["two_outputs"]
    assert one["rows"] == two["rows"]
    assert one["logra"]["num_applied"] == two["logra"]["num_applied"] == 3
    assert one["logra"]["config"]["sketch_side"] == "outputs"
    for name, moment in one["logra"]["moments"].items():  # d_in × r: one row per input channel
        assert tuple(moment.shape) == (one["policy"][f"{name}.weight"].shape[1], 16), name
        torch.testing.assert_close(moment.float(), two["logra"]["moments"][name].float(), rtol=1e-2, atol=1e-6)
    for key, value in one["policy"].items():
        assert float((value - two["policy"][key]).abs().max()) <= 1e-6, key
    # The outputs' side is another rule: its weights are not the inputs' side's.
    plain = runs["one"]["policy"]
    assert any(float((one["policy"][k] - plain[k]).abs().max()) > 1e-6 for k in plain if k.endswith("proj.weight"))
    assert len(one["kl"]) == len(two["kl"]) == 3
    for a, b in zip(one["kl"], two["kl"], strict=True):  # the probe's prediction, the same on 1 and 2 ranks
        assert a["alpha"] != 1.0 and b["alpha"] == pytest.approx(a["alpha"], rel=2e-3)  # set by the controller
    # The moment's horizon in KL: every rank keeps the controller's (all-reduced) price and decays alike.
    last = one["kl"][-1]
    assert one["logra"]["moved_kl"] == pytest.approx(last["alpha"] ** 2 * last["predicted"])
    assert two["logra"]["moved_kl"] == pytest.approx(one["logra"]["moved_kl"], rel=5e-3)
    assert two["logra"]["moment_mass"] == pytest.approx(one["logra"]["moment_mass"], rel=1e-3)
    assert one["logra"]["moment_mass"] != pytest.approx(1 - 0.9**3)  # the prices decayed it, not β1 per update
    assert all(torch.equal(two["engine"][k], two["policy"][k]) for k in two["policy"])


def test_packed_projections_are_the_dense_run_on_two_ranks(runs) -> None:
    dense, packed = runs["two_outputs"], runs["two_outputs_packed"]
    assert packed["logra"]["config"]["projection_storage"] == "packed"
    assert dense["logra"]["config"].get("projection_storage", "dense") == "dense"
    assert packed["rows"] == dense["rows"]
    # Bit for bit: every rank rebuilt the same P from its draws for the backward, the merge of its shard and the probe.
    for key, value in dense["policy"].items():
        assert torch.equal(packed["policy"][key], value), key
    for name, moment in dense["logra"]["moments"].items():
        assert torch.equal(packed["logra"]["moments"][name], moment), name
    assert [k["alpha"] for k in packed["kl"]] == [k["alpha"] for k in dense["kl"]]
    assert packed["gains"] == dense["gains"]
    # ... while holding each projection as its draws: Rademacher signs as bits, 1/32 of fp32.
    assert 0 < packed["projection_bytes"] * 16 < dense["projection_bytes"]
    assert packed["persistent_bytes"] == dense["persistent_bytes"]  # moments and statistics: the same state
    assert all(torch.equal(packed["engine"][k], packed["policy"][k]) for k in packed["policy"])


@pytest.mark.slow
def test_grouped_step_is_the_per_matrix_step_on_two_ranks(runs, tmp_path) -> None:
    """Under FSDP (row shards at their offsets, sketches all-reduced one group at a time), the grouped sketch step
    trains the very bits of the per-matrix reference step (``--per-matrix``: ``PerMatrixSketcher``): weights, row
    statistics, responses, over 7 updates of 2 processes. (The grouped run is the fixture's 7-update run: saving a
    checkpoint and gathering a snapshot change no value.)"""
    grouped = runs["two7"]
    reference = _run(tmp_path, 2, 7, "two7_per_matrix", "--per-matrix")
    assert grouped["rows"] == reference["rows"]
    assert grouped["logra"]["num_applied"] == reference["logra"]["num_applied"] == 7
    for key, value in reference["policy"].items():
        assert torch.equal(grouped["policy"][key], value), key
    for key, value in reference["logra"]["row_stats"].items():
        assert torch.equal(grouped["logra"]["row_stats"][key], value), key
    assert grouped["stats"]["logra/sketch_allreduce_bytes"] == reference["stats"]["logra/sketch_allreduce_bytes"] > 0


def test_token_budgets_that_cut_ranks_differently_pad_to_equal_forward_counts(menu_runs) -> None:
    """``max_tokens_per_microbatch`` groups each rank's own rows, so ranks can need different microbatch counts; FSDP
    gathers each layer on every rank per forward, so the ranks agree on the largest count and a rank with fewer runs
    zero-loss padding microbatches. Without that the run hangs; with it, 2 ranks still equal 1. (The runs are the
    loss-menu runs, whose token budget of 70 makes one rank pad.)"""
    one, two = menu_runs["one"], menu_runs["two"]
    assert sum(two["padded"]) > 0 and one["padded"] == [0]  # the unequal case happened (and one rank never pads)
    assert one["rows"] == two["rows"]
    for key, value in one["policy"].items():
        assert float((value - two["policy"][key]).abs().max()) <= 1e-6, key


def test_sketch_allreduce_bytes(runs) -> None:
    # 2 layers × (q 128 + k 128 + v 128 + o 128 + gate 512 + up 512 + down 128) rows × rank 16 × 4 bytes.
    expected = 2 * (128 * 5 + 512 * 2) * 16 * 4
    assert runs["two"]["stats"]["logra/sketch_allreduce_bytes"] == expected
    assert runs["one"]["stats"]["logra/sketch_allreduce_bytes"] == 0


@pytest.mark.parametrize(
    ("straight_key", "resumed_key"),
    [("two7", "resumed7"), ("one6", "one_resumed6"), ("dist6", "dist_resumed6")],
    ids=["2-ranks-full-ckpt", "1-rank-full-ckpt", "2-ranks-sharded-ckpt"],
)
def test_resume_is_bitwise(runs, straight_key: str, resumed_key: str) -> None:
    straight, resumed = runs[straight_key], runs[resumed_key]
    assert resumed["logra"]["update_index"] == straight["logra"]["update_index"] >= 6
    assert resumed["rows"] == [r for r in straight["rows"] if r[0] >= 3]
    for key, value in straight["policy"].items():
        assert torch.equal(value, resumed["policy"][key]), key
    for key, value in straight["logra"]["row_stats"].items():
        assert torch.equal(value, resumed["logra"]["row_stats"][key]), key


def test_activation_checkpointing_changes_nothing(runs) -> None:
    # It is active: every decoder layer runs forward twice with grad per microbatch (the loss pass and the
    # backward replay), where without it once. (transformers' own switch checkpoints only in train mode, and the
    # policy trains in eval mode, so it had silently done nothing.)
    assert runs["two_ac"]["layer_forwards"] == 2 * runs["two"]["layer_forwards"] > 0
    assert runs["two_ac"]["rows"] == runs["two"]["rows"]
    for key, value in runs["two"]["policy"].items():
        assert torch.equal(value, runs["two_ac"]["policy"][key]), key


def test_bf16_compute_fp32_master_on_two_ranks(runs) -> None:
    """FSDP2 with bf16 compute and activation checkpointing: fp32 master weights and sketches, real updates."""
    bf16, fp32 = runs["two_bf16"], runs["two"]
    assert bf16["logra"]["num_applied"] == 3 and bf16["sketch_dtypes"] == ["torch.float32"]
    changed = 0
    for key, value in bf16["policy"].items():
        assert value.dtype == torch.float32 and bool(torch.isfinite(value).all()), key
        if key.endswith("proj.weight"):
            diff = float((value - fp32["policy"][key]).abs().max())
            assert diff < 1e-2, key  # the same run within bf16 rounding of activations
            changed += diff > 0
    assert changed  # bf16 compute is not a no-op: it does change the numbers


def test_dense_adamw_under_the_same_strategy(runs, tiny_model_dir) -> None:
    from logra_pl.models import load_policy

    adamw = runs["adamw"]
    initial = load_policy(tiny_model_dir)[0].state_dict()
    assert adamw["logra"] is None
    assert all(torch.equal(adamw["engine"][k], adamw["policy"][k]) for k in adamw["policy"])
    moved = {k for k, v in adamw["policy"].items() if not torch.equal(v, initial[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved)  # only the trained matrices changed


def test_dense_kl_control_is_the_same_on_two_ranks(runs) -> None:
    """PredictedKLControl on dense AdamW under FSDP2: the probe's prediction (all-reduced; the sharded parameters are
    probed by a central difference) sets the same α on 1 and 2 ranks, and the realized KL meets α²·pred."""
    one, two = runs["adamw_one"]["kl"], runs["adamw"]["kl"]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert a["alpha"] < 1 and b["alpha"] == pytest.approx(a["alpha"], rel=2e-3)
        for h in (a, b):
            assert abs(h["realized"] - h["predicted_scaled"]) / h["realized"] < 0.05


def test_update_gains_are_the_same_on_two_ranks(runs) -> None:
    """The first-order gain of each update (LoGRA: ``α·⟨S, U⟩`` from the all-reduced sketches; dense AdamW:
    ``−⟨g, α·ΔW⟩`` over the ranks' gradient shards, summed), and of each step on the next update's loss, is the same
    on 1 and 2 ranks: the gradient of the update's loss is summed over ranks, never averaged (a 2-rank gain of half
    the 1-rank one would be averaged)."""
    for one, two, rel in ((runs["one6"], runs["two7"], 1e-5), (runs["adamw_one"], runs["adamw"], 5e-3)):
        assert len(one["gains"]) >= 2 and len(two["gains"]) >= 2
        for a, b in zip(one["gains"][:2], two["gains"][:2], strict=True):
            assert a > 0 and b == pytest.approx(a, rel=rel)
        # The first step's gain on the second update's loss: LoGRA's ⟨S', F⟩ from the all-reduced sketches, AdamW's
        # over the gradient shards, summed; nothing before the first step.
        assert one["next_gains"][0] is None and two["next_gains"][0] is None
        assert one["next_gains"][1] != 0 and two["next_gains"][1] == pytest.approx(one["next_gains"][1], rel=rel)


def test_persistent_state_halves(runs) -> None:
    one, two = runs["one"]["persistent_bytes"], runs["two"]["persistent_bytes"]
    assert abs(two / one - 0.5) <= 0.05, (one, two)
    # The planner, from the config alone, predicts what each FSDP rank measured.
    from logra_pl.methods.memory_plan import plan

    for ranks, measured in ((1, one), (2, two)):
        predicted = plan("tiny", ranks=ranks, rank_r=16, optimizers=["logra"])["logra"].report.persistent
        assert abs(predicted - measured) <= 0.05 * measured, (ranks, predicted, measured)


@pytest.fixture(scope="module")
def menu_runs(runs) -> dict:
    """Sequence-mean aggregation and a KL penalty (reference kept with the policy) on 1 and 2 ranks, with a token
    budget per microbatch that makes one rank pad (tests the reference's padded forwards). (The random
    tiny policy of these runs rarely ends a response with EOS, so mask_truncated would mask almost everything; its
    normalisers' rank invariance is tested in-process: tests/losses/test_loss_menu.py.) They are runs of the module's
    fixture, where the one-rank runs go two at a time."""
    return {"one": runs["menu_one"], "two": runs["menu_two"]}


def test_loss_normalisers_and_the_sharded_reference_are_the_same_on_two_ranks(menu_runs) -> None:
    """The sequence and token counts of seq_mean_token_mean are all-reduced, so two ranks train the one-rank run
    (up to float order); the reference policy is sharded over the ranks (half per rank) and the same on both."""
    one, two = menu_runs["one"], menu_runs["two"]
    assert sum(two["padded"]) > 0  # a rank ran padding microbatches: the sharded reference's forwards too, no hang
    assert one["rows"] == two["rows"]
    for key, value in one["policy"].items():
        assert float((value - two["policy"][key]).abs().max()) <= 1e-6, key
    initial = _initial()
    assert any(not torch.equal(v, initial[k]) for k, v in one["policy"].items())  # it trained (not a vacuous match)
    ref1, ref2 = one["reference"], two["reference"]
    assert ref1["sharded"] and ref2["sharded"] and ref1["digest"] == ref2["digest"]
    assert abs(ref2["nbytes"] / ref1["nbytes"] - 0.5) <= 0.05, (ref1["nbytes"], ref2["nbytes"])
    assert ref1["kl_reference"] > 0 and ref2["kl_reference"] > 0


def _initial() -> dict[str, torch.Tensor]:
    """The tiny policy's weights before training (what the menu runs started from)."""
    from logra_pl.models.load import load_policy

    model, _ = load_policy("tiny")
    return dict(model.state_dict())


def test_a_sigterm_on_one_rank_stops_every_rank_after_the_same_update_and_the_resume_is_bitwise(
    runs, tmp_path: Path
) -> None:
    """SIGTERM reaches rank 1 only, after update 2: both ranks stop after update 2 (no hang in the next collective),
    the checkpoint holds update 2 and the run exits with 143. Resumed from that ``last.ckpt`` on 2 ranks, the run
    ends where the uninterrupted 7-update run of the fixture does, bit for bit."""
    out, folder = tmp_path / "preempted.pt", tmp_path / "preempt"
    args = ("--sigterm-at", "2", "--sigterm-rank", "1", "--preempt-dir", str(folder))
    proc, _ = _start(tmp_path, 2, 7, "preempted", *args)
    assert proc.wait(timeout=900) == 143, (tmp_path / "preempted.log").read_text(errors="replace")[-3000:]
    for rank in (0, 1):
        stopped = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert stopped == {"rank": rank, "global_step": 2}
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 2
    resumed, straight = _run(tmp_path, 2, 7, "after_sigterm", "--ckpt-resume", str(folder / "last.ckpt")), runs["two7"]
    assert resumed["logra"]["update_index"] == straight["logra"]["update_index"] == 7
    assert resumed["rows"] == [r for r in straight["rows"] if r[0] >= 2]
    for key, value in straight["policy"].items():
        assert torch.equal(value, resumed["policy"][key]), key


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="tensor parallelism is not supported yet"):
        LoGRAStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unknown param_dtype 'int8'"):
        LoGRAStrategy(param_dtype="int8")
    encoder = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    encoder._no_split_modules = None
    with pytest.raises(ValueError, match="declares no decoder layers"):
        decoder_layers(encoder)
    assert row_offset(torch.zeros(3, 2)) == 0


def test_cli_with_two_devices(tmp_path: Path) -> None:
    """`logra-pl fit --config configs/tiny_cpu.yaml --trainer.devices 2 --trainer.strategy logra_fsdp` on CPU."""
    config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    cmd = [
        sys.executable,
        "-m",
        "logra_pl.cli",
        "fit",
        f"--config={config}",
        "--trainer.devices=2",
        "--trainer.strategy=logra_fsdp",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.enable_progress_bar=false",
        "--model.warm_start.steps=20",
        "--data.train_size=128",
        "--data.eval_size=16",
        "--data.prompts_per_step=16",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "updates: 2" in proc.stderr + proc.stdout
    assert "All distributed processes registered. Starting with 2 processes" in proc.stderr + proc.stdout
