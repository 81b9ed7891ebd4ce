"""SIGTERM stops every service within 2 s in any state: the key server, the coordinator and
an edge agent, each a real OS process (its CLI) against a real Mosquitto, signalled once it
is connected and idle, once the broker it was connected to has stopped, and while it is still
trying to reach a broker that is not there. The time is measured from the signal to the
process's exit; each state is reached by waiting for the service's own log line, never by
sleeping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.broker import free_port

ROOT = Path(__file__).resolve().parents[1]
STOP_BOUND_S = 2.0


class Proc:
    """A service process whose log (stderr) is read line by line as it comes."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, needle: str, timeout: float = 120.0) -> None:
        """Until a log line contains ``needle`` (the process's own event); fails with the log."""
        end = time.monotonic() + timeout
        with self.changed:
            while not any(needle in line for line in self.lines):
                left = end - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self.reader.is_alive()):
                    pytest.fail(f"no log line with {needle!r}; log:\n" + "\n".join(self.lines[-30:]))
                self.changed.wait(min(left, 0.5))

    def terminate_and_time(self) -> float:
        """SIGTERM; the seconds until the process exited (the test fails after 30 s)."""
        t0 = time.monotonic()
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            pytest.fail("no exit within 30 s of SIGTERM; log:\n" + "\n".join(self.lines[-30:]))
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def service_argv(name: str, broker: str, tmp_path: Path) -> list[str]:
    """The command line of ``name`` (keyserver, coordinator, agent) on fleet ``stop``."""
    common = ["--broker", broker, "--fleet", "stop", "--insecure-dev", "--log-level", "info"]
    if name == "keyserver":
        return [sys.executable, "-m", "keyserver.cli", "serve", *common, "--key-dir", str(tmp_path / "keys")]
    if name == "coordinator":
        return [sys.executable, "-m", "coordinator.cli", "serve", *common, "--state-dir", str(tmp_path / "state"),
                "--out", str(tmp_path / "out")]
    # a declared profile: no bandwidth probe of the broker before the service starts
    return [sys.executable, "-m", "edge_agent.cli", "join", *common, "--agent-id", "a0", "--shard", "0/2",
            "--model-dir", str(tmp_path / "agent"), "--threads", "1", "--profile", "x86"]


CONNECTED = {"keyserver": "keyserver: connected to", "coordinator": "coordinator: connected to",
             "agent": "a0: connected to"}


@pytest.mark.parametrize("name", ["keyserver", "coordinator", "agent"])
def test_sigterm_stops_a_connected_idle_service_within_2_s(mosquitto, tmp_path, name):
    proc = Proc(service_argv(name, mosquitto.url, tmp_path), tmp_path)
    try:
        proc.wait_for(CONNECTED[name])
        seconds = proc.terminate_and_time()
    finally:
        proc.kill()
    print(f"{name}, connected and idle: exit {seconds:.2f} s after SIGTERM")
    assert seconds < STOP_BOUND_S, "\n".join(proc.lines[-20:])
    assert proc.popen.returncode == 0, "\n".join(proc.lines[-20:])


@pytest.mark.parametrize("name", ["keyserver", "coordinator", "agent"])
def test_sigterm_stops_a_service_whose_broker_stopped_within_2_s(mosquitto, tmp_path, name):
    proc = Proc(service_argv(name, mosquitto.url, tmp_path), tmp_path)
    try:
        proc.wait_for(CONNECTED[name])
        mosquitto.stop()
        proc.wait_for("connection lost")  # paho reconnects in the background from now on
        seconds = proc.terminate_and_time()
    finally:
        proc.kill()
    print(f"{name}, broker stopped: exit {seconds:.2f} s after SIGTERM")
    assert seconds < STOP_BOUND_S, "\n".join(proc.lines[-20:])


@pytest.mark.parametrize("name", ["keyserver", "coordinator", "agent"])
def test_sigterm_stops_a_service_still_connecting_within_2_s(tmp_path, name):
    """No broker on the port: the service keeps trying (30 s before it gives up)."""
    proc = Proc(service_argv(name, f"mqtt://127.0.0.1:{free_port()}", tmp_path), tmp_path)
    try:
        proc.wait_for("starting (pid")
        proc.wait_for("connecting to")  # the link's first attempt, after the runtime loaded
        seconds = proc.terminate_and_time()
    finally:
        proc.kill()
    print(f"{name}, connecting: exit {seconds:.2f} s after SIGTERM")
    assert seconds < STOP_BOUND_S, "\n".join(proc.lines[-20:])
