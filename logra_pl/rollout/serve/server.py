"""``logra-pl serve``: vLLM engines behind an HTTP API that speaks the rollout-engine contract (algorithm.md §9).

The paper's topology puts the training ranks and the generation engines on different GPUs, often different hosts.
``logra-pl serve`` runs one vLLM engine — vLLM's own ``AsyncLLM`` engine client, built by vLLM's server machinery,
with the :class:`~logra_pl.rollout.vllm_worker.LoGRAWorkerExtension` in every worker — behind a small FastAPI app
run by uvicorn (both ship with vLLM). :class:`~logra_pl.rollout.remote.RemoteEngine` is the trainer's side. Three
modules, one concern each:

- :mod:`logra_pl.rollout.protocol`: the API (version 1, every path under ``/v1``; docs/serving.md): request and
  answer models and header names, shared with the trainer's client;
- :mod:`logra_pl.rollout.serve.app`: the FastAPI routes (:func:`build_app`);
- :mod:`logra_pl.rollout.serve.state`: the engine's state (:class:`EngineState`): the weights version
  (:mod:`logra_pl.rollout.versions`), the checks every payload and weight chunk passes, the readers/writer lock;
- :mod:`logra_pl.rollout.serve.settings`: what ``logra-pl serve`` starts (:class:`ServeSettings`);
- this module: the launch — the ``logra-pl serve`` flags, one engine per process, and ``--data-parallel-size``
  engine processes supervised.

**Weight versions.** The server's weights carry a version string. Every weight change names the version it
expects to replace and the one it creates; a change that does not start from the server's version is refused
with 409, so a lost or duplicated update is detected instead of applied twice (a request repeated after its
response was lost finds the new version in place and is answered 200 without applying it again). A generate
request may name the version it expects: then it is refused (409) rather than sampled from other weights. A
fresh server starts at ``base:<engine id>``, so a restarted engine is recognised by its version. Every weight
change ends with ``reset_prefix_cache`` (KV blocks computed with old weights must not be reused) and waits for
running generations to finish first.

**Safety.** The server binds to 127.0.0.1 unless told otherwise; bound anywhere else it refuses to start without an
API key (``--api-key`` or ``LOGRA_PL_API_KEY``), which every weight-changing request must then carry as
``Authorization: Bearer <key>``. Request bodies are bounded (``--max-request-mib``). A payload or weight chunk is
parsed and checked — names, shapes, finiteness — before it reaches the engine, so a malformed one gets a 4xx and
leaves the weights untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from logra_pl.rollout.protocol import API_KEY_ENV
from logra_pl.rollout.serve.app import build_app
from logra_pl.rollout.serve.settings import ServeSettings, is_loopback
from logra_pl.rollout.serve.state import EngineState, RequestError, WeightsLock, checkpoint_shapes

__all__ = [  # the app and the state lived here before the split: re-exported
    "READY_LINE",
    "EngineState",
    "RequestError",
    "ServeSettings",
    "WeightsLock",
    "build_app",
    "checkpoint_shapes",
    "is_loopback",
    "main",
    "parse_args",
    "run_engines",
    "serve_engine",
    "served_model_folder",
]

READY_LINE = "logra-pl serve: ready at"


# ----------------------------------------------------------------------------------------------- the model
def served_model_folder(source: str, dtype: str) -> Path:
    """A safetensors folder of ``source`` that vLLM can read (written once to the cache when needed)."""
    from logra_pl.models.load import load_policy, resolve_source
    from logra_pl.rollout.vllm import engine_model_folder

    resolved = resolve_source(source)
    return engine_model_folder(source, resolved, dtype, lambda: load_policy(source, dtype=getattr(torch, dtype)))


# ----------------------------------------------------------------------------------------------- running
async def serve_engine(settings: ServeSettings) -> None:
    """Build one vLLM engine (vLLM's engine-client machinery), then serve the API until SIGINT/SIGTERM."""
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args

    from logra_pl.rollout.vllm import VLLMSettings, engine_kwargs

    folder = served_model_folder(settings.model, settings.master_dtype)
    vs = VLLMSettings(
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        kv_cache_gib=settings.kv_cache_gib,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        sync_mode=settings.sync_mode,
        max_num_seqs=settings.max_num_seqs,
        seed=settings.seed,
    )
    kwargs = engine_kwargs(vs, str(folder), settings.master_dtype, in_process=False)
    engine_args = AsyncEngineArgs(**kwargs, disable_log_stats=True)
    async with build_async_engine_client_from_engine_args(engine_args) as client:
        info = await client.collective_rpc("logra_setup", args=(settings.sync_mode, settings.master_dtype))
        state = EngineState(client, settings, folder, info)
        app = build_app(state)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level="warning", timeout_keep_alive=60, access_log=False
        )
        server = uvicorn.Server(config)
        url = f"http://{settings.host}:{settings.port}"
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            mode = info[0].get("mode")
            print(f"{READY_LINE} {url} (model {settings.model}, {mode} sync, {state.version})", flush=True)
        await task


def run_engines(settings: ServeSettings) -> int:
    """Start ``data_parallel_size`` engine processes (one port and device group each) and wait for them."""
    groups = settings.device_groups()
    children: list[subprocess.Popen[bytes]] = []
    for i, devices in enumerate(groups):
        env = dict(os.environ)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        if settings.api_key:
            env[API_KEY_ENV] = settings.api_key
        child = asdict(settings) | {"data_parallel_size": 1, "port": settings.port + i, "devices": None}
        child.pop("api_key")
        args = [sys.executable, "-m", "logra_pl.cli", "serve", *_as_flags(child)]
        children.append(subprocess.Popen(args, env=env))
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                c.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [c.wait() for c in children]
    return 0 if stopping else max(codes)


def _as_flags(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out += [flag, str(value)]
    return out


class _DefaultsHelp(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it (or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: {action.default})"


def serve_parser() -> argparse.ArgumentParser:
    """The ``logra-pl serve`` flags, each with its help and default (``--help`` lists them)."""
    defaults = ServeSettings()
    p = argparse.ArgumentParser(
        prog="logra-pl serve",
        description="Serve vLLM engines with LoGRA factor sync over HTTP (docs/serving.md).",
        formatter_class=_DefaultsHelp,
    )
    p.add_argument("--model", default=defaults.model, help="folder | tiny[:preset] | smollm2 | file.gguf | hub id")
    p.add_argument("--dtype", default=defaults.dtype, help="engine dtype: float32 | bfloat16 | float16")
    p.add_argument(
        "--master-dtype", default=defaults.master_dtype, help="dtype of the trainer's weights (the shadow master copy)"
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor-parallel ranks per engine")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engines, on ports port..port+D-1")
    p.add_argument("--host", default=defaults.host, help="bind address (a non-loopback one needs --api-key)")
    p.add_argument("--port", type=int, default=defaults.port, help="port of the first engine")
    p.add_argument("--devices", default=None, help="GPU ids split over the engines, e.g. 4,5,6,7 (default: all)")
    p.add_argument(
        "--api-key", default=None, help=f"token for weight-changing requests (default: ${API_KEY_ENV}, else none)"
    )
    p.add_argument(
        "--max-request-mib", type=float, default=defaults.max_request_mib, help="largest request body accepted"
    )
    p.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib, help="KV cache (the CPU build only)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.gpu_memory_utilization,
        help="share of each GPU's memory vLLM may take (weights, KV cache)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + response limit (default: the model's)")
    p.add_argument(
        "--max-num-seqs", type=int, default=defaults.max_num_seqs, help="sequences an engine decodes at once"
    )
    p.add_argument(
        "--sync-mode",
        default="auto",
        help="shadow: a master copy in --master-dtype takes the updates and the engine gets its cast (exact "
        "against the trainer); inplace: the engine's own weights take them (no copy; in bf16 they drift from the "
        "trainer's); auto: shadow on CPU, inplace on a GPU",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="no CUDA graphs or torch.compile (faster start; the only mode on CPU)",
    )
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServeSettings:
    """``logra-pl serve`` flags → :class:`ServeSettings`."""
    ns = serve_parser().parse_args(argv)
    return ServeSettings(**{k: v for k, v in vars(ns).items()})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``logra-pl serve``."""
    settings = parse_args(argv)
    if settings.data_parallel_size > 1:
        return run_engines(settings)
    groups = settings.device_groups()
    if groups[0] is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = groups[0]
    # SIGTERM (kill, scancel, docker stop, Kubernetes) stops the server as Ctrl-C does. uvicorn catches both while it
    # serves and, once shut down, raises the signal again under the handler it found: with Python's default for
    # SIGTERM the process would die right there, before vLLM's engine client shuts its engine processes down
    # (orphaned EngineCore and workers, holding their memory). This handler turns it into the KeyboardInterrupt that
    # unwinds through the client's shutdown.
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_engine(settings))
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as KeyboardInterrupt: the engine is shut down on the way out."""
    raise KeyboardInterrupt(f"signal {signum}")
