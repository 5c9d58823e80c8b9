"""A real SGLang server in a child process: ports, JSON over HTTP, start-up, shutdown.

Used by the tests and the serving benchmarks; nothing here imports SGLang.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 360.0
SERVER_ARGS_ENV = "SGLANG_TREE_SPEC_SERVER_ARGS"


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time (the message ends with its log)."""


FIXED_PORTS = range(20000, 32000)
"""Where servers listen: below Linux's default ephemeral range (32768-60999), so no socket that
asks the OS for any port (gloo pairs, TCP stores, outgoing connections) can take the port between
``free_port`` returning it and the server binding it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, that is free right now."""
    for _ in range(100):
        port = random.choice(FIXED_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {FIXED_PORTS}")


def http_json(url: str, payload: dict | None = None, timeout: float = 60.0) -> object:
    """GET (payload None) or POST JSON; the decoded JSON reply."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


def ddtree_metrics(base_url: str) -> dict[str, float]:
    """The server's ``sglang:ddtree_*`` metrics (``--enable-metrics``), complete up to now: a
    one-token request first, whose prefill makes the worker publish every decode step so far."""
    from sglang_tree_spec.plugin.metrics import read_ddtree_metrics

    http_json(
        f"{base_url}/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
        timeout=600,
    )
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=60) as reply:
        return read_ddtree_metrics(reply.read().decode())


def wait_until_healthy(base_url: str, process: subprocess.Popen, log: Path) -> None:
    """Poll ``/health`` until the server answers; raise with the log if it dies or times out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"server exited with {process.returncode}:\n{_tail(log)}")
        if "address already in use" in log.read_text(errors="replace").lower():
            raise ServerStartError(f"server could not bind its port:\n{_tail(log)}")
        try:
            urllib.request.urlopen(f"{base_url}/health", timeout=2).read()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise ServerStartError(f"server not healthy after {START_TIMEOUT_S:.0f}s:\n{_tail(log)}")


def launch(
    command: list[str], log: Path, plugins: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start ``command`` in its own process group, output to ``log``.

    ``plugins`` is SGLang's ``SGLANG_PLUGINS`` whitelist of ``sglang.srt.plugins`` entry points;
    ``env``: more environment variables for the server.
    ``SGLANG_USE_CPU_ENGINE`` is removed so that only the plugin can make CPU serving work.
    ``SGLANG_TREE_SPEC_SERVER_ARGS`` (shell words) is appended to every server's command, e.g.
    ``--disable-prefill-cuda-graph`` for a short GPU run; the log's first line shows the command.
    """
    env = {**os.environ, **(env or {}), "SGLANG_PLUGINS": plugins, "PYTHONUNBUFFERED": "1"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    command = [*command, *shlex.split(os.environ.get(SERVER_ARGS_ENV, ""))]
    with log.open("w") as sink:
        sink.write(f"$ {shlex.join(command)}\n")
        sink.flush()
        return subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) raise ``SystemExit`` in the main thread, so that the
    ``finally`` blocks that :func:`stop` the servers run: each server is its own process group
    and would otherwise outlive the benchmark that started it, keeping a core busy."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def stop(*processes: subprocess.Popen) -> None:
    """Terminate each server's process group (launcher, scheduler, detokenizer). A SIGINT or
    SIGTERM arriving meanwhile (in the main thread) takes effect once every group is stopped:
    a second Ctrl-C or ``kill`` during a benchmark's clean-up would otherwise leave the servers
    not yet stopped running."""
    with _signals_held():
        for process in processes:
            _stop_group(process)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block; deliver them, in order, after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives signals and may set handlers
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {
        sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in signals
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in held:
            signal.raise_signal(signum)


def _stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    try:
        os.killpg(process.pid, signal.SIGKILL)  # leftover children of the group, if any
    except ProcessLookupError:
        pass


def _tail(log: Path, chars: int = 6000) -> str:
    return log.read_text()[-chars:]
