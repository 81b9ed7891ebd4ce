"""``senseshield fleet top``: a live view of a fleet in the terminal, read from the coordinator's
Prometheus endpoint (``coordinator serve --metrics-port``) and, if given, the key server's.

Every ``--interval`` seconds it scrapes ``--url`` (``prometheus_client.parser``) and redraws
one frame (``rich.live.Live``): a header with the job, its round x/N and the devices online,
then a table of the devices -- online, cluster, encryption budget, last round delivered, that
round's seconds and main phases, bytes sent, straggling, late messages and failures. ``--once``
prints one frame and exits (scripts, tests). An endpoint that cannot be read is one sentence
(exit 2) at the start; later, the frame keeps the last figures and says since when it cannot
read them.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer

from senseshield.errors import ConfigError

Samples = dict[str, list[tuple[dict[str, str], float]]]


def metrics_url(url: str) -> str:
    """``url`` as a metrics URL: ``host:port`` gets ``http://``, a bare address ``/metrics``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    if scheme not in ("http", "https"):
        raise ConfigError(f"--url {url!r} is not allowed; give http://HOST:PORT/metrics.")
    if "/" not in rest:
        url += "/metrics"
    return url


def scrape(url: str, what: str = "coordinator", timeout: float = 5.0) -> Samples:
    """The samples at ``url`` (sample name -> [(labels, value)]); ConfigError in one sentence
    when it cannot be read or is not Prometheus text of a SenseShield service."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310 - the operator's URL
            text = answer.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise ConfigError(f"The {what}'s metrics at {url} answered HTTP {exc.code} ({exc.reason}); "
                          "give the endpoint's /metrics path.") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        reason = getattr(reason, "strerror", None) or str(reason)
        flag = "coordinator serve --metrics-port" if what == "coordinator" else "keyserver serve --metrics-port"
        raise ConfigError(f"Cannot read the {what}'s metrics at {url} ({reason}); is `{flag}` running there?") from None
    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise ConfigError(f"{url} does not serve Prometheus metrics ({exc}).") from None
    prefix = "senseshield_keyserver_" if what == "key server" else "senseshield_"
    if not any(name.startswith(prefix) for name in samples):
        raise ConfigError(f"{url} serves no SenseShield {what} metrics; give the {what}'s --metrics-port.")
    return samples


def _value(samples: Samples, name: str, default: float | None = None) -> float | None:
    found = samples.get(name)
    return found[0][1] if found else default


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``label`` value -> sample value of ``name`` (summed over its other labels)."""
    out: dict[str, float] = {}
    for labels, value in samples.get(name, []):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


@dataclass
class Device:
    id: str
    online: bool | None = None
    cluster: int | None = None
    budget: float | None = None
    last_round: int | None = None
    round_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    bytes_up: float = 0.0
    straggling: float = 0.0
    late: float = 0.0
    failures: float = 0.0
    refused: float = 0.0


@dataclass
class FleetView:
    """What one scrape of the coordinator says."""

    job: str = ""
    name: str = ""
    strategy: str = ""
    state: str = ""
    round: int = 0  # under way
    rounds: int = 0
    done: int = 0  # last completed
    round_s: float | None = None
    online: int = 0
    seen: int = 0
    joined: int = 0
    rejected: float = 0.0
    ratio: float | None = None
    slowest: str = ""
    refusals: dict[str, float] = field(default_factory=dict)
    devices: list[Device] = field(default_factory=list)
    stalled_s: float = 0.0  # the running job has not progressed for this long (0: it progresses)
    waiting_for: str = ""  # the coordinator's sentence of what it waits for, while stalled


def fleet_view(samples: Samples) -> FleetView:
    """The coordinator's samples as a :class:`FleetView`."""
    view = FleetView()
    info = [labels for labels, value in samples.get("senseshield_job_info", []) if value]
    if info:
        view.job, view.name = info[0].get("job", ""), info[0].get("name", "")
        view.strategy, view.state = info[0].get("strategy", ""), info[0].get("state", "")
    ints = lambda name: int(_value(samples, name, 0) or 0)  # noqa: E731
    view.round, view.rounds, view.done = ints("senseshield_round_current"), ints("senseshield_job_rounds"), ints("senseshield_round")
    view.round_s = _value(samples, "senseshield_round_seconds")
    view.online, view.seen = ints("senseshield_devices_online"), ints("senseshield_devices_seen")
    view.joined = ints("senseshield_agents_joined")
    view.rejected = sum(_by(samples, "senseshield_rejected_messages_total", "kind").values())
    ratio = _value(samples, "senseshield_straggling_ratio")
    view.ratio = ratio if ratio else None  # 0: no complete round yet (a ratio is at least 1)
    slowest = samples.get("senseshield_slowest_agent_seconds", [])
    view.slowest = slowest[0][0].get("agent", "") if slowest else ""
    view.refusals = {k: v for k, v in _by(samples, "senseshield_refusals_total", "kind").items() if v}
    view.stalled_s = _value(samples, "senseshield_job_stalled_seconds", 0.0) or 0.0
    waiting = [labels.get("waiting_for", "") for labels, value in samples.get("senseshield_job_waiting_info", []) if value]
    view.waiting_for = waiting[0] if waiting else ""
    devices: dict[str, Device] = {}
    dev = lambda a: devices.setdefault(a, Device(a))  # noqa: E731
    for labels, value in samples.get("senseshield_agent_online", []):
        dev(labels["agent"]).online = bool(value)
    for name, attr, kind in (("senseshield_agent_cluster", "cluster", int), ("senseshield_agent_budget", "budget", float),
                             ("senseshield_agent_last_round", "last_round", int),
                             ("senseshield_agent_round_seconds", "round_s", float)):
        for labels, value in samples.get(name, []):
            setattr(dev(labels["agent"]), attr, kind(value))
    for name, attr in (("senseshield_agent_bytes_up_total", "bytes_up"), ("senseshield_agent_straggling_total", "straggling"),
                       ("senseshield_agent_late_total", "late"), ("senseshield_agent_failures_total", "failures"),
                       ("senseshield_agent_refused_updates_total", "refused")):
        for agent, value in _by(samples, name, "agent").items():
            setattr(dev(agent), attr, value)
    for labels, value in samples.get("senseshield_agent_phase_seconds", []):
        dev(labels["agent"]).phases[labels["phase"]] = value
    view.devices = [devices[a] for a in sorted(devices)]
    return view


@dataclass
class KeyServerView:
    job: str = ""
    round: int = 0
    accepted: float = 0.0
    refused: float = 0.0
    refusals: dict[str, float] = field(default_factory=dict)
    decrypt_mean: float | None = None
    ledger: int = 0
    rejected: float = 0.0


def keyserver_view(samples: Samples) -> KeyServerView:
    view = KeyServerView()
    info = [labels for labels, value in samples.get("senseshield_keyserver_job_info", []) if value]
    view.job = info[0].get("job", "") if info else ""
    view.round = int(_value(samples, "senseshield_keyserver_round", 0) or 0)
    results = _by(samples, "senseshield_keyserver_aggregates_total", "result")
    view.accepted, view.refused = results.get("accepted", 0.0), results.get("refused", 0.0)
    view.refusals = {k: v for k, v in _by(samples, "senseshield_keyserver_refusals_total", "kind").items() if v}
    count = _value(samples, "senseshield_keyserver_decrypt_seconds_count", 0) or 0
    if count:
        view.decrypt_mean = (_value(samples, "senseshield_keyserver_decrypt_seconds_sum", 0) or 0) / count
    view.ledger = int(_value(samples, "senseshield_keyserver_ledger_entries", 0) or 0)
    view.rejected = sum(_by(samples, "senseshield_keyserver_rejected_messages_total", "kind").values())
    return view


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render(view: FleetView, url: str, *, keyserver: KeyServerView | None = None, error: str = "",
           stamp: float | None = None):  # noqa: ANN201 - a rich renderable
    """One frame: the header lines and the devices' table."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    when = time.strftime("%H:%M:%S", time.localtime(stamp if stamp is not None else time.time()))
    head = Text()
    head.append("fleet top ", style="bold")
    head.append(f"{url}  {when}\n", style="dim")
    if view.job:
        state_style = {"running": "green", "waiting": "yellow", "done": "cyan", "failed": "red",
                       "cancelled": "red"}.get(view.state, "")
        head.append(f"job {view.job} ", style="bold")
        named = view.name if view.strategy in view.name else ", ".join(n for n in (view.name, view.strategy) if n)
        head.append(f"({named}) ")
        head.append(view.state, style=state_style)
        head.append(f" · round {view.round}/{view.rounds}")
        if view.done:
            head.append(f" (round {view.done} took {_num(view.round_s, 1)} s)")
    else:
        head.append("no job yet", style="yellow")
    head.append(f"\ndevices online {view.online}/{view.seen}")
    if view.joined:
        head.append(f" · {view.joined} in the job")
    if view.ratio is not None:
        head.append(f" · slowest/fastest {view.ratio:.2f}" + (f" ({view.slowest})" if view.slowest else ""))
    head.append(f" · messages rejected {view.rejected:.0f}")
    if view.stalled_s > 0:
        head.append(f"\nno progress for {view.stalled_s:.0f} s: {view.waiting_for or 'see the coordinator log'}",
                    style="bold yellow")
    if view.refusals:
        head.append("\nrounds refused: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(view.refusals.items())),
                    style="red")
    if keyserver is not None:
        head.append("\nkey server: ")
        if keyserver.job != view.job:
            head.append(f"job {keyserver.job or '–'} (not the coordinator's), ", style="yellow")
        head.append(f"round {keyserver.round} · aggregates {keyserver.accepted:.0f} decrypted, "
                    f"{keyserver.refused:.0f} refused")
        if keyserver.refusals:
            head.append(" (" + ", ".join(f"{k} {v:.0f}" for k, v in sorted(keyserver.refusals.items())) + ")")
        if keyserver.decrypt_mean is not None:
            head.append(f" · decrypt mean {keyserver.decrypt_mean:.2f} s")
        head.append(f" · ledger {keyserver.ledger}")
        if keyserver.rejected:
            head.append(f" · messages rejected {keyserver.rejected:.0f}")
    if error:
        head.append(f"\n{error}", style="bold red")
    # no vertical rules (a space between columns), two-line headers: a frame fits 100 columns
    table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False, expand=False)
    for name, justify in (("device", "left"), ("online", "left"), ("cluster", "right"), ("budget", "right"),
                          ("last\nround", "right"), ("round\ns", "right"), ("train\ns", "right"),
                          ("encrypt\ns", "right"), ("up\nMB", "right"), ("straggling", "right"), ("late", "right"),
                          ("failures", "right"), ("note", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for d in view.devices:
        online = {True: Text("yes", style="green"), False: Text("no", style="red"), None: Text("–")}[d.online]
        notes = []
        if d.id == view.slowest:
            notes.append("slowest")
        if d.refused:
            notes.append(f"{d.refused:.0f} update(s) refused")
        table.add_row(
            d.id, online, "–" if d.cluster is None else str(d.cluster), _num(d.budget, 3),
            "–" if d.last_round is None else str(d.last_round), _num(d.round_s),
            _num(d.phases.get("train")), _num(d.phases.get("encrypt")), f"{d.bytes_up / 1e6:.2f}",
            Text(f"{d.straggling:.0f}", style="yellow" if d.straggling else ""),
            Text(f"{d.late:.0f}", style="yellow" if d.late else ""),
            Text(f"{d.failures:.0f}", style="red" if d.failures else ""), ", ".join(notes))
    if not view.devices:
        return Group(head, Text("no device seen yet", style="dim"))
    return Group(head, table)


def top(
    url: Annotated[str, typer.Option(help="The coordinator's metrics endpoint: http://HOST:PORT/metrics (coordinator serve --metrics-port; HOST:PORT is enough).")],
    keyserver_url: Annotated[Optional[str], typer.Option(help="Also the key server's endpoint (keyserver serve --metrics-port).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between two reads.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (scripts).")] = False,
) -> None:
    """Watch a fleet live: its job, round, devices, budgets, last rounds and stragglers, read from
    the coordinator's Prometheus endpoint (Ctrl-C to leave)."""
    from senseshield.cli.common import fail, out

    if not interval > 0:
        fail(f"--interval {interval:g} is not allowed; give seconds > 0.")
    try:
        url = metrics_url(url)
        ks_url = metrics_url(keyserver_url) if keyserver_url else None
    except ConfigError as exc:
        fail(str(exc))

    def read() -> tuple[FleetView, KeyServerView | None]:
        view = fleet_view(scrape(url))
        return view, keyserver_view(scrape(ks_url, "key server")) if ks_url else None

    try:
        view, ks = read()
    except ConfigError as exc:
        fail(str(exc))
    if once:
        out.print(render(view, url, keyserver=ks))
        return
    from rich.live import Live

    failing_since: float | None = None
    try:
        with Live(render(view, url, keyserver=ks), console=out, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                error = ""
                try:
                    view, ks = read()
                    failing_since = None
                except ConfigError as exc:
                    failing_since = failing_since or time.time()
                    error = (f"{exc} Showing the figures of {time.strftime('%H:%M:%S', time.localtime(failing_since))}; "
                             "retrying.")
                live.update(render(view, url, keyserver=ks, error=error), refresh=True)
    except KeyboardInterrupt:
        return
