"""The paper recipes (configs/paper/, docs/paper.md): each GPU recipe, and each ablation overlay on its base,

- parses exactly as ``logra-pl fit --config ... --print_config`` does (in-process; one real subprocess too),
- instantiates on this CPU machine once its GPU topology is overridden (every constructor's checks run),
- carries a comment on every key and no line over 120 characters,
- holds the paper's settings (SPEC §10, docs/algorithm.md §10), and each overlay changes only what it names,
- names launch commands (``logra-pl serve`` + ``logra-pl fit``) that fit the recipe, and the base recipe's
  one-GPU command (vLLM in the training process) resolves to the recipe with only its topology changed,
- plans offline with ``logra-pl plan`` from the policy's committed ``configs/paper/models/<name>/config.json``.

No model is loaded and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_configs import KEY_VALUE  # the repository's "every key is commented" rule

from logra_pl.cli import LoGRACLI
from logra_pl.data import DapoMath7_5kDataModule
from logra_pl.data.rg_hard import RG_HARD_TASKS, RGHardDataModule
from logra_pl.methods.memory_plan import GiB, plan
from logra_pl.methods.memory_plan import main as plan_main
from logra_pl.module import LoGRAPolicyModule
from logra_pl.rollout.remote import RemoteSettings
from logra_pl.strategy import LoGRAStrategy

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "paper"
MODELS = PAPER / "models"
BASE = PAPER / "math_1.5b_logra.yaml"
RECIPES = sorted(PAPER.glob("*.yaml"))
OVERLAYS = sorted((PAPER / "ablations").glob("*.yaml"))
# Each overlay changes exactly these resolved keys of its base (besides the logger's run name); `kl.` stands for the
# PredictedKLControl callback's init_args. lora_r256 is checked on its own below.
OVERLAY_CHANGES: dict[str, dict[str, Any]] = {
    "rank_4": {"model.logra.rank": 4},
    "rank_16": {"model.logra.rank": 16},
    "rank_64": {"model.logra.rank": 64},
    "rank_256": {},
    "basis_fixed_rademacher": {"model.logra.refresh": False},
    "basis_refreshed_rademacher": {},
    "basis_refreshed_gaussian": {"model.logra.distribution": "gaussian"},
    "kl_none": {"trainer.max_steps": 800, "kl.schedule.kind": "none"},
    "kl_large_constant": {"trainer.max_steps": 800, "kl.schedule.kind": "constant"},
    "kl_small_constant": {
        "trainer.max_steps": 800,
        "kl.schedule.kind": "constant",
        "kl.schedule.delta_max": 2e-5,
    },
    "kl_annealed": {"trainer.max_steps": 800},
    "grpo_dapo": {
        "model.baseline.class_path": "logra_pl.losses.GroupBaseline",
        "model.rollout.responses_per_prompt": 8,
        "model.rollout.dynamic_sampling": True,
        "model.rollout.overlong_buffer": 512,
        "data.init_args.prompts_per_step": 16,
    },
}
CASES = [(recipe,) for recipe in RECIPES] + [(BASE, overlay) for overlay in OVERLAYS]
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto"]
URLS = [f"http://127.0.0.1:{port}" for port in range(8100, 8104)]
# The published config.json numbers of each policy (what the committed copies must hold).
PUBLISHED = {
    "Qwen2.5-Math-1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000,
    ),
    "Qwen2.5-Math-7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000,
    ),
    "Qwen3.5-27B": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        full_attention_interval=4,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when `args` is given while sys.argv holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["logra-pl"])
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # about LightningCLI's internals (as cli.main)


def _id(case: tuple[Path, ...]) -> str:
    return "+".join(p.stem for p in case)


def _args(case: tuple[Path, ...]) -> list[str]:
    return [arg for config in case for arg in ("--config", str(config))]


@functools.cache
def _resolved(case: tuple[Path, ...]) -> dict[str, Any]:
    """What ``--print_config`` prints for ``--config A [--config B]``, as data (parsed, validated, not built)."""
    out = io.StringIO()
    with pytest.raises(SystemExit) as done, contextlib.redirect_stdout(out):
        LoGRACLI(args=[*_args(case), "--print_config"], run=False)
    assert done.value.code in (0, None), f"{_id(case)}: --print_config exited with {done.value.code}"
    cfg = yaml.safe_load(out.getvalue())
    cfg["model"] = _by_section(cfg["model"])
    return cfg


KINDS = {"LoGRAMethod": "logra", "DenseAdamW": "adamw", "LoRAMethod": "lora"}


def _by_section(model: dict[str, Any]) -> dict[str, Any]:
    """The resolved ``model`` with its method's settings under their sections' names (``model.logra``, ``adamw``,
    ``lora``) and the method's kind as ``optimizer``, so the paper's values read as in its tables."""
    method = model.pop("method")
    return model | {"optimizer": KINDS[method["class_path"].rpartition(".")[2]]} | (method.get("init_args") or {})


def _callbacks(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{class name: init_args}`` of the trainer's callbacks."""
    return {cb["class_path"].rpartition(".")[2]: cb.get("init_args") or {} for cb in cfg["trainer"]["callbacks"]}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": leaf}``; the callbacks list is keyed by class name, other lists are leaves."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            path = f"{prefix}.{key}".lstrip(".")
            if path == "trainer.callbacks":
                for cb in item:
                    out |= _flat(cb.get("init_args") or {}, f"callbacks.{cb['class_path'].rpartition('.')[2]}")
            else:
                out |= _flat(item, path)
        return out
    return {prefix: value}


def _policy_config(policy: str) -> Path:
    return MODELS / policy.rpartition("/")[2] / "config.json"


def _header(path: Path) -> str:
    """The leading comment block, one logical line per command (``\\`` continuations joined, comments dropped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(re.sub(r"\s+#.*$", "", line[1:].strip()) if "logra-pl" in line or "--" in line else line[1:])
    return re.sub(r"\\\n\s*", " ", "\n".join(lines))


# The line that opens the base recipe's one-GPU launch, after its 8-GPU commands (docs/gpu.md quotes both blocks).
ONE_GPU = "One GPU:"


def _paper_topology(header: str) -> str:
    """The header without its one-GPU part: the paper's topology (4 engines + 4 training ranks)."""
    return header.split(f"\n {ONE_GPU}")[0]


def _command(header: str, program: str) -> list[str]:
    found = [line for line in header.splitlines() if f"logra-pl {program}" in line]
    assert len(found) == 1, f"expected one `logra-pl {program}` command in the header, found {found}"
    return found[0].split()


def _flags(tokens: list[str]) -> dict[str, str]:
    return {t: tokens[i + 1] for i, t in enumerate(tokens) if t.startswith("--") and i + 1 < len(tokens)}


@functools.cache
def _plan(policy: str, rank: int, train_all: bool = False) -> dict[str, Any]:
    """``logra-pl plan --ranks 4 --rank <rank> --logra-rule paper [--train-all]`` (fp32 weights) of a policy's
    committed config: the paper recipes run the paper's rule."""
    return plan(_policy_config(policy), ranks=4, rank_r=rank, train_all=train_all, logra_rule="paper")


# ------------------------------------------------------------------------------------------------------ parsing
def test_every_recipe_and_overlay_is_covered() -> None:
    assert [p.name for p in RECIPES] == [
        "math_1.5b_adamw.yaml",
        "math_1.5b_logra.yaml",
        "math_27b_logra.yaml",
        "math_7b_adamw.yaml",
        "math_7b_logra.yaml",
        "rg_hard_27b_logra.yaml",
    ]
    assert sorted(p.stem for p in OVERLAYS) == sorted([*OVERLAY_CHANGES, "lora_r256"])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_print_config_parses(case: tuple[Path, ...]) -> None:
    cfg = _resolved(case)
    assert cfg["trainer"]["accelerator"] == "gpu"
    assert cfg["model"]["policy"].startswith("Qwen/")


def test_fit_print_config_on_the_command_line() -> None:
    """The real entry point, as a user types it: base + overlay resolve in a fresh process."""
    cmd = [sys.executable, "-m", "logra_pl.cli", "fit", "--config", str(BASE)]
    cmd += ["--config", str(PAPER / "ablations" / "rank_4.yaml"), "--print_config"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    cfg = yaml.safe_load(done.stdout)
    assert cfg["model"]["method"]["class_path"] == "logra_pl.methods.LoGRAMethod"
    assert cfg["model"]["method"]["init_args"]["logra"]["rank"] == 4
    assert cfg["trainer"]["strategy"]["class_path"] == "logra_pl.strategy.LoGRAStrategy"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_instantiates_with_a_cpu_topology(case: tuple[Path, ...]) -> None:
    """Every object the run builds (module, settings dataclasses, verifier, data module, callbacks, strategy) accepts
    the recipe's values; only the trainer's GPU topology is swapped for one CPU process. No model is loaded."""
    cli = LoGRACLI(args=[*_args(case), *CPU], run=False)
    cfg = _resolved(case)
    assert isinstance(cli.model, LoGRAPolicyModule)
    assert isinstance(cli.datamodule, RGHardDataModule if "rg_hard" in case[0].name else DapoMath7_5kDataModule)
    assert isinstance(cli.model.engine_spec, RemoteSettings)
    built = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert set(_callbacks(cfg)) <= built
    strategy = yaml.safe_load(case[0].read_text())["trainer"]["strategy"]  # as the recipe writes it
    assert isinstance(LoGRAStrategy(**strategy["init_args"]), LoGRAStrategy)


# ----------------------------------------------------------------------------------------------------- comments
@pytest.mark.parametrize("path", RECIPES + OVERLAYS, ids=lambda p: str(p.relative_to(PAPER)))
def test_every_key_is_commented_and_lines_are_short(path: Path) -> None:
    text = path.read_text()
    bare = [
        f"{number}: {line}"
        for number, line in enumerate(text.splitlines(), start=1)
        if (match := KEY_VALUE.match(line)) and not match["value"].startswith("#") and "#" not in line
    ]
    assert not bare, f"{path.name}: keys without a comment:\n" + "\n".join(bare)
    long = [n for n, line in enumerate(text.splitlines(), start=1) if len(line) > 120]
    assert not long, f"{path.name}: lines over 120 characters: {long}"
    assert "Not yet run end to end on GPUs (docs/gpu.md)." in _header(path), "each recipe says it has not been run"


# ------------------------------------------------------------------------------------------------ paper values
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_holds_the_paper_settings(recipe: Path) -> None:
    cfg = _resolved((recipe,))
    trainer, model, data = cfg["trainer"], cfg["model"], cfg["data"]["init_args"]
    callbacks = _callbacks(cfg)
    # Topology (§D.1): 4 FSDP training GPUs + 4 served engines, bf16 compute on fp32 master weights, checkpointing.
    assert (trainer["accelerator"], trainer["devices"], trainer["num_nodes"]) == ("gpu", 4, 1)
    strategy = trainer["strategy"]["init_args"]
    assert trainer["strategy"]["class_path"] == "logra_pl.strategy.LoGRAStrategy"
    assert (strategy["data_parallel_size"], strategy["param_dtype"]) == (4, "bfloat16")
    assert strategy["activation_checkpointing"] and model["activation_checkpointing"]
    assert model["dtype"] == "float32"
    engine = model["engine"]
    assert engine["class_path"] == "logra_pl.rollout.remote.RemoteSettings" and engine["init_args"]["urls"] == URLS
    # The RL step (§3.1, SPEC §8): one response per prompt, 128 prompts, microbatch 1, REINFORCE + TIS, baseline.
    assert model["microbatch_size"] == 1 and data["prompts_per_step"] == 128
    rollout = model["rollout"]
    assert (rollout["responses_per_prompt"], rollout["temperature"], rollout["top_p"]) == (1, 1.0, 1.0)
    assert model["loss"]["class_path"] == "logra_pl.losses.ReinforceTIS"
    assert model["loss"]["init_args"]["tis_cap"] == 2.0
    assert model["baseline"]["class_path"] == "logra_pl.losses.RunningBaseline"
    # Sync: factors for LoGRA, full weights for a dense optimizer; a tolerance for bf16 engines.
    sync = callbacks["PolicySync"]
    assert sync["mode"] == ("factors" if model["optimizer"] == "logra" else "full")
    assert sync["tolerance"] == 0.1 and sync["wire_dtype"] == "auto"
    if model["optimizer"] == "logra":
        logra = model["logra"]
        assert (logra["rank"], logra["distribution"], logra["refresh"]) == (256, "rademacher", True)
        assert callbacks["RolloutMismatch"]["ema"] == 0.3
        schedule = callbacks["PredictedKLControl"]["schedule"]
        assert (schedule["kind"], schedule["delta_max"], schedule["delta_min"]) == ("cosine", 2e-4, 2e-5)
    else:
        assert "PredictedKLControl" not in callbacks and "RolloutMismatch" not in callbacks
        adamw = model["adamw"]
        assert (adamw["lr"], list(adamw["betas"]), adamw["eps"], adamw["weight_decay"]) == (1e-6, [0.9, 0.95], 1e-8, 0)
        assert (adamw["warmup_steps"], adamw["decay_steps"], adamw["min_lr_ratio"]) == (9, 300, 0.1)
    if recipe.name.startswith("math_"):  # §C.1: DAPO-Math-7.5K -> MATH-500, 4 responses at T 0.7 / top-p 0.7
        assert cfg["data"]["class_path"] == "logra_pl.data.DapoMath7_5kDataModule"
        assert (data["path"], data["first_n"]) == ("BytedTsinghua-SIA/DAPO-Math-17k", 7500)
        assert (data["eval_path"], data["eval_split"]) == ("HuggingFaceH4/MATH-500", "test")
        assert model["verifier"]["class_path"] == "logra_pl.rewards.MathVerifier"
        val = (rollout["val_temperature"], rollout["val_top_p"], rollout["val_responses"], rollout["val_pass_at"])
        assert val == (0.7, 0.7, 4, [1, 4])
        assert model["max_tokens_per_microbatch"] == 4096
        if model["optimizer"] == "logra":
            assert model["logra"]["update_rule"] == "rowadam"
            assert callbacks["PredictedKLControl"]["schedule"]["horizon"] == 300
        assert trainer["max_steps"] == (200 if "27b" in recipe.name else 300)  # §D.1: 27B stops at 200
    else:  # §D.2 / §C.2: RG-Hard, SGD sketches, anneal over 1,000 merges, seed 42, 16,384 tokens
        assert cfg["data"]["class_path"] == "logra_pl.data.rg_hard.RGHardDataModule"
        assert (data["tasks"], data["per_task_train"], data["per_task_eval"]) == (RG_HARD_TASKS, 5000, 25)
        assert model["logra"]["update_rule"] == "sgd"
        assert callbacks["PredictedKLControl"]["schedule"]["horizon"] == 1000
        assert cfg["seed_everything"] == model["seed"] == model["logra"]["base_seed"] == data["seed"] == 42
        assert (rollout["val_temperature"], rollout["val_top_p"], rollout["val_responses"]) == (0.7, 0.95, 1)
        assert model["max_tokens_per_microbatch"] == 16384


@pytest.mark.parametrize("overlay", [p for p in OVERLAYS if p.stem != "lora_r256"], ids=lambda p: p.stem)
def test_overlay_changes_only_what_it_names(overlay: Path) -> None:
    base, stacked = _flat(_resolved((BASE,))), _flat(_resolved((BASE, overlay)))
    assert base.keys() == stacked.keys()
    changed = {k: stacked[k] for k in base if base[k] != stacked[k]}
    name = changed.pop("trainer.logger.init_args.name")
    assert name == f"ablation_{overlay.stem}"
    expected = {k.replace("kl.", "callbacks.PredictedKLControl."): v for k, v in OVERLAY_CHANGES[overlay.stem].items()}
    assert changed == expected


def test_lora_overlay() -> None:
    """§3.4.2: LoRA r = 256 (alpha 512, no dropout) by AdamW, merged weights shipped in full, no KL control."""
    base, stacked = _resolved((BASE,)), _resolved((BASE, PAPER / "ablations" / "lora_r256.yaml"))
    model = stacked["model"]
    assert model["optimizer"] == "lora"
    assert (model["lora"]["rank"], model["lora"]["alpha"], model["lora"]["dropout"]) == (256, 512.0, 0.0)
    assert model["adamw"]["lr"] == 1e-5
    callbacks = _callbacks(stacked)
    assert list(callbacks) == ["RunSummary", "HFExport", "MemoryMonitor", "PolicySync"]
    assert callbacks["PolicySync"]["mode"] == "full"
    assert {k: v for k, v in callbacks.items() if k != "PolicySync"} == {
        k: v for k, v in _callbacks(base).items() if k in callbacks and k != "PolicySync"
    }
    ignore = (
        "callbacks.",
        "model.optimizer",
        "model.logra",
        "model.lora",
        "model.adamw",
        "trainer.logger.init_args.name",
    )
    a, b = _flat(base), _flat(stacked)
    same = {k for k in a.keys() | b.keys() if not k.startswith(ignore)}
    assert {k: a.get(k) for k in same} == {k: b.get(k) for k in same}


# -------------------------------------------------------------------------------------------- launch commands
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_header_commands_fit_the_recipe(case: tuple[Path, ...]) -> None:
    cfg = _resolved(case)
    model = cfg["model"]
    header = _paper_topology(_header(case[-1]))
    serve = _flags(_command(header, "serve"))
    fit = _command(header, "fit")
    # The engines: the trainer's policy, 4 of them on GPUs 4-7 at the recipe's URLs, the paper's context.
    assert serve["--model"] == model["policy"]
    assert (serve["--dtype"], serve["--data-parallel-size"], serve["--port"]) == ("bfloat16", "4", "8100")
    assert serve["--devices"] == "4,5,6,7" and "CUDA_VISIBLE_DEVICES=0,1,2,3" in fit
    limit = 16384 if "rg_hard" in case[0].name else 4096
    assert int(serve["--max-model-len"]) == limit
    assert limit - model["rollout"]["max_new_tokens"] >= 512, "room for the prompt"
    if serve["--sync-mode"] == "shadow":
        assert serve["--master-dtype"] == model["dtype"]
    else:  # inplace bf16 engines drift from fp32 weights unless every trained tensor is resent each update
        assert serve["--sync-mode"] == "inplace"
        if model["optimizer"] == "adamw":
            assert model["adamw"]["train_all"]
    # One request must hold a LoGRA payload (bf16 d_out x r per matrix = half the fp32 sketches) or a weight chunk.
    request_mib = float(serve.get("--max-request-mib", 1024))
    assert model["engine"]["init_args"]["chunk_mib"] < request_mib
    if model["optimizer"] == "logra":
        rows = _plan(model["policy"], model["logra"]["rank"])
        assert rows["logra"].report.sketches / 2 / 2**20 < request_mib
    # The fit command: these files, in order.
    configs = [fit[i + 1] for i, t in enumerate(fit) if t == "--config"]
    assert configs == [str(p.relative_to(ROOT)) for p in case]


def test_one_gpu_command_changes_only_the_topology() -> None:
    """The base recipe's one-GPU launch: one training process (the recipe's LoGRAStrategy block kept: bf16 params,
    activation checkpointing) with a bf16 vLLM engine in it, synced exactly (shadow), at the served engines'
    context; every other setting is the recipe's. Only the base recipe has one."""
    header = _header(BASE)
    assert header.count(f"\n {ONE_GPU}") == 1
    part = header.split(f"\n {ONE_GPU}")[1]
    assert not [line for line in part.splitlines() if "logra-pl serve" in line]
    tokens = _command(part, "fit")
    assert tokens[:3] == ["CUDA_VISIBLE_DEVICES=0", "logra-pl", "fit"]
    args = tokens[3:]
    assert [args[i + 1] for i, t in enumerate(args) if t == "--config"] == [str(BASE.relative_to(ROOT))]
    out = io.StringIO()
    with pytest.raises(SystemExit) as done, contextlib.redirect_stdout(out):
        LoGRACLI(args=[*_args((BASE,)), *args[2:], "--print_config"], run=False)
    assert done.value.code in (0, None)
    printed = yaml.safe_load(out.getvalue())
    one, paper = _flat({**printed, "model": _by_section(printed["model"])}), _flat(_resolved((BASE,)))
    changed = {k: one.get(k) for k in one.keys() | paper.keys() if one.get(k, "<absent>") != paper.get(k, "<absent>")}
    engine = {k.removeprefix("model.engine.init_args."): v for k, v in changed.items() if ".engine.init_args." in k}
    assert engine.pop("urls") is None and engine.pop("api_key_env") is None  # the served engines' keys are gone
    assert changed.pop("model.engine.class_path") == "logra_pl.rollout.vllm.VLLMSettings"
    assert int(changed.pop("trainer.devices")) == 1
    assert changed.pop("trainer.strategy.init_args.data_parallel_size") == 1
    assert changed.pop("trainer.logger.init_args.name") == "math_1.5b_logra_1gpu"
    assert {k for k in changed if not k.startswith("model.engine.init_args.")} == set()
    # The engine: bf16, exact sync into an fp32 master copy, the served engines' context (serve --max-model-len).
    serve = _flags(_command(_paper_topology(header), "serve"))
    assert (engine["dtype"], engine["sync_mode"]) == ("bfloat16", "shadow") and paper["model.dtype"] == "float32"
    assert engine["max_model_len"] == int(serve["--max-model-len"])
    assert engine["max_model_len"] - paper["model.rollout.max_new_tokens"] >= 512, "room for the prompt"
    cli = LoGRACLI(args=[*_args((BASE,)), *args[2:], "--trainer.accelerator=cpu"], run=False)  # constructors' checks
    assert type(cli.trainer.strategy) is LoGRAStrategy and cli.trainer.num_devices == 1
    assert type(cli.model.engine_spec).__name__ == "VLLMSettings"
    for other in [*RECIPES, *OVERLAYS]:
        if other != BASE:
            assert ONE_GPU not in _header(other), other.name


# ------------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_committed_model_config_is_the_published_one(name: str) -> None:
    data = json.loads((MODELS / name / "config.json").read_text())
    fields = data.get("text_config", data)
    if "rope_theta" not in fields and "rope_parameters" in fields:
        fields = {**fields, "rope_theta": fields["rope_parameters"]["rope_theta"]}
    assert {k: fields[k] for k in PUBLISHED[name]} == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_logra_pl_plan_runs_offline(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`logra-pl plan --model configs/paper/models/<name>/config.json --ranks 4 --rank 256 --weight-dtype float32`."""
    plan_main(
        ["--model", str(MODELS / name / "config.json"), "--ranks", "4", "--rank", "256", "--weight-dtype", "float32"]
    )
    out = capsys.readouterr().out
    assert "adamw" in out and "lora" in out and "logra" in out and "total" in out


def test_logra_pl_plan_entry_point() -> None:
    cmd = [
        sys.executable,
        "-m",
        "logra_pl.cli",
        "plan",
        "--model",
        "configs/paper/models/Qwen2.5-Math-1.5B/config.json",
    ]
    done = subprocess.run(
        [*cmd, "--ranks", "4", "--rank", "256"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "logra / adamw total" in done.stdout


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_recipe_plans_from_its_policy_config(case: tuple[Path, ...]) -> None:
    """The recipe's own optimizer, rank, dtype and targets, on its policy's committed config (rank <= d_in checked)."""
    cfg = _resolved(case)
    model = cfg["model"]
    name = model["optimizer"]
    logra = model.get("logra") or {}
    kwargs = {"targets": tuple(logra["targets"])} if logra.get("targets") else {}
    rank = model["lora"]["rank"] if name == "lora" else logra.get("rank", 256)
    rows = plan(
        _policy_config(model["policy"]),
        ranks=cfg["trainer"]["devices"],
        rank_r=rank,
        optimizers=[name],
        weight_dtype=model["dtype"],
        train_all=bool((model.get("adamw") or {}).get("train_all")),
        **kwargs,
    )
    report = rows[name].report
    assert report.total > report.weights > 0
    if name == "logra":
        assert report.gradients == report.optimizer_state == 0 and report.sketches > 0


def test_docs_plan_tables_match_the_planner() -> None:
    """docs/paper.md's per-model tables hold the planner's current totals (GiB, as `logra-pl plan` prints them)."""
    sections = (ROOT / "docs" / "paper.md").read_text().split("\n### ")
    for name in PUBLISHED:
        rows = _plan(f"Qwen/{name}", 256)
        (section,) = [s for s in sections if s.startswith(name)]
        (line,) = [ln for ln in section.splitlines() if ln.startswith("| **planner total** |")]
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        totals = [f"{rows[o].report.total / GiB:.3f}" for o in ("adamw", "lora", "logra")]
        assert [c.split()[0] for c in cells] == totals, (name, line)
        every = _plan(f"Qwen/{name}", 256, train_all=True)["adamw"].report.total / GiB
        assert cells[0].split()[1] == f"({every:.3f})", (name, "--train-all", line)
