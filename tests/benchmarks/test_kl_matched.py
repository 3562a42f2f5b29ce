"""benchmarks/kl_matched.py: every method's run config carries the same step control (only the method differs), the
settings key ignores where a run writes, and the report reads finished runs into its table and goal line.

Quick paths only: the "finished runs" are ``result.json`` files written by the test (nothing is trained).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kl_matched  # noqa: E402

MiB = 2**20


def _runs(out: Path) -> list[kl_matched.Run]:
    setup = kl_matched.MODELS["smollm2"]
    return kl_matched.plan_runs("smollm2", setup, list(kl_matched.METHODS), (0, 1, 2), out)


SEARCH_KEYS = ("max_overshoot", "max_backtracks", "search_responses")


def test_every_method_runs_under_the_same_control_and_data(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    setup = kl_matched.MODELS["smollm2"]
    assert len(runs) == len(setup.budgets) * 3 * len(kl_matched.METHODS)
    first = [r for r in runs if r.budget == setup.budgets[0] and r.seed == 0]
    assert [r.method for r in first] == list(kl_matched.METHODS)
    shared = None
    for run in first:
        cfg = run.config
        control = cfg["trainer"]["callbacks"][-1]
        assert control["class_path"].endswith("PredictedKLControl")
        args = control["init_args"]
        assert args["alpha_max"] == kl_matched.ALPHA_MAX and args["calibrate"] is True
        assert args["schedule"] == {
            "kind": "cosine",
            "delta_max": setup.budgets[0],
            "delta_min": setup.budgets[0] / 4,
            "horizon": setup.updates,
        }
        assert cfg["model"]["verifier"]["class_path"] == "logra_pl.rewards.MathVerifier"
        assert cfg["model"]["warm_start"] is None and cfg["model"]["policy"] == "smollm2"
        assert cfg["trainer"]["max_steps"] == setup.updates
        assert cfg["trainer"]["logger"]["init_args"]["save_dir"] == str(run.folder)  # outside the checkout: as given
        # Everything but the method's own sections is the same for every method.
        rest = json.loads(json.dumps(cfg))
        for key in ("optimizer", "method", "logra", "adamw", "lora"):
            rest["model"].pop(key, None)
        rest["trainer"]["logger"]["init_args"].pop("save_dir")
        # ... and the line search, which only the line-search methods add (on every response of the batch).
        searched = {k: rest["trainer"]["callbacks"][-1]["init_args"].pop(k, None) for k in SEARCH_KEYS}
        if run.method.endswith("_ls"):
            assert searched == {**kl_matched.LINE_SEARCH, "search_responses": setup.prompts_per_step}, run.method
        elif run.method.endswith(("_ls4", "_horizon")):  # the search as a guard, at 4× (the horizon rule has it)
            guard = {**kl_matched.LINE_SEARCH, "max_overshoot": 4.0, "search_responses": setup.prompts_per_step}
            assert searched == guard, run.method
        elif run.method.endswith("_ls16"):  # the wide guard, at 16×
            guard = {**kl_matched.LINE_SEARCH, "max_overshoot": 16.0, "search_responses": setup.prompts_per_step}
            assert searched == guard, run.method
        else:
            assert searched == dict.fromkeys(SEARCH_KEYS), run.method
        shared = rest if shared is None else shared
        assert rest == shared, run.method
    by_method = {r.method: r.config["model"] for r in first}
    assert by_method["sgd"]["method"]["class_path"] == "logra_pl.methods.sgd.DenseSGD"
    assert by_method["logra_levers"]["logra"]["step_mode"] == "adam"
    assert by_method["logra_paper"]["logra"]["ratio_scope"] == "global"
    assert by_method["adamw"]["optimizer"] == "adamw" and by_method["adamw"]["adamw"]["decay_steps"] == setup.updates
    assert by_method["lora"]["optimizer"] == "lora" and by_method["lora"]["lora"]["rank"] == 64
    seeds = {r.seed: r.config for r in runs if r.method == "logra_paper" and r.budget == setup.budgets[0]}
    assert seeds[1]["seed_everything"] == 1 and seeds[1]["model"]["logra"]["base_seed"] == 1
    # Each seed its own prompt stream over the same problems and held-out set.
    assert seeds[0]["data"]["shuffle_seed"] == 0 and seeds[1]["data"]["shuffle_seed"] == 1
    assert seeds[0]["data"]["seed"] == seeds[1]["data"]["seed"]
    heldout = [c for c in seeds[0]["trainer"]["callbacks"] if c["class_path"].endswith("HeldOutKL")]
    assert heldout and heldout[0]["init_args"]["prompts"] == kl_matched.HELDOUT_PROMPTS
    assert kl_matched.NEXT_BATCH_GAIN in seeds[0]["trainer"]["callbacks"]  # not required: not every method can
    # The decomposition's methods: sign-SGD is Adam with β = (0, 0); the full-rank sketch is orthogonal everywhere.
    assert by_method["signsgd"]["adamw"]["betas"] == [0.0, 0.0]
    assert by_method["adamw_nomomentum"]["adamw"]["betas"] == [0.0, 0.95]
    assert by_method["sgd_momentum"]["method"]["init_args"]["sgd"]["momentum"] == 0.9
    full = by_method["logra_levers_full"]["logra"]
    assert full["clip_rank"] and full["distribution"] == "hadamard" and full["step_mode"] == "adam"
    assert by_method["logra_levers_fixed"]["logra"]["refresh"] is False


def test_the_settings_key_ignores_where_a_run_writes(tmp_path: Path) -> None:
    a, b = _runs(tmp_path / "a")[0], _runs(tmp_path / "b")[0]
    assert a.key == b.key
    other = _runs(tmp_path / "a")[1]
    assert other.key != a.key
    assert kl_matched.relative(ROOT / "results" / "x") == "results/x"


def _finish(run: kl_matched.Run, gain: float, val: float, kl: float, state: float) -> None:
    run.folder.mkdir(parents=True)
    result = {"key": run.key, "method": run.method, "budget": run.budget, "seed": run.seed, "failed": False}
    result |= {"reward_gain": gain, "val_final": val, "kl_realized": kl, "kl_realized_over_budget": 1.0}
    result |= {"alpha_at_cap": 0.0, "alpha_median": 0.1, "training_state_bytes": state, "wall_s": 60.0}
    result |= {"updates": 50, "reward_window": 10, "curves": {}}
    (run.folder / "result.json").write_text(json.dumps(result))


def test_the_report_tables_finished_runs_with_ratios_and_the_goal_line(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    budget = runs[0].budget
    numbers = {  # gain, pass@1, state (MiB): LoGRA's levers beat AdamW and LoRA at a tenth of the state
        "logra_paper": (0.05, 0.30, 40),
        "logra_levers": (0.20, 0.50, 40),
        "adamw": (0.10, 0.50, 400),
        "sgd": (0.08, 0.45, 200),
        "lora": (0.12, 0.50, 100),
    }
    for run in runs:
        if run.budget == budget and run.method in numbers:
            gain, val, state = numbers[run.method]
            _finish(run, gain + 0.01 * run.seed, val + 0.02 * run.seed, 1e-3, state * MiB)
    report = kl_matched.collect("smollm2", kl_matched.MODELS["smollm2"], runs, 0.2)
    assert {c["method"] for c in report["cells"].values()} == set(numbers)
    text = kl_matched.table(report, budget)
    row = next(line for line in text.splitlines() if line.startswith("| LoGRA, levers"))
    assert "+0.210 ± 0.010" in row and "| 1.91 |" in row and "| 0.100 |" in row
    assert "| – |" in row  # results summarized without the per-update calibration
    goal = kl_matched.goal_line(report, budget)
    assert "LoGRA, levers (r = 64): **MET**" in goal
    assert "LoGRA, paper rule (r = 64): **MISSED**" in goal
    # Seed by seed (one prompt stream per seed): the levers gain 0.10 more than AdamW and 0.08 more than LoRA on each.
    levers = next(line for line in goal.splitlines() if "LoGRA, levers (r = 64)" in line)
    assert "Paired by seed: +0.100 ± 0.000 (3 seeds, 0 below) against AdamW" in levers
    assert "+0.080 ± 0.000 (3 seeds, 0 below) against LoRA" in levers
    paper = next(line for line in goal.splitlines() if "LoGRA, paper rule (r = 64)" in line)
    assert "-0.050 ± 0.000 (3 seeds, 3 below) against AdamW" in paper
    assert "not yet measured" in kl_matched.goal_line(report, runs[-1].budget)
    for cell in report["cells"].values():  # two seeds of three: no verdict
        cell["runs"].pop("2")
        cell["summary"] = kl_matched.aggregate(list(cell["runs"].values()), kl_matched.KEYS)
    assert "LoGRA, levers (r = 64): not judged — 2 seed(s) shared by the three cells" in kl_matched.goal_line(
        report, budget
    )
    assert "the last 10 updates' mean train reward minus the first 10's (20% of the run" in kl_matched.window_text(
        report, 50
    )


def test_the_report_finds_every_finished_seed(tmp_path: Path) -> None:
    """A cell grown past the model's seeds (here seed 5) is reported whole without naming its seeds; a folder that is
    not a seed's or holds no result is not a seed."""
    setup = kl_matched.MODELS["smollm2"]
    budget = setup.budgets[0]
    for seed in (0, 1, 5):
        run = kl_matched.plan_runs("smollm2", setup, ["adamw"], (seed,), tmp_path)[0]
        _finish(run, 0.1 * seed, 0.5, 1e-3, 400 * MiB)
    (tmp_path / kl_matched.cell_name("adamw", budget) / "seed7").mkdir()  # started, not finished
    (tmp_path / kl_matched.cell_name("adamw", budget) / "seedling" / "result.json").parent.mkdir()
    (tmp_path / kl_matched.cell_name("adamw", budget) / "seedling" / "result.json").write_text("{}")
    assert kl_matched.finished_seeds(tmp_path, setup.budgets, ["adamw", "lora"]) == {0, 1, 5}
    assert kl_matched.finished_seeds(tmp_path, setup.budgets, ["lora"]) == set()
    runs = kl_matched.plan_runs("smollm2", setup, ["adamw"], (0, 1, 2, 5), tmp_path)
    cell = kl_matched.collect("smollm2", setup, runs, 0.2)["cells"][kl_matched.cell_name("adamw", budget)]
    assert sorted(cell["runs"]) == ["0", "1", "5"] and cell["summary"]["reward_gain"]["n"] == 3


def test_the_goal_is_judged_on_the_seeds_the_three_cells_share(tmp_path: Path) -> None:
    """LoRA grown to six seeds whose last three gain far more: over all its seeds its mean (0.35) is above the rule's
    (0.22), yet on the three prompt streams the rule also trained on the rule gains 0.10 more on each. The verdict and
    its numbers are the shared seeds'; a failed run is not a shared seed."""
    setup = kl_matched.MODELS["smollm2"]
    budget = setup.budgets[0]
    gains = {"adamw": [0.1, 0.1, 0.1], "lora": [0.1, 0.1, 0.1, 0.6, 0.6, 0.6], "logra_adam_fixed": [0.2, 0.2, 0.2, 0.3]}
    states = {"adamw": 400, "lora": 100, "logra_adam_fixed": 30}
    for method, values in gains.items():
        for seed, gain in enumerate(values):
            run = kl_matched.plan_runs("smollm2", setup, [method], (seed,), tmp_path)[0]
            _finish(run, gain, 0.9 + 0.01 * seed, 1e-3, states[method] * MiB)
    runs = kl_matched.plan_runs("smollm2", setup, list(gains), range(6), tmp_path)
    report = kl_matched.collect("smollm2", setup, runs, 0.2)
    cells = {c["method"]: c for c in report["cells"].values()}
    assert cells["lora"]["summary"]["reward_gain"]["mean"] > cells["logra_adam_fixed"]["summary"]["reward_gain"]["mean"]
    assert kl_matched.shared_seeds(cells["logra_adam_fixed"], cells["adamw"], cells["lora"]) == ["0", "1", "2"]
    line = next(
        x for x in kl_matched.goal_line(report, budget).splitlines() if "sketch-space Adam, fixed projection" in x
    )
    assert "**MET** on the 3 seeds the three cells share" in line
    assert "reward gain +0.200 vs AdamW +0.100 and LoRA +0.100" in line and "state 0.075× AdamW's" in line
    assert "+0.100 ± 0.000 (3 seeds, 0 below) against LoRA" in line
    cells["adamw"]["runs"]["2"]["failed"] = True
    line = next(
        x for x in kl_matched.goal_line(report, budget).splitlines() if "sketch-space Adam, fixed projection" in x
    )
    assert "not judged — 2 seed(s) shared by the three cells" in line and "(2 seeds, 0 below) against AdamW" not in line


def test_a_cell_counts_its_take_offs_and_when_they_happened(tmp_path: Path) -> None:
    """A run takes off at the first update whose rolling mean of 10 train rewards reaches 0.5 (counted from 1); a run
    that never does stalled. The table shows how many took off and their median update."""
    setup = kl_matched.MODELS["smollm2"]
    budget = setup.budgets[0]
    stalled = [0.2] * 50
    early = [0.0] * 10 + [1.0] * 40  # rolling means 0.1, 0.2, ... reach 0.5 at the 15th update
    late = [0.0] * 30 + [0.6] * 20  # reaches 0.5 only once the window holds nine 0.6's: (9 × 0.6) / 10 = 0.54
    curves = {0: early, 1: stalled, 2: late}
    runs = kl_matched.plan_runs("smollm2", setup, ["adamw"], (0, 1, 2), tmp_path)
    for run in runs:
        _finish(run, 0.1, 0.5, 1e-3, 400 * MiB)
        result = json.loads((run.folder / "result.json").read_text())
        result["curves"] = {"train/reward_mean": [[i, v] for i, v in enumerate(curves[run.seed])]}
        (run.folder / "result.json").write_text(json.dumps(result))
    by_seed = {run.seed: kl_matched.take_off(kl_matched.load_result(run)) for run in runs}
    assert by_seed == {0: 15, 1: None, 2: 39}
    report = kl_matched.collect("smollm2", setup, runs, 0.2)
    cell = report["cells"][kl_matched.cell_name("adamw", budget)]
    assert cell["take_off"] == {"runs": 3, "took_off": 2, "update_median": 27}
    row = next(line for line in kl_matched.table(report, budget).splitlines() if line.startswith("| dense AdamW"))
    assert "| 2/3 (update 27) |" in row
    cell["runs"]["2"]["failed"] = True  # a failed run is not counted, a run without its curve neither
    cell["runs"]["0"]["curves"] = {}
    assert kl_matched.take_offs(cell) == {"runs": 1, "took_off": 0, "update_median": None}


def test_the_calibration_per_update_is_read_from_the_log_and_tabled(tmp_path: Path) -> None:
    """``kl/realized`` over ``kl/predicted_scaled`` update by update (an update without a prediction is left out),
    written by ``--stage resummarize`` from a real TensorBoard log into ``result.json`` and shown in the table."""
    from torch.utils.tensorboard import SummaryWriter

    realized = [1.0e-3, 1.1e-3, 0.5e-3, 2.0e-3, 1.0e-3]
    predicted = [1.0e-3, 1.0e-3, 1.0e-3, 1.0e-3, 0.0]  # ratios 1.0, 1.1, 0.5, 2.0; the last has none
    run, other = _runs(tmp_path)[:2]
    _finish(run, 0.2, 0.5, 1e-3, 40 * MiB)
    _finish(other, 0.1, 0.4, 1e-3, 40 * MiB)
    writer = SummaryWriter(str(run.folder / "tb" / "version_0"))
    for step, (r, p) in enumerate(zip(realized, predicted, strict=True)):
        writer.add_scalar("kl/realized", r, step)
        writer.add_scalar("kl/predicted_scaled", p, step)
        writer.add_scalar("train/reward_mean", 0.0 if step == 2 else 0.1 * step, step)  # 0 and 2 scored nothing
        writer.add_scalar("train/update_gain", 0.01 * (step + 1), step)
        writer.add_scalar("kl/heldout_realized", 2 * r, step)
        writer.add_scalar("kl/gain_per_sqrt_kl", float(step), step)
        writer.add_scalar("kl/backtracks", float(step % 2), step)  # the line search cut updates 1 and 3
        writer.add_scalar("kl/skipped_updates", 1.0 if step >= 4 else 0.0, step)
        if step:  # the step before this one, measured on this update's loss: 3·√KL of that step (−1·√KL on batch 2)
            writer.add_scalar("train/next_batch_gain", (-1 if step == 2 else 3) * realized[step - 1] ** 0.5, step)
            writer.add_scalar("train/next_batch_retention", 0.25 * step, step)
    writer.close()

    assert kl_matched.resummarize([run, other]) == 1  # the other run has no log: left as it was
    result = json.loads((run.folder / "result.json").read_text())
    assert result["key"] == run.key and result["wall_s"] == 60.0 and result["seed"] == run.seed
    assert result["kl_ratio_median"] == pytest.approx(1.05)
    assert result["kl_ratio_min"] == pytest.approx(0.5) and result["kl_ratio_max"] == pytest.approx(2.0)
    assert result["kl_ratio_off"] == pytest.approx(0.5)  # 0.5 and 2.0 are off by more than 1.25x
    assert "kl_ratio_median" not in json.loads((other.folder / "result.json").read_text())
    # The direction's medians over the updates: gains 0.01..0.05, held-out KL twice the batch's at every update.
    assert result["gain_median"] == pytest.approx(0.03) and result["gain_per_sqrt_kl"] == pytest.approx(2.0)
    assert result["heldout_over_inbatch"] == pytest.approx(2.0) and result["heldout_kl"] == pytest.approx(2.0e-3)
    assert result["curves"]["train/update_gain"][0] == [0, pytest.approx(0.01)]
    # Each next-batch gain over √KL of the step it measures (logged one update earlier): 3 at every update but on
    # batch 2 (−1), which scored nothing; its share of those steps' own gains (0.01..0.04), from sums.
    nexts = [(-1 if i == 1 else 3) * r**0.5 for i, r in enumerate(realized[:-1])]
    assert result["next_gain_per_sqrt_kl"] == pytest.approx((3 - 1 + 3 + 3) / 4)
    assert result["next_gain_per_sqrt_kl_scored"] == pytest.approx(3.0)  # batches 1, 3, 4
    assert result["unscored_share"] == pytest.approx(2 / 5)
    assert result["reward_mean"] == pytest.approx((0.0 + 0.1 + 0.0 + 0.3 + 0.4) / 5)  # over every update
    # A result summarized before these three measures existed gets them from the curves it keeps.
    measures = ("next_gain_per_sqrt_kl_scored", "unscored_share", "reward_mean")
    older = {k: v for k, v in result.items() if k not in measures}
    (run.folder / "result.json").write_text(json.dumps(older))
    loaded = kl_matched.load_result(run)
    assert loaded["next_gain_per_sqrt_kl_scored"] == pytest.approx(3.0)
    assert loaded["unscored_share"] == pytest.approx(2 / 5)
    assert loaded["reward_mean"] == pytest.approx(0.16)
    assert result["next_gain_mean"] == pytest.approx(sum(nexts) / 4)
    assert result["carried_share"] == pytest.approx(sum(nexts) / 0.1)

    report = kl_matched.collect("smollm2", kl_matched.MODELS["smollm2"], [run, other], 0.2)
    main_row = next(line for line in kl_matched.table(report, run.budget).splitlines() if "paper" in line)
    assert "| 1.05 (0.50–2.00; 50% off) |" in main_row
    assert "| 0.160 ± 0.000 |" in main_row  # the mean train reward (this cell's one seed)
    row = next(line for line in kl_matched.direction_table(report, run.budget).splitlines() if "paper" in line)
    assert "| 3.00e-02 ± 0.0e+00 |" in row and "| 2.00 ± 0.00 |" in row
    carried = kl_matched.carry_table(report, run.budget).splitlines()
    share = f"{sum(nexts) / 0.1:.3f} ± 0.000"
    assert len(carried) == 3  # the other has none
    assert carried[2].endswith(f"| {share} | 2.000 ± 0.000 | 3.000 ± 0.000 | 0.40 ± 0.00 |")
    assert result["backtracked"] == pytest.approx(0.4) and result["skipped_updates"] == 1.0
    assert "LoGRA, paper rule (r = 64): 0.40 ± 0.00 of updates cut, 1.0 ± 0.0 skipped per run" in (
        kl_matched.line_search_line(report, run.budget)
    )


def test_a_run_from_before_a_pure_measure_is_the_same_run(tmp_path: Path) -> None:
    """A finished run whose config lacks the NextBatchGain callback (written before it existed) is rekeyed to the
    planned run: the callback changes no update. A run that differs in anything else is not."""
    import yaml

    run, other = _runs(tmp_path)[:2]
    for r in (run, other):
        old = json.loads(json.dumps(r.config))
        old["trainer"]["callbacks"].remove(kl_matched.NEXT_BATCH_GAIN)
        if r is other:
            old["model"]["microbatch_size"] += 1
        r.folder.mkdir(parents=True)
        (r.folder / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
        (r.folder / "result.json").write_text(json.dumps({"key": kl_matched.config_key(old), "reward_gain": 0.5}))
    assert kl_matched.rekey([run, other]) == 1
    assert kl_matched.load_result(run) == {"key": run.key, "reward_gain": 0.5}
    assert kl_matched.load_result(other) is None
