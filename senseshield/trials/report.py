"""``senseshield report DIR``: report.json -> report.html with PNG plots; straggling figures.

:func:`straggling_summary` is pure (no plotting) and is what the coordinator writes under
``straggling`` in report.json. :func:`render_report` draws the plots with matplotlib's Agg
backend (imported lazily) and writes a self-contained HTML page next to them.
"""

from __future__ import annotations

import statistics
from typing import Any

STRAGGLING_DEFINITION = (
    "per round, over the agents that delivered: busy = update delivered (coordinator clock) "
    "- the moment the agent had both the round plan and the model it starts from (if it was "
    "still applying the previous model then, that counts as busy); ratio = slowest busy / fastest busy; idle_s = sum "
    "over agents of the time between their delivery and the last delivery of their cluster, "
    "plus, for negotiating strategies, the time they waited for the consensus mask beyond the "
    "quickest agent's wait; work_ratio = the ratio without that wait (what the devices' own "
    "work differs by)"
)


def straggling_summary(agents: list[dict[str, Any]]) -> dict[str, Any]:
    """Straggling figures from report.json's ``agents`` (their ``rounds[r].timestamps`` must
    hold ``start_at`` and ``update_received`` on one clock, as the coordinator writes them).

    Returns ``{"rounds": [{round, agents, slowest_s, fastest_s, ratio, idle_s,
    slowest_agent, fastest_agent, clusters: {k: {slowest_s, fastest_s, ratio, idle_s}}}],
    "median_ratio", "median_slowest_s", "median_idle_s", "definition"}``; a round without
    delivered updates is left out, and medians are None without rounds.
    """
    by_round: dict[int, list[tuple[str, int, float, float, float]]] = {}
    for agent in agents:
        for r, rec in (agent.get("rounds") or {}).items():
            ts = rec.get("timestamps") or {}
            start, end = ts.get("start_at"), ts.get("update_received")
            if not rec.get("delivered") or start is None or end is None:
                continue
            negotiate = float((rec.get("phases") or {}).get("negotiate", 0.0))
            by_round.setdefault(int(r), []).append(
                (agent["id"], int(rec.get("cluster", 0)), float(start), float(end), negotiate))
    rounds = []
    for r in sorted(by_round):
        rows = by_round[r]
        stats = _spread(rows)
        clusters = {str(k): _spread([x for x in rows if x[1] == k]) for k in sorted({x[1] for x in rows})}
        for c in clusters.values():
            c.pop("slowest_agent"), c.pop("fastest_agent")
        stats["idle_s"] = round(sum(c["idle_s"] for c in clusters.values()), 4)
        rounds.append({"round": r, "agents": len(rows), **stats, "clusters": clusters})
    ratios = [x["ratio"] for x in rounds if x["ratio"] is not None]
    work = [x["work_ratio"] for x in rounds if x["work_ratio"] is not None]

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    return {
        "rounds": rounds,
        "median_ratio": median(ratios),
        "median_work_ratio": median(work),
        "median_slowest_s": median([x["slowest_s"] for x in rounds]),
        "median_idle_s": median([x["idle_s"] for x in rounds]),
        "definition": STRAGGLING_DEFINITION,
    }


def _spread(rows: list[tuple[str, int, float, float, float]]) -> dict[str, Any]:
    busy = [(max(end - start, 0.0), agent) for agent, _, start, end, _ in rows]
    quickest_wait = min(neg for *_, neg in rows)
    work = [max(b - (neg - quickest_wait), 0.0) for (b, _), (*_, neg) in zip(busy, rows)]
    slow, fast = max(busy), min(busy)
    last = max(end for _, _, _, end, _ in rows)
    return {
        "slowest_s": round(slow[0], 4),
        "fastest_s": round(fast[0], 4),
        "ratio": round(slow[0] / fast[0], 4) if fast[0] > 0 else None,
        "work_ratio": round(max(work) / min(work), 4) if min(work) > 0 else None,
        "idle_s": round(sum(last - end for _, _, _, end, _ in rows) + sum(neg - quickest_wait for *_, neg in rows), 4),
        "slowest_agent": slow[1],
        "fastest_agent": fast[1],
    }


# ---- rendering ------------------------------------------------------------------------------

PHASE_COLORS = {
    "wait_model": "#d9d9d9",
    "train": "#4c72b0",
    "sensitivity": "#64b5cd",
    "negotiate": "#8172b2",
    "mask": "#ccb974",
    "noise": "#937860",
    "encrypt": "#c44e52",
    "serialize": "#da8bc3",
    "upload": "#55a868",
    "transfer": "#8de5a1",
    "wait": "#ebebeb",
    "apply": "#8c8c8c",
    "evaluate": "#b0b0b0",
    "aggregate": "#dd8452",
    "decrypt": "#7f3c8d",
}
COMPUTE = ("train", "sensitivity", "negotiate", "mask", "noise", "encrypt", "serialize", "upload")


def _load(path: Any) -> dict:
    import json
    from pathlib import Path

    from senseshield.errors import ConfigError

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{str(path)!r} does not exist.") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"{str(path)!r} is not valid JSON.") from None


def agent_segments(report: dict) -> list[tuple[str, int, str, float, float]]:
    """Gantt bars ``(row, round, phase, start, end)`` on the coordinator's clock: every agent's
    phases in order from the round plan to its metrics, and the server's aggregate/decrypt."""
    bars: list[tuple[str, int, str, float, float]] = []
    for agent in report.get("agents", []):
        for r, rec in (agent.get("rounds") or {}).items():
            ts, ph = rec.get("timestamps") or {}, rec.get("phases") or {}
            r = int(r)
            begin = ts.get("plan_received_at")
            if begin is None:
                continue
            t = begin
            if ph.get("wait_model"):
                bars.append((agent["id"], r, "wait_model", t, t + ph["wait_model"]))
                t += ph["wait_model"]
            for name in COMPUTE:
                if ph.get(name):
                    bars.append((agent["id"], r, name, t, t + ph[name]))
                    t += ph[name]
            delivered = ts.get("update_received")
            if delivered is not None and delivered > t:
                bars.append((agent["id"], r, "transfer", t, delivered))
                t = delivered
            model = ts.get("model_received_at")
            if model is not None and model > t:
                bars.append((agent["id"], r, "wait", t, model))
            applied = ts.get("apply_at")
            if applied is not None:
                end = applied + ph.get("apply", 0.0)
                bars.append((agent["id"], r, "apply", applied, end))
                if ph.get("evaluate"):
                    bars.append((agent["id"], r, "evaluate", end, end + ph["evaluate"]))
    for rec in report.get("server", []):
        for k, c in (rec.get("clusters") or {}).items():
            ts, tm = c.get("timestamps") or {}, c.get("timings") or {}
            if "closed_at" in ts and "aggregate" in tm:
                bars.append((f"coordinator (cluster {k})", rec["round"], "aggregate", ts["closed_at"],
                             ts["closed_at"] + tm["aggregate"]))
            if "requested_at" in ts and "result_at" in ts:
                bars.append((f"key server (cluster {k})", rec["round"], "decrypt", ts["requested_at"], ts["result_at"]))
    return bars


def _plot_timeline(report: dict, path: Any) -> bool:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = agent_segments(report)
    if not bars:
        return False
    t0 = min(b[3] for b in bars)
    rows = sorted({b[0] for b in bars}, key=lambda name: (name.startswith(("coordinator", "key server")), name))
    y = {name: i for i, name in enumerate(rows)}
    span = max(b[4] for b in bars) - t0
    fig, ax = plt.subplots(figsize=(min(max(10.0, span * 1.2), 40.0), 1.2 + 0.42 * len(rows)))
    for name, _, phase, start, end in bars:
        ax.barh(y[name], max(end - start, span / 4000), left=start - t0, height=0.7,
                color=PHASE_COLORS.get(phase, "#999999"), edgecolor="none")
    starts = {}
    for name, r, _, start, _ in bars:
        starts[r] = min(starts.get(r, start), start)
    for r, start in sorted(starts.items()):
        ax.axvline(start - t0, color="#444444", lw=0.6, ls=":")
        ax.text(start - t0, 1.01, f" round {r}", fontsize=8, va="bottom", transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the first round plan (coordinator clock)")
    used = [p for p in PHASE_COLORS if any(b[2] == p for b in bars)]
    ax.legend(handles=[Patch(facecolor=PHASE_COLORS[p], edgecolor="#999999", lw=0.4, label=p) for p in used],
              fontsize=7, loc="center left", bbox_to_anchor=(1.005, 0.5), frameon=False)
    ax.set_title(f"{report.get('strategy')}: every agent's phases per round", fontsize=10, pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_budgets(report: dict, path: Any) -> bool:
    import matplotlib.pyplot as plt
    import numpy as np

    clients = report.get("clients", [])
    if not clients:
        return False
    ids = [c["id"] for c in clients]
    x = np.arange(len(ids))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(ids) + 2), 3.4))
    ax.bar(x - 0.2, [c["encryption_budget"] for c in clients], 0.4, label="encryption budget α", color="#4c72b0")
    ax.bar(x + 0.2, [c["he_ratio"] for c in clients], 0.4, label="HE ratio (mean over rounds)", color="#c44e52")
    ax.set_xticks(x, ids, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of the model")
    mode = (report.get("budgets") or {}).get("mode", "paper")
    ax.set_title(f"budget ({mode}) and HE ratio per agent", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _metric_of(record: dict, name: str) -> float | None:
    """A round's or client's value of the run's metric (older reports: accuracy)."""
    value = record.get("metric")
    return record.get("accuracy") if value is None and name == "accuracy" else value


def _plot_rounds(report: dict, acc_path: Any, bytes_path: Any) -> bool:
    import matplotlib.pyplot as plt
    import numpy as np

    rounds = report.get("rounds", [])
    if not rounds:
        return False
    r = [x["round"] for x in rounds]
    name = report.get("metric_name") or "accuracy"
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.plot(r, [_metric_of(x, name) for x in rounds], marker="o", color="#4c72b0")
    ax.set_xlabel("round")
    ax.set_ylabel(name)
    if name.endswith("accuracy"):
        ax.set_ylim(0, 1.02)
    ax.set_xticks(r)
    ax.set_title(f"{name} per round (agents' own test splits)", fontsize=10)
    fig.tight_layout()
    fig.savefig(acc_path, dpi=110)
    plt.close(fig)
    x = np.arange(len(r))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar(x - 0.2, [v["bytes_up"] / 1e6 for v in rounds], 0.4, label="up (updates)", color="#55a868")
    ax.bar(x + 0.2, [v["bytes_down"] / 1e6 for v in rounds], 0.4, label="down (models)", color="#8172b2")
    ax.set_xticks(x, r)
    ax.set_xlabel("round")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8)
    ax.set_title("bytes per round", fontsize=10)
    fig.tight_layout()
    fig.savefig(bytes_path, dpi=110)
    plt.close(fig)
    return True


def _plot_straggling(report: dict, path: Any) -> bool:
    import matplotlib.pyplot as plt
    import numpy as np

    rounds = (report.get("straggling") or {}).get("rounds") or []
    if not rounds:
        return False
    r = [x["round"] for x in rounds]
    x = np.arange(len(r))
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.bar(x - 0.27, [v["fastest_s"] for v in rounds], 0.27, label="fastest agent", color="#55a868")
    ax.bar(x, [v["slowest_s"] for v in rounds], 0.27, label="slowest agent", color="#c44e52")
    ax.bar(x + 0.27, [v["idle_s"] for v in rounds], 0.27, label="idle (waiting for the slowest)", color="#d9d9d9")
    ax.set_xticks(x, r)
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    twin = ax.twinx()
    twin.plot(x, [v["ratio"] if v["ratio"] is not None else np.nan for v in rounds], color="#222222",
              marker="o", label="slowest / fastest")
    twin.set_ylabel("ratio")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    median = (report.get("straggling") or {}).get("median_ratio")
    ax.set_title(f"straggling (median ratio {median})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _esc(value: Any) -> str:
    import html

    return html.escape(str(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """<style>body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;
border:1px solid #eee;margin:.3em 0}h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em}.note{color:#555;
font-size:13px}</style>"""


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_report(run_dir: Any) -> Any:
    """DIR/report.json -> DIR/report.html and DIR/plots/*.png; returns the HTML path."""
    from pathlib import Path

    from senseshield.plotting import pyplot
    from senseshield.results import privacy_line

    pyplot()  # the Agg backend; says where matplotlib writes in the home directory

    run_dir = Path(run_dir)
    report = _load(run_dir / "report.json")
    if not isinstance(report.get("straggling"), dict) or "rounds" not in report["straggling"]:
        report["straggling"] = straggling_summary(report.get("agents", []))  # reports before the summary
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    images = []
    if _plot_timeline(report, plots / "timeline.png"):
        images.append(("Timeline", "plots/timeline.png"))
    if _plot_straggling(report, plots / "straggling.png"):
        images.append(("Straggling", "plots/straggling.png"))
    if _plot_budgets(report, plots / "budgets.png"):
        images.append(("Budgets and HE ratios", "plots/budgets.png"))
    if _plot_rounds(report, plots / "accuracy.png", plots / "bytes.png"):
        images += [("Accuracy", "plots/accuracy.png"), ("Bytes", "plots/bytes.png")]
    strag = report["straggling"]
    metric = report.get("metric_name") or "accuracy"
    summary = _table(["strategy", "scheme", "rounds", f"final {metric}", "median straggling ratio",
                      "median idle s", "median round s", "budget mode", "clusters"], [[
        report.get("strategy"), report.get("scheme") or "-", len(report.get("rounds", [])),
        _fmt(report.get("final_metric") if report.get("final_metric") is not None else report.get("final_accuracy")), _fmt(strag.get("median_ratio"), 2), _fmt(strag.get("median_idle_s"), 2),
        _fmt(_median_of([r["seconds"] for r in report.get("rounds", [])]), 2),
        (report.get("budgets") or {}).get("mode", "paper"), report.get("num_clusters")]])
    per_round = _table(["round", "agents", "slowest agent", "slowest s", "fastest agent", "fastest s", "ratio",
                        "work ratio", "idle s", "round s", metric, "MB up", "MB down"], [
        [x["round"], x["agents"], x["slowest_agent"], _fmt(x["slowest_s"]), x["fastest_agent"], _fmt(x["fastest_s"]),
         _fmt(x["ratio"], 2), _fmt(x.get("work_ratio"), 2), _fmt(x["idle_s"], 2), _fmt(rd.get("seconds"), 2), _fmt(_metric_of(rd, metric)),
         _fmt(rd.get("bytes_up", 0) / 1e6, 2), _fmt(rd.get("bytes_down", 0) / 1e6, 2)]
        for x in strag.get("rounds", [])
        for rd in [next((v for v in report.get("rounds", []) if v["round"] == x["round"]), {})]])
    clients = {c["id"]: c for c in report.get("clients", [])}
    agent_rows = []
    for agent in report.get("agents", []):
        c, p = clients.get(agent["id"], {}), agent.get("profile") or {}
        busy = [v["busy_s"] for v in (agent.get("rounds") or {}).values() if v.get("busy_s") is not None]
        agent_rows.append([agent["id"], p.get("board", "-"), _fmt(p.get("cpu_share"), 3), _fmt(p.get("bandwidth"), 3),
                           _fmt(c.get("cpu_speed"), 2), c.get("cluster", "-"), _fmt(c.get("encryption_budget")),
                           _fmt(c.get("he_ratio")), _fmt(_median_of(busy), 3), _fmt(_metric_of(c, metric)),
                           _fmt(agent.get("clock_offset_s"), 4)])
    agents = _table(["agent", "device", "CPU share", "MB/s", "v_i", "cluster", "budget α", "HE ratio",
                     "median busy s", metric, "clock offset s"], agent_rows)
    events = report.get("straggling_events") or []
    notes = [n for r in report.get("rounds", []) for n in r.get("notes", [])]
    privacy = privacy_line(report)
    parts = [f"<h1>SenseShield run: {_esc(report.get('strategy'))} on {_esc(report.get('dataset'))}/"
             f"{_esc(report.get('model'))}</h1>", summary,
             *([f"<p class=note>{_esc(privacy)}</p>"] if privacy else []), "<h2>Straggling per round</h2>",
             f"<p class=note>{_esc(strag.get('definition', STRAGGLING_DEFINITION))}</p>", per_round,
             "<h2>Agents</h2>", agents]
    budget_notes = (report.get("budgets") or {}).get("clusters") or {}
    for k, note in budget_notes.items():
        if note.get("mode") == "calibrated":
            parts.append(f"<p class=note>cluster {_esc(k)}: calibrated budgets line up at a predicted "
                         f"{_esc(note.get('target_s'))} s per agent"
                         f"{' (capped by the deadline)' if note.get('deadline_capped') else ''}.</p>")
        elif note.get("fallback"):
            parts.append(f"<p class=note>cluster {_esc(k)}: {_esc(note['fallback'])}.</p>")
    for title, src in images:
        parts += [f"<h2>{_esc(title)}</h2>", f'<img src="{_esc(src)}" alt="{_esc(title)}">']
    if events or notes:
        parts.append("<h2>Events</h2><ul>" + "".join(
            f"<li>round {_esc(e['round'])}: no {_esc(e['missing'])} from {_esc(e['agent'])}</li>" for e in events)
            + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    page = run_dir / "report.html"
    page.write_text("<!doctype html><meta charset=utf-8><title>SenseShield report</title>" + STYLE + "\n".join(parts))
    return page


def _median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def render_trial(trial_dir: Any) -> Any:
    """DIR/trial.json -> every run's report.html and DIR/report.html comparing the runs."""
    import numpy as np

    from senseshield.plotting import pyplot
    from senseshield.results import privacy_line

    plt = pyplot()
    from pathlib import Path

    trial_dir = Path(trial_dir)
    trial = _load(trial_dir / "trial.json")
    runs = trial.get("runs", [])
    for run in runs:
        if (trial_dir / run["label"] / "report.json").exists():
            render_report(trial_dir / run["label"])
    parts = [f"<h1>SenseShield trial: {_esc(trial.get('name'))}</h1>",
             f"<p>{_esc(trial.get('description', ''))}</p>"]
    m, emu = trial.get("machine", {}), trial.get("emulation", {})
    parts.append(f"<p class=note>machine: {_esc(m.get('cpu'))}, {_esc(m.get('cores'))} cores, load at start "
                 f"{_esc(m.get('load_at_start'))}; emulation: cgroup {_esc(emu.get('cgroup'))}, network namespaces "
                 f"{_esc(emu.get('netns'))}, qdisc {_esc(emu.get('qdisc'))}; scale {_esc(trial.get('scale'))}; "
                 f"broker {_esc(trial.get('broker'))}</p>")
    for note in emu.get("notes", []):
        parts.append(f"<p class=note>note: {_esc(note)}</p>")
    parts.append(_table(
        ["run", "strategy", "budget", "median straggling ratio", "(after round 1)", "work ratio", "median round s",
         "x plaintext", "median idle s", "HE ratio", "MB up / round", "final accuracy", "straggling events"],
        [[f"{r['label']}", r["strategy"], r["budget_mode"], _fmt(r["median_ratio"], 2),
          _fmt(r.get("median_ratio_after_round_1"), 2), _fmt(r.get("median_work_ratio"), 2),
          _fmt(r["median_round_s"], 2),
          _fmt(r.get("round_s_vs_plaintext"), 2), _fmt(r.get("median_idle_s"), 2), _fmt(r["he_ratio_mean"]),
          _fmt(r["mb_up_per_round"], 2), _fmt(r["final_accuracy"]), r["straggling_events"]] for r in runs]))
    agents = trial.get("agents", [])
    parts.append("<h2>Fleet</h2>" + _table(
        ["agent", "device", "CPU share (cores)", "MB/s", "latency ms", "v_i", "applied"] +
        [f"α {r['label']}" for r in runs],
        [[a["id"], a["device"], _fmt(a.get("cpu_share")), _fmt(a.get("bandwidth")), _fmt(a.get("latency_ms"), 1),
          _fmt(a.get("cpu_speed"), 2), ", ".join(f"{k}={v}" for k, v in (a.get("applied") or {}).items()
                                                 if k in ("cpu_quota", "qdisc"))]
         + [_fmt((r.get("budgets") or {}).get(a["id"])) for r in runs] for a in agents]))
    if runs:
        x = np.arange(len(runs))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(runs) + 2), 3.4))
        ax.bar(x - 0.2, [r["median_ratio"] or 0 for r in runs], 0.4, color="#c44e52", label="median straggling ratio")
        twin = ax.twinx()
        twin.bar(x + 0.2, [r["median_round_s"] or 0 for r in runs], 0.4, color="#4c72b0", label="median round s")
        ax.set_xticks(x, [r["label"] for r in runs], fontsize=8)
        ax.set_ylabel("slowest / fastest")
        twin.set_ylabel("seconds")
        ax.axhline(1.0, color="#444", lw=0.6)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=8, loc="upper left")
        ax.set_title("runs on the same fleet and data", fontsize=10)
        fig.tight_layout()
        fig.savefig(trial_dir / "comparison.png", dpi=110)
        plt.close(fig)
        parts.append('<h2>Comparison</h2><img src="comparison.png" alt="comparison">')
    for r in runs:
        sub = trial_dir / r["label"]
        parts.append(f'<h2>{_esc(r["label"])}</h2><p><a href="{_esc(r["label"])}/report.html">full report</a></p>')
        for name in ("timeline", "straggling", "budgets"):
            if (sub / "plots" / f"{name}.png").exists():
                parts.append(f'<img src="{_esc(r["label"])}/plots/{name}.png" alt="{name}">')
    page = trial_dir / "report.html"
    page.write_text("<!doctype html><meta charset=utf-8><title>SenseShield trial</title>" + STYLE + "\n".join(parts))
    return page


def render_any(path: Any) -> Any:
    """A run directory (report.json) or a trial directory (trial.json) -> its report.html."""
    from pathlib import Path

    from senseshield.errors import ConfigError

    path = Path(path)
    if (path / "report.json").is_file():
        return render_report(path)
    if (path / "trial.json").is_file():
        return render_trial(path)
    if path.is_file() and path.name in ("report.json", "trial.json"):
        return render_any(path.parent)
    raise ConfigError(f"{str(path)!r} holds neither report.json nor trial.json; give a run or trial directory.")
