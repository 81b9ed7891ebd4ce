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
    "- model and plan in hand on the agent; ratio = slowest busy / fastest busy; idle_s = sum "
    "over agents of the time between their delivery and the last delivery of their cluster"
)


def straggling_summary(agents: list[dict[str, Any]]) -> dict[str, Any]:
    """Straggling figures from report.json's ``agents`` (their ``rounds[r].timestamps`` must
    hold ``start_at`` and ``update_received`` on one clock, as the coordinator writes them).

    Returns ``{"rounds": [{round, agents, slowest_s, fastest_s, ratio, idle_s,
    slowest_agent, fastest_agent, clusters: {k: {slowest_s, fastest_s, ratio, idle_s}}}],
    "median_ratio", "median_slowest_s", "median_idle_s", "definition"}``; a round without
    delivered updates is left out, and medians are None without rounds.
    """
    by_round: dict[int, list[tuple[str, int, float, float]]] = {}
    for agent in agents:
        for r, rec in (agent.get("rounds") or {}).items():
            ts = rec.get("timestamps") or {}
            start, end = ts.get("start_at"), ts.get("update_received")
            if not rec.get("delivered") or start is None or end is None:
                continue
            by_round.setdefault(int(r), []).append((agent["id"], int(rec.get("cluster", 0)), float(start), float(end)))
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

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    return {
        "rounds": rounds,
        "median_ratio": median(ratios),
        "median_slowest_s": median([x["slowest_s"] for x in rounds]),
        "median_idle_s": median([x["idle_s"] for x in rounds]),
        "definition": STRAGGLING_DEFINITION,
    }


def _spread(rows: list[tuple[str, int, float, float]]) -> dict[str, Any]:
    busy = [(max(end - start, 0.0), agent) for agent, _, start, end in rows]
    slow, fast = max(busy), min(busy)
    last = max(end for *_, end in rows)
    return {
        "slowest_s": round(slow[0], 4),
        "fastest_s": round(fast[0], 4),
        "ratio": round(slow[0] / fast[0], 4) if fast[0] > 0 else None,
        "idle_s": round(sum(last - end for *_, end in rows), 4),
        "slowest_agent": slow[1],
        "fastest_agent": fast[1],
    }
