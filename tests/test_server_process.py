"""The test servers' helpers: a port no ephemeral socket can take, and a fast failure on bind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_tree_spec.server_process import (
    FIXED_PORTS,
    SERVER_ARGS_ENV,
    ServerStartError,
    free_port,
    launch,
    stop,
    wait_until_healthy,
)


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port in FIXED_PORTS and port < ephemeral_low for port in ports)
    assert len(ports) > 1  # drawn, not a constant that two servers would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_launch_appends_the_extra_server_args(tmp_path: Path, monkeypatch) -> None:
    """``SGLANG_TREE_SPEC_SERVER_ARGS`` reaches the server's argv, after the command's own."""
    log = tmp_path / "server.log"
    monkeypatch.setenv(SERVER_ARGS_ENV, "--disable-prefill-cuda-graph --x 'a b'")
    script = "import sys; print(sys.argv[1:], flush=True)"
    process = launch([sys.executable, "-c", script, "--port", "1"], log, plugins="")
    assert process.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[0].startswith("$ ") and lines[0].endswith("--x 'a b'")
    assert lines[1] == str(["--port", "1", "--disable-prefill-cuda-graph", "--x", "a b"])


def test_a_server_that_cannot_bind_fails_at_once(tmp_path: Path) -> None:
    """uvicorn logs the bind error and the process lingers: waiting must not sit out the timeout."""
    log = tmp_path / "server.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = (
            "import socket, sys, time\n"
            "s = socket.socket()\n"
            f"try: s.bind(('127.0.0.1', {port}))\n"
            "except OSError as e: print('ERROR:', e, flush=True)\n"
            "time.sleep(60)\n"
        )
        with log.open("w") as sink:
            process = subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            started = time.monotonic()
            with pytest.raises(ServerStartError, match="could not bind"):
                wait_until_healthy(f"http://127.0.0.1:{port + 1}", process, log)
            assert time.monotonic() - started < 30
        finally:
            stop(process)


def test_a_benchmark_killed_with_sigterm_stops_its_servers(tmp_path: Path) -> None:
    """``kill`` / ``timeout`` on a benchmark: with :func:`exit_on_sigterm` its ``finally``
    stops the server's process group (a ``sleep`` here), which would otherwise outlive it."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from sglang_tree_spec.server_process import exit_on_sigterm, launch, stop\n"
        "if sys.argv[1] == 'handled':\n"
        "    exit_on_sigterm()\n"
        "server = launch(['sleep', '300'], Path(sys.argv[2]), plugins='')\n"
        "try:\n"
        "    print(server.pid, flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    stop(server)\n"
    )

    def server_left_running(mode: str) -> bool:
        bench = subprocess.Popen(
            [sys.executable, "-c", script, mode, str(tmp_path / f"{mode}.log")],
            stdout=subprocess.PIPE,
            text=True,
        )
        server = int(bench.stdout.readline())
        bench.terminate()
        bench.wait(timeout=30)
        time.sleep(0.5)
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return False
        os.killpg(server, signal.SIGKILL)  # the unhandled case: clean up after the check
        return True

    assert not server_left_running("handled")
    assert server_left_running("default")  # what the handler is for


def test_a_second_signal_during_the_clean_up_still_stops_every_server(tmp_path: Path) -> None:
    """A second Ctrl-C or ``kill`` while a benchmark's ``finally`` stops its servers (each
    taking a while to exit) takes effect after :func:`stop` has stopped them all."""
    slow_exit = "trap 'sleep 2; exit 0' TERM; while :; do sleep 0.1; done"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from sglang_tree_spec.server_process import exit_on_sigterm, launch, stop\n"
        "exit_on_sigterm()\n"
        f"servers = [launch(['sh', '-c', {slow_exit!r}], Path(sys.argv[1]), plugins='')\n"
        "           for _ in range(2)]\n"
        "try:\n"
        "    print(*(s.pid for s in servers), flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        "    print('stopping', flush=True)\n"
        "    stop(*servers)\n"
    )
    bench = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(pid) for pid in bench.stdout.readline().split()]
    time.sleep(0.5)  # the shells have set their traps
    bench.terminate()
    assert bench.stdout.readline().strip() == "stopping"
    time.sleep(0.5)  # inside stop: the first server is taking its 2 s to exit
    bench.terminate()
    assert bench.wait(timeout=30) != 0
    left = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            left.append(pid)
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left
