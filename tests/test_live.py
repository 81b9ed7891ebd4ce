"""Watching a fleet live: the coordinator's and the key server's Prometheus endpoints scraped
during a real fleet run (real Mosquitto, real OS processes), and ``senseshield fleet top`` run in
a real terminal (a pseudo-terminal with a controlling tty: Ctrl-C is the terminal's) against
the running coordinator.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from typer.testing import CliRunner

from senseshield.cli import app
from senseshield.cli.top import Samples, scrape
from senseshield.errors import ConfigError
from senseshield.job import Job, with_shape
from senseshield.runtime.fleet import Fleet, FleetOptions
from senseshield.runtime.metrics import message_kind, refusal_kind
from senseshield.runtime.transport import parse_broker
from tests.broker import free_port

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]")


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``condition`` until it returns something true; the timeout only guards a hang."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    """The value of the sample ``metric`` whose labels include ``labels`` (None: absent)."""
    for got, v in samples.get(metric, []):
        if all(got.get(k) == w for k, w in labels.items()):
            return v
    return None


def labels_of(samples: Samples, name: str, label: str) -> set[str]:
    return {got[label] for got, _ in samples.get(name, [])}


def try_scrape(url: str, what: str = "coordinator") -> Samples | None:
    try:
        return scrape(url, what, timeout=2.0)
    except ConfigError:
        return None


class Terminal:
    """A command in a pseudo-terminal of ``cols`` x ``rows``, the session's controlling tty
    (``setsid --ctty``): it sees a real terminal, and Ctrl-C written to it is a SIGINT."""

    def __init__(self, argv: list[str], *, cols: int = 160, rows: int = 40) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ, TERM="xterm-256color", LANG="C.UTF-8", PYTHONPATH=str(ROOT))
        for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM"):
            env.pop(name, None)
        # a shell starts a foreground command with Ctrl-C's default action, even when this test
        # runs in the background (a non-interactive shell's background jobs ignore SIGINT, and
        # a program inherits that: Python would then never raise KeyboardInterrupt)
        self.proc = subprocess.Popen(["setsid", "--ctty", *argv], stdin=slave, stdout=slave, stderr=slave,
                                     env=env, close_fds=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(slave)
        self.raw = b""

    @property
    def text(self) -> str:
        """What the terminal received, escape sequences left out."""
        return ANSI.sub("", self.raw.decode("utf-8", errors="replace"))

    def read_until(self, condition: Callable[[str], bool], timeout: float, what: str) -> str:
        end = time.monotonic() + timeout
        while not condition(self.text):
            assert time.monotonic() < end, f"timed out waiting for {what}; the terminal shows:\n{self.text[-3000:]}"
            self._read(0.2)
        return self.text

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], wait)
        if not ready:
            return False
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the command exited and closed the terminal
            return False
        self.raw += chunk
        return bool(chunk)

    def finish(self, timeout: float = 30.0) -> int:
        """Wait for the command to exit (reading what it still prints); its exit code."""
        end = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < end, f"the command did not exit; the terminal shows:\n{self.text[-2000:]}"
            self._read(0.1)
        while self._read(0.05):
            pass
        os.close(self.master)
        return self.proc.returncode


def top_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "senseshield.cli", "fleet", "top", *args]


def lines_with(text: str, *parts: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]+", text) if all(p in line for p in parts)]


def publish_garbage(url: str, topic: str) -> None:
    """One message that is no frame at all, as a broken or hostile client sends it."""
    host, port = parse_broker(url)
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"garbage-{os.getpid()}")
    client.connect(host, port)
    client.loop_start()
    try:
        client.publish(topic, b"not a frame", qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def test_a_fleet_run_is_watched_live(mosquitto, tmp_path):
    """A long-running fleet of 3 agents (sensecrypt: budgets of their own) runs a 3-round job
    with the coordinator's and the key server's endpoints on. c002's training raises in round 2
    (a round failure) and the key server needs all 3 contributors, so round 2 is refused. Once
    round 1 is done c000 is paused (SIGSTOP; the job's deadline is long), so the job is still
    running while the endpoints are read and `senseshield fleet top` runs in a terminal; then
    it goes on and the endpoints are read again when the job is done."""
    co_port, ks_port = free_port(), free_port()
    co_url, ks_url = f"http://127.0.0.1:{co_port}/metrics", f"http://127.0.0.1:{ks_port}/metrics"
    job = with_shape(Job(strategy="sensecrypt", model="linear", partition="iid", clients=3, rounds=3, min_devices=3,
                         key_bits=1024, bandwidth=[50, 30], cpu=[24, 8], round_deadline=600, name="watched"))
    options = FleetOptions(agents=3, out=tmp_path / "run", broker=mosquitto.url, fleet="live", serve=True,
                           min_contributors=3, extra_coordinator_args=["--metrics-port", str(co_port)],
                           extra_keyserver_args=["--metrics-port", str(ks_port)],
                           extra_agent_args={"c002": ["--fail-at-round", "2"]})
    with Fleet(job, options) as fleet:
        fleet.start()
        # every device said hello (the agents are up before the job)
        wait_for(lambda: (s := try_scrape(co_url)) and value(s, "senseshield_devices_online") == 3, 120,
                 "3 devices online")
        wait_for(lambda: try_scrape(ks_url, "key server"), 60, "the key server's endpoint")
        with fleet.job_client() as client:
            job_id = client.submit(job)
            # round 1 closed and round 2 opened (the coordinator opens the next round just after it closes one)
            wait_for(lambda: (s := try_scrape(co_url)) and (value(s, "senseshield_round") or 0) >= 1
                     and (value(s, "senseshield_round_current") or 0) >= 2, 120, "round 2 open")
            paused = fleet.processes["c000"]
            os.kill(paused.pid, signal.SIGSTOP)  # its round waits for it: the job stays running
            try:
                during = scrape(co_url)
                term = Terminal(top_argv("--url", f"127.0.0.1:{co_port}", "--keyserver-url", ks_url, "--interval", "0.5"))
                shown = term.read_until(lambda t: all(lines_with(t, a, "yes") for a in ("c000", "c001", "c002"))
                                        and "running" in t and "fleet top" in t, 30, "the devices' table")
                term.read_until(lambda t: t.count("fleet top") >= 2, 30, "a second frame")  # it redraws
                os.write(term.master, b"\x03")  # Ctrl-C, as typed
                code = term.finish()
            finally:
                os.kill(paused.pid, signal.SIGCONT)
            publish_garbage(mosquitto.url, "ss/v1/live/agents/c000/update")
            publish_garbage(mosquitto.url, "ss/v1/live/keyserver/requests")
            record = client.follow(job_id, lambda line: None, timeout=240)
        assert record["state"] == "done", record["events"][-5:]
        after = wait_for(lambda: (s := scrape(co_url)) and value(s, "senseshield_rejected_messages_total") and s, 30,
                         "the rejected message counted")
        keyserver = wait_for(lambda: (s := scrape(ks_url, "key server"))
                             and value(s, "senseshield_keyserver_rejected_messages_total") and s, 30,
                             "the key server's rejected message counted")

    # -- while the job ran (c000 paused after round 1)
    assert value(during, "senseshield_job_info", job=job_id, name="watched", strategy="sensecrypt", state="running") == 1
    assert value(during, "senseshield_round_current") in (2, 3) and value(during, "senseshield_job_rounds") == 3
    assert value(during, "senseshield_devices_online") == 3 and value(during, "senseshield_agents_joined") == 3
    budgets = {a: value(during, "senseshield_agent_budget", agent=a) for a in ("c000", "c001", "c002")}
    assert all(b is not None and 0 < b <= 1 for b in budgets.values()), budgets
    assert len(set(budgets.values())) > 1, budgets  # the devices' profiles differ, and so do their budgets
    assert {value(during, "senseshield_agent_cluster", agent=a) for a in budgets} == {0}
    # -- fleet top, in the terminal: the job, its round, every device online with its budget
    assert code == 0, term.text[-2000:]
    assert "Traceback" not in term.text
    assert f"job {job_id} (watched, sensecrypt) running" in shown
    assert re.search(r"round [23]/3", shown) and "devices online 3/3" in shown
    for agent, budget in budgets.items():
        assert lines_with(shown, agent, "yes", f"{budget:.3f}"), (agent, budget, shown[-3000:])
    assert "key server: round " in shown and "(not the coordinator's)" not in shown
    # -- at the end of the job
    coordinator_series = {name for name in after if name.startswith("senseshield_")} | set(during)
    assert value(after, "senseshield_job_info", job=job_id, state="done") == 1
    assert value(after, "senseshield_jobs", state="done") == 1
    assert value(after, "senseshield_round") == 3 and value(after, "senseshield_round_seconds") > 0
    for agent in ("c000", "c001", "c002"):
        assert value(after, "senseshield_agent_online", agent=agent) == 1
        assert value(after, "senseshield_agent_last_round", agent=agent) == 3
        assert value(after, "senseshield_agent_round_seconds", agent=agent) > 0
        assert value(after, "senseshield_agent_bytes_up_total", agent=agent) > 0
        assert value(after, "senseshield_agent_bytes_down_total", agent=agent) > 0
        for phase in ("train", "encrypt", "upload"):
            assert value(after, "senseshield_agent_phase_seconds", agent=agent, phase=phase) is not None, (agent, phase)
    assert value(after, "senseshield_agent_failures_total", agent="c002", phase="round") == 1
    assert labels_of(after, "senseshield_agent_failures_total", "agent") == {"c002"}
    assert value(after, "senseshield_agent_straggling_total", agent="c002", missing="failed") == 1
    assert value(after, "senseshield_aggregates_total", result="accepted") == 2
    assert value(after, "senseshield_aggregates_total", result="refused") == 1
    assert value(after, "senseshield_refusals_total", kind="min_contributors") == 1
    assert value(after, "senseshield_rejected_messages_total", kind="update") >= 1  # the garbage (c000 sends none)
    assert value(after, "senseshield_server_phase_seconds", cluster="0", phase="decrypt") > 0
    assert value(after, "senseshield_straggling_ratio") >= 1
    # -- the key server
    assert value(keyserver, "senseshield_keyserver_job_info", job=job_id, strategy="sensecrypt",
                 scheme="packed-paillier") == 1
    assert value(keyserver, "senseshield_keyserver_round") == 3
    assert value(keyserver, "senseshield_keyserver_aggregates_total", result="accepted") == 2
    assert value(keyserver, "senseshield_keyserver_aggregates_total", result="refused") == 1
    assert value(keyserver, "senseshield_keyserver_refusals_total", kind="min_contributors") == 1
    assert value(keyserver, "senseshield_keyserver_decrypt_seconds_count") == 2
    assert value(keyserver, "senseshield_keyserver_decrypt_seconds_sum") > 0
    assert value(keyserver, "senseshield_keyserver_verify_seconds_count") == 3
    assert value(keyserver, "senseshield_keyserver_ledger_entries") >= 1 + 2 * 3  # the job, 2 released sums of 3
    assert value(keyserver, "senseshield_keyserver_rejected_messages_total", kind="requests") == 1
    keyserver_series = {name for name in keyserver if name.startswith("senseshield_keyserver_")}
    series = sorted(n for n in coordinator_series | keyserver_series if not n.endswith(("_created", "_bucket")))
    (tmp_path / "series.txt").write_text("\n".join(series) + "\n")  # what a scrape during the run had
    (tmp_path / "top.txt").write_text(shown)
    print(f"\ncoordinator series: {len(coordinator_series)}, key server series: {len(keyserver_series)}")


def test_fleet_top_once_in_a_terminal():
    """`fleet top --once` against an endpoint fed through the coordinator's hooks: one frame in a
    real terminal, with the header and every device's row."""
    from types import SimpleNamespace

    from coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics(0)
    try:
        job = SimpleNamespace(id="j-top", name="digits", job={"strategy": "sensecrypt"}, state="running",
                              started_at=1.0, rounds=5)
        metrics.jobs([job], job)
        for agent, online in (("dev0", True), ("dev1", True), ("dev2", False)):
            metrics.device(agent, online)
        metrics.round_started(2, {"dev0": 0, "dev1": 1, "dev2": 1}, {"dev0": 0.25, "dev1": 0.625, "dev2": 1.0})
        record = {"seconds": 4.0, "clusters": {0: {"timings": {}, "accepted": True, "refused": {}}}}
        metrics.round_done(1, record, agents={"dev0": {"plan_sent": 1.0, "update_received": 2.75, "bytes_up": 2_500_000,
                                                       "agent_timings": {"train": 0.5, "encrypt": 1.25}}},
                           straggling=[{"round": 1, "agent": "dev2", "missing": "offline"}], online=2, joined=3)
        metrics.failure("dev1", 2)
        term = Terminal(top_argv("--url", f"http://127.0.0.1:{metrics.port}/metrics", "--once"), cols=100)
        code = term.finish()
    finally:
        metrics.close()
    text = term.text
    assert code == 0 and "Traceback" not in text, text
    assert "job j-top (digits, sensecrypt) running · round 2/5 (round 1 took 4.0 s)" in text
    assert "devices online 2/3" in text
    assert lines_with(text, "dev0", "yes", "0.250", "1.75", "0.50", "1.25", "2.50")
    assert [line for line in lines_with(text, "dev1", "yes", "0.625") if re.search(r" 1\s*$", line)]  # 1 failure
    assert lines_with(text, "dev2", "no", "1.000")
    assert "\x1b[" in term.raw.decode(errors="replace")  # a terminal: rich draws it with colours


def test_fleet_top_mistakes_are_one_sentence():
    port = free_port()  # nothing listens there
    for args, sentence in [
        (["--url", f"127.0.0.1:{port}", "--once"],
         f"Cannot read the coordinator's metrics at http://127.0.0.1:{port}/metrics"),
        (["--url", "ftp://somewhere/metrics", "--once"], "is not allowed; give http://HOST:PORT/metrics"),
        (["--url", "127.0.0.1:1", "--interval", "0"], "--interval 0 is not allowed"),
    ]:
        result = CliRunner().invoke(app, ["fleet", "top", *args])
        assert result.exit_code == 2, result.output
        assert sentence in " ".join(result.output.split()) and "Traceback" not in result.output, result.output


def test_kinds_of_refusals_and_rejected_messages():
    from keyserver.verify import FINGERPRINT_MISMATCH

    assert refusal_kind("refused: 2 distinct contributor(s) ['c000', 'c001'], fewer than the minimum 3 "
                        "(--min-contributors 3, --min-fraction 0 of 3); decrypting would reveal an individual update"
                        ) == "min_contributors"
    assert refusal_kind(f"refused: {FINGERPRINT_MISMATCH} under round 2's challenge") == "fingerprint"
    assert refusal_kind("Job j-1 is refused: it carries no job signed by an operator of fleet 'lab'") == "job"
    assert refusal_kind("no update arrived before the deadline") == "deadline"
    assert refusal_kind("refused: the contributions of ['c001'] in round 2 were already decrypted in cluster 0's "
                        "aggregate; each enters one aggregate per round") == "reused"
    assert refusal_kind("refused: 'd' signed for cluster 1, and is not a member of cluster 0") == "receipt"
    assert refusal_kind("refused: cluster 7 is not in round 1's plan (clusters [0, 1])") == "plan"
    assert refusal_kind("refused: the aggregate weighs 30 samples; the receipts sign 10") == "weights"
    assert refusal_kind("something new") == "other"
    assert message_kind("ss/v1/lab/agents/c000/update") == "update"
    assert message_kind("keyserver/requests") == "requests"
    assert message_kind("closing round 3") == "closing round"


@pytest.mark.parametrize("variable, value, sentence", [
    ("SENSESHIELD_METRICS_PORT", "ninety", "SENSESHIELD_METRICS_PORT='ninety' is not allowed"),
    ("SENSESHIELD_KEYSERVER_METRICS_PORT", "70000", "SENSESHIELD_KEYSERVER_METRICS_PORT='70000' is not allowed"),
])
def test_a_bad_metrics_port_variable_is_one_sentence(monkeypatch, variable, value, sentence):
    from senseshield.runtime.metrics import metrics_port

    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=re.escape(sentence)):
        metrics_port(None, variable)
    assert metrics_port(9464, variable) == 9464  # the flag wins
