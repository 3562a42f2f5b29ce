"""benchmarks/ablate.py --grid parity (benchmarks/parity.py): the tuning choice from finished runs, the report stage's
commands, the dry-run command lines, the refusal of unknown LoGRA keys, and the report's ratios and goal line.

Quick paths only: every "finished run" here is a ``result.json`` written by the test (nothing is trained).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grid  # noqa: E402
import parity  # noqa: E402

MiB = 2**20


def _plan(out: Path, **kwargs) -> parity.Plan:
    return parity.Plan(model="tiny", updates=40, values=None, methods=tuple(parity.METHODS), out=out, **kwargs)


def _finish(spec: parity.RunSpec, out: Path, **numbers) -> dict:
    """A finished run's result.json for ``spec`` (its settings key, so the harness reuses it)."""
    steps = range(1, 41)
    gain = numbers.get("reward_gain", 0.1)
    result = {
        "key": spec.key,
        "cell": spec.cell,
        "seed": spec.seed,
        "args": spec.args,
        "failed": False,
        "updates": 40,
        "wall_s": 100.0,
        "tune_score": 0.5,
        "reward_gain": gain,
        "report_final": 0.5,
        "tune_final": 0.5,
        "val_final": 0.5,
        "kl_realized": None,
        "training_state_bytes": 1.0 * MiB,
        "curves": {"train/reward_mean": [(s, 0.3 + gain * s / 40) for s in steps]},
    }
    result.update(numbers)
    if result["kl_realized"] is not None:
        result["curves"]["kl/realized"] = [(s, result["kl_realized"]) for s in steps]
    folder = spec.folder(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(result))
    return result


def test_tuning_picks_the_argmax_and_the_report_stage_runs_it(tmp_path: Path) -> None:
    """Per method: the value whose seeds' mean tuning score is highest; the report runs use it on seeds 2-6. A
    failed run disqualifies its value, an unfinished (or stale-key) run holds the choice back."""
    plan = _plan(tmp_path)
    adamw = {1e-4: (0.40, 0.42), 3e-4: (0.50, 0.52), 1e-3: (0.55, 0.53), 3e-3: (0.90, None)}  # None: failed
    for value, scores in adamw.items():
        for seed, score in zip(plan.tune_seeds, scores, strict=True):
            spec = plan.spec("tune", "adamw", value, seed)
            _finish(spec, tmp_path, tune_score=score if score is not None else math.nan, failed=score is None)
    for value, score in {0.25: 0.1, 0.5: 0.3, 1.0: 0.4, 2.0: 0.6, 4.0: 0.2}.items():
        for seed in plan.tune_seeds:
            _finish(plan.spec("tune", "paper_logra", value, seed), tmp_path, tune_score=score)
    for value in parity.METHODS["lora"].knob.values:  # LoRA: one run missing, one run from other settings
        _finish(plan.spec("tune", "lora", value, 0), tmp_path, tune_score=0.7)
    stale = plan.spec("tune", "lora", 1e-3, 1)
    _finish(stale, tmp_path, tune_score=0.9, key="not-these-settings")

    found = parity.choices(plan, tmp_path)
    assert found["adamw"].value == 1e-3  # 3e-3 scored higher on the seed that finished, but the other failed
    assert found["adamw"].scores[1e-3]["tune_score"] == pytest.approx(0.54)
    assert found["paper_logra"].value == 2.0 and not found["paper_logra"].at_edge
    assert found["lora"].value is None and found["lora"].missing == 4 and "not finished" in found["lora"].reason
    assert found["logra_best"].value is None

    report = plan.report_runs(found)
    assert {s.method for s in report} == {"adamw", "paper_logra"}
    assert [s.seed for s in report if s.method == "adamw"] == [2, 3, 4, 5, 6]
    for spec in report:
        if spec.method == "adamw":
            assert "--model.adamw.lr=0.001" in spec.args and spec.cell == "adamw/lr=0.001"
            assert spec.folder(tmp_path) == tmp_path / "adamw" / "lr=0.001" / f"seed{spec.seed}"
        else:  # paper_logra.yaml's budget (1e-2 -> 1e-3) times the chosen scale 2
            assert "--trainer.callbacks.init_args.schedule.delta_max=0.02" in spec.args
            assert "--trainer.callbacks.init_args.schedule.delta_min=0.002" in spec.args
        assert f"--seed_everything={spec.seed}" in spec.args and f"--model.seed={spec.seed}" in spec.args
        assert spec.stage == "report" and spec.key != plan.spec("tune", spec.method, spec.value, 0).key


def test_tie_rule_higher_gain_then_smaller_value() -> None:
    def run(score: float, gain: float, failed: bool = False) -> dict:
        return {"tune_score": score, "reward_gain": gain, "failed": failed}

    tie_gain = {1e-4: [run(0.5, 0.10)] * 2, 3e-4: [run(0.5, 0.20)] * 2, 1e-3: [run(0.4, 0.30)] * 2}
    assert parity.choose("adamw", tie_gain).value == 3e-4
    full_tie = {1e-4: [run(0.5, 0.2)] * 2, 3e-4: [run(0.5, 0.2)] * 2}
    assert parity.choose("adamw", full_tie).value == 1e-4
    # Equal to 1e-9 counts as a tie (float noise of the seed mean does not decide).
    near = {1e-4: [run(0.5 + 1e-12, 0.1)] * 2, 3e-4: [run(0.5, 0.2)] * 2}
    assert parity.choose("adamw", near).value == 3e-4
    failed = {1e-4: [run(0.4, 0.1)] * 2, 3e-4: [run(0.9, 0.3), run(math.nan, math.nan, failed=True)]}
    choice = parity.choose("adamw", failed)
    assert choice.value == 1e-4 and choice.at_edge
    assert parity.choose("adamw", {1e-4: [run(math.nan, math.nan, True)] * 2}).value is None
    assert parity.choose("adamw", {1e-4: [run(0.5, 0.1), None]}).missing == 1


def test_knob_values_kept_nearest_the_default() -> None:
    knob = parity.METHODS["adamw"].knob
    assert knob.keep(None) == knob.values == (1e-4, 3e-4, 1e-3, 3e-3)
    assert knob.keep(3) == (1e-4, 3e-4, 1e-3)
    assert knob.keep(2) == (1e-4, 3e-4)  # equal log distance: the smaller
    assert knob.keep(1) == (3e-4,)
    assert all(len(m.knob.values) >= 4 for m in parity.METHODS.values())  # the protocol's >= 4 log-spaced values
    for m in parity.METHODS.values():
        ratios = [b / a for a, b in zip(m.knob.values, m.knob.values[1:], strict=False)]
        assert max(ratios) / min(ratios) < 1.3, m.name  # log-spaced


def test_dry_run_prints_every_command_with_its_knob_and_kl_measurement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parity.main(["--dry-run", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert "tune: 38 runs" in text and "report: 20 runs" in text and "total estimated" in text
    commands = [line for line in text.splitlines() if line.startswith("[tune] ")]
    assert len(commands) == 38
    measure = " ".join(parity.MEASURE_KL)
    assert measure == "--trainer.callbacks+=callbacks/kl_measure.yaml"
    for method, knob in (("adamw", "--model.adamw.lr="), ("lora", "--model.adamw.lr=")):
        lines = [line for line in commands if line.startswith(f"[tune] {method}/")]
        assert len(lines) == 8 and all(measure in line for line in lines)
        for value in parity.METHODS[method].knob.values:
            assert sum(f"{knob}{parity.fmt(value)} " in line for line in lines) == 2
        assert all("--model.adamw.decay_steps=600" in line for line in lines)
    for method, scales in (("paper_logra", (0.25, 0.5, 1, 2, 4)), ("logra_best", (0.25, 0.5, 1, 2, 4, 8))):
        lines = [line for line in commands if line.startswith(f"[tune] {method}/")]
        assert len(lines) == 2 * len(scales) and not any("kl_measure.yaml" in line for line in lines)
        for scale in scales:
            assert sum(f"schedule.delta_max={parity.fmt(0.01 * scale)} " in line for line in lines) == 2
        assert all("configs/overlays/paper_logra.yaml" in line for line in lines)
        assert all("schedule.horizon=600" in line for line in lines)
    assert all("--data.eval_tune_fraction=0.5" in line and "--model.policy=tiny" in line for line in commands)
    # No tuning has finished: the report stage's commands wait for it, with the knob left open.
    waits = [line for line in text.splitlines() if line.startswith("[report] ")]
    assert len(waits) == 4 and all("waits for" in line and "<tuned " in line for line in waits)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing was written

    parity.main(["--model", "tiny:small", "--dry-run", "--out", str(tmp_path)])
    small = capsys.readouterr().out
    assert "--model.policy=tiny:small" in small and "cut from the full protocol: 300 updates" in small
    # tiny:small's own warm-start lr reaches every run (and tiny's runs keep the config's).
    small_commands = [line for line in small.splitlines() if line.startswith("[tune] ")]
    assert small_commands and all("--model.warm_start.lr=0.0005 " in line for line in small_commands)
    assert not any("warm_start" in line for line in commands)
    assert "tiny:small's own settings (every run and the baseline): --model.warm_start.lr=0.0005" in small


def test_unknown_logra_keys_are_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paper = parity.METHODS["paper_logra"]
    assert parity.preflight(paper) is None and parity.preflight(parity.METHODS["adamw"]) is None
    message = parity.preflight(paper, ("bogus", {"no_such_lever": 1, "distribution": "no_such_basis"}))
    assert "lever 'bogus'" in message and "unknown key 'no_such_lever'" in message
    assert "distribution='no_such_basis' is not one of" in message
    # A real (not dry) invocation stops before any run, baseline included.
    monkeypatch.setitem(parity.LEVERS, "bogus", {"no_such_lever": 1})
    monkeypatch.setattr(parity, "parity_baseline", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit, match="unknown key 'no_such_lever'"):
        parity.main(["--grid", "levers", "--levers", "bogus", "--out", str(tmp_path)])


def test_report_ratios_goal_line_and_missing_kl(tmp_path: Path) -> None:
    """From finished tuning and report runs: mean ± std over the report seeds, ratios to tuned AdamW, the goal
    MET/MISSED with its numbers, "—" for a method that logged no realized KL, and the written report."""
    plan = _plan(tmp_path, report_seeds=(2, 3, 4))
    numbers = {  # per method: report-seed gains, report pass@1, training state, realized KL
        "adamw": ([0.16, 0.17, 0.18], [0.56, 0.58, 0.60], 6.0 * MiB, None),
        "paper_logra": ([0.12, 0.13, 0.14], [0.52, 0.53, 0.54], 1.5 * MiB, 7e-3),
        "logra_best": ([0.17, 0.18, 0.19], [0.57, 0.57, 0.58], 2.0 * MiB, 8e-3),
        "lora": ([0.20, 0.21, 0.22], [0.60, 0.61, 0.62], 3.0 * MiB, None),
    }
    for name, (gains, passes, state, kl) in numbers.items():
        knob = parity.METHODS[name].knob
        for value in knob.values:
            for seed in plan.tune_seeds:
                score = 0.6 if value == knob.default else 0.5
                _finish(plan.spec("tune", name, value, seed), tmp_path, tune_score=score)
        for seed, gain, p in zip(plan.report_seeds, gains, passes, strict=True):
            spec = plan.spec("report", name, knob.default, seed)
            _finish(spec, tmp_path, reward_gain=gain, report_final=p, training_state_bytes=state, kl_realized=kl)
    report = parity.collect(plan, tmp_path, parity.choices(plan, tmp_path), ())
    report.update(val_start={"all": 0.38, "tune": 0.37, "report": 0.39}, wall_s=60.0)
    summary = report["methods"]["logra_best"]["summary"]
    assert summary["reward_gain"]["mean"] == pytest.approx(0.18)
    assert summary["reward_gain"]["std"] == pytest.approx(statistics.stdev([0.17, 0.18, 0.19]))

    goals = parity.goal_lines(report)
    best = next(line for line in goals if "for logra_best" in line)
    assert "**MET**" in best and "(106%, ≥ 100%)" in best and "0.33×" in best and "within one AdamW seed std" in best
    paper = next(line for line in goals if "for paper_logra" in line)
    assert "**MISSED**" in paper and "(76%, < 100%)" in paper and "below one AdamW seed std" in paper

    table = parity.report_table(report)
    adamw_row = next(line for line in table.splitlines() if line.startswith("| dense AdamW |"))
    assert "| lr = 0.0003 |" in adamw_row and "| 100% |" in adamw_row and "| — |" in adamw_row
    best_row = next(line for line in table.splitlines() if line.startswith("| LoGRA, best levers"))
    assert "| 106% |" in best_row and "8.00e-03" in best_row and "| 0.33× |" in best_row
    assert "2.00 ± 0.00 MiB" in best_row
    assert "report-split pass@1 (start 0.390)" in table
    tuning = parity.tuning_table(report)
    assert "0.0003: 0.600 · +0.100 ★" in tuning and "0.001: 0.500" in tuning
    found = "\n".join(parity.findings(report))
    assert "Realized KL per update: — for adamw, lora" in found

    parity.write_report(report, tmp_path, None, plan)
    md = (tmp_path / "results.md").read_text()
    assert "## Report" in md and "## Tuning" in md and "**MET**" in md and "report seeds [2, 3, 4]" in md
    assert (tmp_path / "parity_reward_curves.png").stat().st_size > 1000
    assert (tmp_path / "parity_kl_realized.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["methods"]["adamw"]["choice"] == 3e-4


def test_settings_key_follows_the_overlays_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing an overlay's values (logra_levers.yaml once the levers are chosen) makes its runs new settings; a
    comment edit does not; the folder a run writes to is not part of the key."""
    monkeypatch.setattr(parity, "ROOT", tmp_path)
    overlay = tmp_path / "levers.yaml"
    overlay.write_text("model:\n  logra:\n    beta1: 0.9  # first guess\n")
    args = ["fit", "--config", "levers.yaml", "--trainer.logger.init_args.save_dir=/a"]
    key = parity.settings_key(args)
    assert parity.settings_key([*args[:-1], "--trainer.logger.init_args.save_dir=/b"]) == key
    overlay.write_text("model:\n  logra:\n    beta1: 0.9  # the winner\n")
    assert parity.settings_key(args) == key
    overlay.write_text("model:\n  logra:\n    beta1: 0.8\n")
    assert parity.settings_key(args) != key


def test_a_key_added_at_its_default_keeps_the_key_any_other_value_changes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config key added after runs were committed (asynchronous rollouts' ``max_staleness: 0``) hashes as if absent
    while it holds the value that changes nothing, so finished runs are reused; at another value they rerun."""
    monkeypatch.setattr(parity, "ROOT", tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text("model:\n  rollout:\n    temperature: 1.0\n")
    args = ["fit", "--config", "base.yaml"]
    before = parity.settings_key(args)
    base.write_text("model:\n  rollout:\n    temperature: 1.0\n    max_staleness: 0\n    max_stale_kl: null\n")
    assert parity.settings_key(args) == before
    base.write_text("model:\n  rollout:\n    temperature: 1.0\n    max_staleness: 1\n")
    assert parity.settings_key(args) != before
    base.write_text("model:\n  rollout:\n    temperature: 1.0\n    max_stale_kl: 0.01\n")
    assert parity.settings_key(args) != before
    # The loss section's shared settings (issue 25) at their defaults change nothing either; a KL penalty does.
    loss = "  loss:\n    class_path: logra_pl.losses.ReinforceTIS\n    init_args:\n      tis_cap: 2.0\n"
    base.write_text("model:\n" + loss)
    before = parity.settings_key(args)
    shared = (
        "      aggregation: token_mean\n      mask_truncated: false\n      kl_coef: 0.0\n      reference_dtype: null\n"
    )
    base.write_text("model:\n" + loss + shared)
    assert parity.settings_key(args) == before
    base.write_text("model:\n" + loss + "      kl_coef: 0.05\n")
    assert parity.settings_key(args) != before


def test_committed_results_match_this_checkouts_settings() -> None:
    """Every committed parity run's ``result.json`` is found by the harness on this checkout (its key is the one the
    harness computes now), so ``--grid parity`` resumes instead of rerunning finished runs after a config change."""
    found = sorted((ROOT / "results" / "parity").glob("*/*/*/seed*/result.json"))
    assert found, "no committed parity results"
    stale = []
    for path in found:
        result = json.loads(path.read_text())
        if parity.settings_key(result["args"]) != result["key"]:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, f"settings keys no longer match: {stale[:5]} ({len(stale)} in all)"


def test_reuse_rules_for_failed_runs_and_runs_without_kl(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    adamw, paper = plan.spec("tune", "adamw", 3e-4, 0), plan.spec("tune", "paper_logra", 1.0, 0)
    assert not parity.needs_rerun(adamw, {"failed": True}) and parity.needs_rerun(adamw, {"failed": True}, True)
    no_kl = {"failed": False, "kl_updates": 0}
    assert not parity.needs_rerun(adamw, no_kl) and parity.needs_rerun(adamw, no_kl, rerun_without_kl=True)
    assert not parity.needs_rerun(adamw, {"failed": False, "kl_updates": 40}, rerun_without_kl=True)
    assert not parity.needs_rerun(paper, no_kl, rerun_without_kl=True)  # LoGRA's KL comes from its controller


def test_a_budget_past_the_alpha_cap_is_reported_as_saturated_not_as_an_edge(tmp_path: Path) -> None:
    """logra_best's best value is its grid's largest, and α sat at its cap (paper_logra.yaml's α_max = 3) on 90% of
    those updates: the findings say the budget stopped sizing the step (not "extend the grid"); the tuning table
    shows each value's realized KL and share of capped updates. paper_logra's edge choice with α below the cap
    keeps the edge warning."""
    plan = _plan(tmp_path)
    assert parity.alpha_cap(parity.METHODS["logra_best"].overlays) == 3.0
    values = parity.METHODS["logra_best"].knob.values
    for i, value in enumerate(values):
        capped = 36 if value == max(values) else 4 * i  # of 40 updates
        alphas = [(s, 3.0 if s <= capped else 1.5) for s in range(1, 41)]
        for seed in plan.tune_seeds:
            result = _finish(plan.spec("tune", "logra_best", value, seed), tmp_path, tune_score=0.5 + 0.01 * i)
            result["curves"]["kl/alpha"] = alphas
            result["kl_realized"] = 1e-3 * value
            (plan.spec("tune", "logra_best", value, seed).folder(tmp_path) / "result.json").write_text(
                json.dumps(result)
            )
    for value in parity.METHODS["paper_logra"].knob.values:
        for seed in plan.tune_seeds:
            spec = plan.spec("tune", "paper_logra", value, seed)
            result = _finish(spec, tmp_path, tune_score=0.9 if value == 0.25 else 0.5)
            result["curves"]["kl/alpha"] = [(s, 1.0) for s in range(1, 41)]
            (spec.folder(tmp_path) / "result.json").write_text(json.dumps(result))

    report = parity.collect(plan, tmp_path, parity.choices(plan, tmp_path), ())
    best = report["methods"]["logra_best"]
    assert best["choice"] == 8.0 and best["cap_binding"]["fraction"] == pytest.approx(0.9)
    assert best["cap_binding"]["mean_alpha"] == pytest.approx(0.9 * 3.0 + 0.1 * 1.5)
    found = "\n".join(parity.findings(report))
    assert "logra_best: the chosen kl_scale = 8 is the grid's largest, and the budget has stopped sizing" in found
    assert "on 90% of the tuning runs' updates (mean α 2.85)" in found and "at most 5%" in found
    assert "logra_best: the chosen kl_scale = 8 is at the edge" not in found
    assert "paper_logra: the chosen kl_scale = 0.25 is at the edge of its grid" in found
    tuning = parity.tuning_table(report)
    assert "8: 0.550 · +0.100 · 8.0e-03 · 90% ★" in tuning and "0.5: 0.510 · +0.100 · 5.0e-04 · 10%" in tuning


def test_results_record_paths_relative_to_the_checkout() -> None:
    """A committed result.json names no machine's folders, and its settings key does not depend on where it ran."""
    args = [f"--trainer.logger.init_args.save_dir={grid.ROOT}/results/parity/tiny/adamw/seed0", "--model.seed=0"]
    relative = "--trainer.logger.init_args.save_dir=./results/parity/tiny/adamw/seed0"
    assert grid.recorded_args(args) == [relative, args[1]]
    assert grid.settings_key(args) == grid.settings_key(grid.recorded_args(args))
    for done in (grid.ROOT / "results").rglob("result.json"):
        assert str(grid.ROOT) not in done.read_text(), done
        # whichever checkout wrote it: every path a run was given is relative (a run made in another checkout
        # than the one it wrote into once kept an absolute save_dir)
        for arg in json.loads(done.read_text()).get("args", []):
            if arg.startswith("--trainer.logger.init_args.save_dir="):
                assert arg.split("=", 1)[1].startswith("./"), (done, arg)


def test_widening_follows_an_edge_choice_outward_then_stops(tmp_path: Path) -> None:
    """A cut grid (3 values, as tiny:small's) whose choice is its smallest value gets the next value outward: first
    the full grid's neighbour does not exist below AdamW's 1e-4, so the one step beyond it, 3e-5; the rule goes no
    further. Without a runner only finished values are added, so a later invocation sees the same grid. A KL budget
    whose α sat at its cap is not widened upward; one below the cap is."""
    plan = parity.Plan(model="tiny:small", updates=40, values=3, methods=("adamw", "logra_best"), out=tmp_path)
    assert plan.values_of("adamw") == (1e-4, 3e-4, 1e-3)
    knob = parity.METHODS["adamw"].knob
    assert knob.next_value((1e-4, 3e-4, 1e-3), 1e-4) == 3e-5
    assert knob.next_value((1e-4, 3e-4, 1e-3), 1e-3) == 3e-3  # the full grid's own neighbour first
    assert knob.next_value((1e-4, 3e-4, 1e-3), 3e-4) is None  # interior: nothing to add
    assert knob.next_value((3e-5, 1e-4, 3e-4), 3e-5) is None  # one step beyond the grid is the last
    score = {3e-5: 0.8, 1e-4: 0.7, 3e-4: 0.6, 1e-3: 0.1}
    for value in plan.values_of("adamw"):
        for seed in plan.tune_seeds:
            _finish(plan.spec("tune", "adamw", value, seed), tmp_path, tune_score=score[value])

    def kl_runs(value: float, capped: int, tune_score: float) -> None:
        for seed in plan.tune_seeds:
            spec = plan.spec("tune", "logra_best", value, seed)
            result = _finish(spec, tmp_path, tune_score=tune_score)
            result["curves"]["kl/alpha"] = [(s, 3.0 if s <= capped else 1.0) for s in range(1, 41)]
            (spec.folder(tmp_path) / "result.json").write_text(json.dumps(result))

    kl_runs(2.0, 0, 0.5)
    kl_runs(4.0, 0, 0.6)
    kl_runs(8.0, 20, 0.7)  # α capped on 50% of updates: the budget still sizes the step
    assert parity.widen(plan, tmp_path).widened == {}  # nothing added has finished yet

    asked: list[list[str]] = []

    def run(specs: list[parity.RunSpec]) -> None:
        asked.append([f"{s.cell} seed {s.seed}" for s in specs])
        for spec in specs:
            if spec.method == "adamw":
                _finish(spec, tmp_path, tune_score=score[spec.value])
            else:
                kl_runs(spec.value, 40, 0.65)  # 16 scores below 8: the choice is interior again

    wide = parity.widen(plan, tmp_path, run)
    assert asked == [["adamw/lr=3e-05 seed 0", "adamw/lr=3e-05 seed 1", "logra_best/kl_scale=16 seed 0",
                      "logra_best/kl_scale=16 seed 1"]]  # fmt: skip
    assert wide.values_of("adamw") == (3e-5, 1e-4, 3e-4, 1e-3) and wide.values_of("logra_best") == (2.0, 4.0, 8.0, 16)
    found = parity.choices(wide, tmp_path)
    assert found["adamw"].value == 3e-5 and found["logra_best"].value == 8.0
    assert parity.widen(plan, tmp_path).widened == wide.widened  # recomputed from disk alone
    cut = "; ".join(parity.cuts(wide))
    assert "adamw: widened by ['3e-05'] (its choice sat at an edge" in cut
    assert "adamw: 3 knob values ['0.0001', '0.0003', '0.001'] of" in cut

    capped = tmp_path / "capped"
    plan = dataclasses.replace(plan, out=capped, methods=("logra_best",))
    for value, frac in ((2.0, 0), (4.0, 0), (8.0, 36)):
        for seed in plan.tune_seeds:
            spec = plan.spec("tune", "logra_best", value, seed)
            result = _finish(spec, capped, tune_score=value / 10)
            result["curves"]["kl/alpha"] = [(s, 3.0 if s <= frac else 1.0) for s in range(1, 41)]
            (spec.folder(capped) / "result.json").write_text(json.dumps(result))
    assert parity.widen(plan, capped, run).widened == {}  # 90% capped: a larger budget is the same run


def test_ablate_runs_the_parity_grid_as_its_own_harness(tmp_path: Path) -> None:
    """``ablate.py --grid parity`` hands every argument to ``parity.py`` (the two share ``grid.py``, not imports)."""
    import subprocess

    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "ablate.py"),
        "--grid",
        "parity",
        "--dry-run",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tune: 38 runs" in done.stdout and "report: 20 runs" in done.stdout
    source = (ROOT / "benchmarks" / "ablate.py").read_text() + (ROOT / "benchmarks" / "parity.py").read_text()
    assert "import parity" not in source and "import ablate" not in source
