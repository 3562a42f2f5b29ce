"""``Server``: a real ``logra-pl serve`` subprocess (its own process group, so a kill takes its engine along)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from logra_pl.rollout.serve.server import READY_LINE


def free_port(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports that nothing holds right now, below the ephemeral range.

    ``logra-pl serve --data-parallel-size D`` binds ``P … P+D-1`` only once each engine is built, and meanwhile the
    engines' own processes take OS-assigned (ephemeral, 32768+ on Linux) ports for their internal sockets. A port
    the OS handed out by ``bind(0)`` can therefore be taken again before the server binds it; ports drawn from
    20000–32000 cannot.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found in 20000-32000")


class Server:
    """``python -m logra_pl.cli serve --model tiny --port PORT *flags``, logged to ``log_dir/serve-N.log``.

    Arguments:
        log_dir: where each start writes its log.
        flags: more ``logra-pl serve`` flags.
    """

    def __init__(self, log_dir: Path, *flags: str, port: int | None = None, engines: int = 1) -> None:
        self.port = port or free_port(engines)
        self.engines = engines  # ready lines to wait for (``--data-parallel-size``)
        self.flags = list(flags)
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> Server:
        """Start the server and wait for its ready line (or fail with its log)."""
        self.starts += 1
        self.log = self.log_dir / f"serve-{self.starts}.log"
        cmd = [sys.executable, "-m", "logra_pl.cli", "serve", "--model", "tiny", "--port", str(self.port), *self.flags]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if text.count(READY_LINE) >= self.engines:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"logra-pl serve exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"logra-pl serve not ready after {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server and its engine processes (the whole process group); wait until the port is free."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=60)
        self.proc = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.2)
