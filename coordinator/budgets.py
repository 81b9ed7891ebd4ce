"""What the coordinator plans of each device's round from what its earlier rounds showed:
calibrated budgets (:func:`recalibrate`), measured budgets (:func:`refresh_measured`) and
partial work (:func:`local_steps`). Each reads the job's state (:class:`coordinator.state.JobState`:
the plan, the agents' hellos, their per-round records and metrics) and, for the budgets,
updates its plan; none needs the transport."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from coordinator import roster
from coordinator.report import agent_round_records, clock_offsets
from senseshield.engine.work import device_work, full_steps, recent_median
from senseshield.job import train_config
from senseshield.rounds import plan_local_steps
from senseshield.strategies import BootstrapReport
from senseshield.strategies.base import RoundCosts, measured_intervals

if TYPE_CHECKING:
    from coordinator.state import JobState

MEASURED_MARGIN = 0.8
"""Partial work from measured round times plans to this fraction of the straggle limit (never
below the quickest device's own round): measured on the 20x-slower-device benchmark
(benchmarks/bench_straggle.py), planning at the limit itself left half the rounds above it."""


def full_steps_of(state: JobState, agent: str) -> int:
    """Local steps of full work of ``agent`` (its sample count, the job's epochs and batch)."""
    c = state.config
    return full_steps(state.agents[agent].hello.n_samples, batch_size=c.batch_size, epochs=c.local_epochs)


def rounds_of(state: JobState, agent: str, offsets: dict[str, float]) -> dict[str, dict]:
    """report.json ``agents[].rounds`` of ``agent`` so far (on the coordinator's clock: its
    offset in ``offsets``, :func:`coordinator.report.clock_offsets`)."""
    return agent_round_records(state.agent_rounds, state.metrics, agent, offsets.get(agent, 0.0))


def local_steps(state: JobState, r: int, ids: list[str], *, log: logging.Logger) -> dict[str, int]:
    """Partial work before round ``r`` (:func:`senseshield.rounds.plan_local_steps`): each
    device's seconds per step, and its other round work, from its last 5 delivered rounds
    (:func:`senseshield.engine.work.device_work`: training and scoring sensitivity grow with
    the steps; the rest is what its round took beyond them, plan in hand to update received
    as the straggling figure counts it); before every device delivered one, relative speeds
    from the join (1 / measured GFLOPS when all measured it, else 1 / cpu_speed, as in the
    simulator). From measured seconds it plans to :data:`MEASURED_MARGIN` x the limit: a
    round's straggling compares its slowest round to that round's quickest, and both
    scatter around the medians the prediction uses. Devices with partial work get
    ``local_steps`` in their round plan; the others train in full."""
    o = state.config.options
    ids = [a for a in ids if a in state.agents]
    if not ids or state.strategy.round_plan(r).dpsgd:
        return {}
    per_step, other = {}, {}
    offsets = clock_offsets(state.metrics, state.uplink_delays)
    for a in ids:
        records = rounds_of(state, a, offsets)
        work = device_work([(rr, x["agent_timings"], x.get("steps"), (records.get(str(rr)) or {}).get("busy_s"))
                            for rr, x in sorted(state.agent_rounds.get(a, {}).items()) if x.get("agent_timings")])
        per_step[a], other[a] = (None, 0.0) if work is None else work
    margin = 1.0
    if all(v is not None for v in per_step.values()):
        step_s, deadline, margin = per_step, state.round_deadline, MEASURED_MARGIN
    else:  # relative speeds only (no seconds): no deadline term, no other work
        profiles = {a: state.agents[a].hello.profile or {} for a in ids}
        gflops = {a: p.get("gflops") for a, p in profiles.items()}
        if all(isinstance(g, (int, float)) and g > 0 for g in gflops.values()):
            step_s = {a: 1.0 / float(g) for a, g in gflops.items()}
        else:
            step_s = {a: 1.0 / state.agents[a].hello.cpu_speed for a in ids}
        other, deadline = {}, None
    if o.straggle_limit is None and deadline is None:
        return {}
    n_train = {a: state.agents[a].hello.n_samples for a in ids}
    full = {a: full_steps_of(state, a) for a in ids}
    cut_before = {a for a in ids if state.steps_of.get(a, full[a]) < full[a]}
    steps = plan_local_steps(n_train, train_config(state.config), step_s=step_s, other_s=other,
                             limit=o.straggle_limit, deadline_s=deadline, margin=margin, cut=cut_before)
    cut = {a: s for a, s in steps.items() if s < full[a]}
    if cut:
        log.info("round %d: partial work %s", r, {a: f"{s}/{full[a]} steps" for a, s in sorted(cut.items())})
    return cut


def recalibrate(state: JobState, r: int, *, block_size: int, log: logging.Logger) -> None:
    """Calibrated budgets, before round ``r``: refine every device's costs from what its
    rounds since round 2 showed (round 1 warms torch and the HE tables up) -- medians of
    the encryption rate (encrypted values / encrypt seconds), of the budget-independent
    work (train, sensitivity, mask, noise) plus what the delivered round took beyond the
    model (busy time - those phases - encryption - bytes / bandwidth), with their min/max
    over the rounds as intervals (devices that agree within them are pooled) -- and let the
    strategy recompute the budgets (:meth:`Strategy.rebudget`)."""
    plan = state.plan
    if plan is None or state.config.options.budget_mode != "calibrated" or r < 3:
        return
    reports, observed = [], {}
    offsets = clock_offsets(state.metrics, state.uplink_delays)
    for a in sorted(plan.cluster_of):
        info = state.agents.get(a)
        if info is None:
            continue
        base = RoundCosts.from_profile(info.hello.profile)
        rates, fixed = [], []
        for rr, rec in rounds_of(state, a, offsets).items():
            raw = state.agent_rounds[a].get(int(rr), {})
            tm, f = raw.get("agent_timings") or {}, raw.get("he_ratio")
            if int(rr) < 2 or not tm or f is None:
                continue
            enc = tm.get("encrypt", 0.0)
            if enc > 0.005 and f > 0:
                rates.append(f * state.size / enc)
            work = sum(tm.get(k, 0.0) for k in ("train", "sensitivity", "mask", "noise"))
            if rec.get("busy_s") is not None and raw.get("bytes_up"):
                transfer = raw["bytes_up"] / (info.hello.bandwidth * 1e6)
                work += max(rec["busy_s"] - work - enc - transfer, 0.0)
            fixed.append(work)
            observed[a] = (raw.get("budget", plan.budget_of[a]), f)
        if base is None and not rates:
            continue
        rate = float(np.median(rates)) if rates else base.encrypt_per_s  # type: ignore[union-attr]
        train = float(np.median(fixed)) if fixed else base.train_s  # type: ignore[union-attr]
        costs = RoundCosts(train, rate, base.bytes_per_encrypted if base else 8.0, base.latency_s if base else 0.0)
        intervals = measured_intervals(info.hello.profile)  # the rounds' spread replaces the join's
        for name, seen in (("encrypt_per_s", rates), ("train_s", fixed)):
            if len(seen) >= 2:
                intervals[name] = (min(seen), max(seen))
        reports.append(BootstrapReport(a, info.hello.n_samples, info.hello.bandwidth, info.hello.cpu_speed,
                                       info.vector, costs, intervals))
    if not reports:
        return
    cluster_of = {rep.client_id: plan.cluster_of[rep.client_id] for rep in reports}
    result = state.strategy.rebudget(reports, cluster_of, size=state.size, block_size=block_size, observed=observed)
    if result is None:
        return
    budgets, notes = result
    plan.budget_of.update(budgets)
    plan.budget_notes.setdefault("rounds", {})[str(r)] = notes["clusters"]
    log.info("round %d: calibrated budgets %s", r, {a: round(b, 3) for a, b in sorted(budgets.items())})


def encryption_rates(state: JobState, agent: str) -> list[float]:
    """Values ``agent`` encrypted per second in each of its delivered rounds since round 2
    (round 1 warms torch and the HE tables up), oldest first: encrypted share x model size
    over its encrypt seconds (rounds encrypting under 5 ms are left out: too short to time)."""
    rates = []
    for rr, raw in sorted(state.agent_rounds.get(agent, {}).items()):
        enc, f = (raw.get("agent_timings") or {}).get("encrypt", 0.0), raw.get("he_ratio")
        if int(rr) >= 2 and f and enc > 0.005:
            rates.append(f * state.size / enc)
    return rates


def refresh_measured(state: JobState, r: int, *, block_size: int, log: logging.Logger, window: int = 5,
                     least: int = 3) -> None:
    """Measured budgets, before round ``r``: in a cluster whose members all measured their
    encryption rate at join and all delivered ``least`` timed rounds since round 2, a device
    whose rounds show it slower than it measured -- the median rate of its last ``window``
    rounds (:func:`senseshield.engine.work.recent_median`: one busy round does not move it)
    below its join rate (a CPU quota set after the join or not visible to it, throttling) --
    gets that median as its rate, with [the rounds' min, the median] as its interval; the others keep
    their join figures. Rounds never raise a rate above the join's: a round encrypts with
    randomness the device precomputed while it waited, so a round's rate depends on how
    long it waited and how few values its budget asked for (measured: a device under a 5 %
    quota with budget 0.04 timed 11,000-23,000 values/s in rounds against 4,400 at join,
    and identical fast devices scattered 0.3-1.1 M values/s), and raising budgets on it made
    the slow device's budget climb to 1.0."""
    plan = state.plan
    if plan is None or state.config.options.budget_mode != "measured" or r < 3:
        return
    reports = {a: roster.report_of(state.agents, a) for a in sorted(plan.cluster_of) if a in state.agents}
    refreshed = []
    for k in plan.clusters:
        members = [a for a in plan.members(k) if a in reports]
        seen = {a: encryption_rates(state, a)[-window:] for a in members}
        if not members or any(reports[a].encryption is None or len(seen[a]) < least for a in members):
            continue
        for a in members:
            rep, median = reports[a], recent_median(seen[a], k=window)
            if median is not None and median < rep.encryption.per_s:
                # a round's fast outlier (a full pool) must not pool it with faster devices
                intervals = dict(rep.intervals, he_encryptions_per_s=(min(seen[a]), median))
                reports[a] = replace(rep, intervals=intervals, encryption=replace(rep.encryption, per_s=median))
        refreshed.append(k)
    if not refreshed:
        return
    cluster_of = {a: plan.cluster_of[a] for a in reports}
    result = state.strategy.rebudget(list(reports.values()), cluster_of, size=state.size, block_size=block_size)
    if result is None:
        return
    budgets, notes = result
    changed = {a: b for a, b in budgets.items() if plan.cluster_of[a] in refreshed}
    plan.budget_of.update(changed)
    plan.budget_notes.setdefault("rounds", {})[str(r)] = {
        str(k): v for k, v in notes.get("clusters", {}).items() if int(k) in refreshed}
    log.info("round %d: budgets from round timings %s", r, {a: round(b, 3) for a, b in sorted(changed.items())})
