"""The coordinator's report of a job: ``report.json`` (:class:`FleetReport`), the per-round
records, the operator's round line and the straggling figures of the Prometheus endpoint.

Everything here is computed from the job's state (:class:`coordinator.state.JobState`, read
as it is), so a report can be built from a hand-made state without a broker
(tests/test_coordinator_report.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.roster import online
from senseshield.accounting import Accountant, Epsilons, epsilons
from senseshield.results import (
    ClientRecord,
    RoundRecord,
    RunResult,
    failed_phrase,
    privacy_fields,
    weighted_accuracy,
    weighted_metrics,
)
from senseshield.runtime.protocol.messages import Metrics

if TYPE_CHECKING:
    from coordinator.state import JobState


class FleetReport(RunResult):
    """``DIR/report.json`` of a fleet run: :class:`~senseshield.results.RunResult`'s fields (a contract) plus
    the fleet's: per-agent, per-round phase seconds, bytes and timestamps (Unix time on the
    coordinator's clock: agents' own timestamps are shifted by their estimated clock offset,
    ``agents[].clock_offset_s``), the server's aggregate/decrypt seconds and timestamps per
    cluster, ``straggling`` figures (per round slowest/fastest/ratio/idle and the median
    ratio, :func:`senseshield.trials.report.straggling_summary`), ``straggling_events`` (agents a
    round closed without), how budgets were chosen (``budgets``), how the job ended (``state``, ``reason``), what
    devices said failed (``failures``), refused agents and
    rejected messages (``rejected_messages``: the latest 1,000 reasons; ``rejected_total``:
    how many in all)."""

    fleet: str
    run_id: str
    key_id: str | None = None  # the key server's key of the run (None: nothing encrypted)
    input_shape: list[int]
    num_classes: int
    round_deadline: float
    bootstrap_seconds: float
    agents: list[dict]
    server: list[dict]
    straggling: dict = {}
    straggling_events: list[dict] = []
    budgets: dict = {}
    state: str = "done"  # the job's end: done, failed or cancelled
    reason: str = ""  # why it failed or was cancelled (one sentence)
    failures: list[dict] = []  # each round or evaluation a device said failed: round, agent, phase, reason
    refused: dict[str, str] = {}
    declined: dict[str, str] = {}  # devices that did not take the job, and why
    rejected_messages: list[str] = []
    rejected_total: int = 0


def clock_offsets(metrics: dict[tuple[str, int], Metrics], uplink_delays: dict[str, list[float]]) -> dict[str, float]:
    """Each agent's estimated (agent clock - coordinator clock) in seconds, NTP style: half
    the difference of its smallest downlink sample (round plan: received on the agent - sent
    here) and its smallest uplink sample (hello/metrics: received here - sent there); agents
    without samples both ways (e.g. every process on one machine's clock) are left out
    (0.0). One pass over the metrics, however many agents."""
    down: dict[str, float] = {}
    for (a, _), m in metrics.items():
        t = m.timings
        if "plan_received_at" in t and "plan_frame_sent_at" in t:
            sample = t["plan_received_at"] - t["plan_frame_sent_at"]
            down[a] = min(down.get(a, sample), sample)
    return {a: round((d - min(uplink_delays[a])) / 2.0, 6) for a, d in down.items() if uplink_delays.get(a)}


def agent_round_records(agent_rounds: dict[str, dict[int, dict]], metrics: dict[tuple[str, int], Metrics],
                        agent_id: str, offset: float) -> dict[str, dict]:
    """report.json ``agents[].rounds``: phases (s), bytes, and timestamps on our clock."""
    out = {}
    for r, info in sorted(agent_rounds.get(agent_id, {}).items()):
        m = metrics.get((agent_id, r))
        timings = m.timings if m else info.get("agent_timings", {})
        # the update carries the round's timestamps too (a busy device's metrics come rounds later)
        stamps = {k: v - offset for k, v in timings.items() if k.endswith("_at") and k != "plan_frame_sent_at"}
        stamps |= {k: v for k, v in info.items() if k in ("plan_sent", "update_received")}
        if "ready_at" in stamps:  # plan and model in hand (the agent may still be busy)
            stamps["start_at"] = stamps["ready_at"]
        elif "plan_received_at" in stamps:
            stamps["start_at"] = stamps["plan_received_at"] + float(timings.get("wait_model", 0.0))
        busy = None
        if "start_at" in stamps and "update_received" in stamps:
            busy = round(max(stamps["update_received"] - stamps["start_at"], 0.0), 6)
        out[str(r)] = {
            "cluster": info["cluster"],
            "delivered": "update_received" in info,
            "he_ratio": info.get("he_ratio"),
            "mask_sha256": info.get("mask_sha256"),
            "bytes_up": info.get("bytes_up"),
            "bytes_down": int(timings["bytes_down"]) if "bytes_down" in timings else None,
            "phases": {k: round(v, 6) for k, v in timings.items()
                       if not k.endswith("_at") and not k.startswith("bytes_")},
            "timestamps": {k: round(v, 6) for k, v in sorted(stamps.items(), key=lambda kv: kv[1])},
            "busy_s": busy,
            "budget": info.get("budget"),
            "metric": m.metric if m else None,
            "training": info.get("training", {}),
            "failed": info.get("failed", {}),  # phase (round, evaluation) -> the device's sentence
            # a buffered job: the round the device trained in and the model round it started from
            **{k: info[k] for k in ("trained_in", "model_round") if k in info},
        }
    return out


def latest_training(rounds: dict[int, dict], r: int | None = None) -> dict[str, float]:
    """The ``training_*`` metrics an agent's round records (``agent_rounds[agent]``) hold of its
    latest update delivered in round ``r`` or before (None: in any round); {} if none."""
    for rr in sorted((rr for rr in rounds if r is None or int(rr) <= r), key=int, reverse=True):
        record = rounds.get(rr) or {}  # get: a packed round is read, not unpacked for good
        if record.get("training"):
            return dict(record["training"])
    return {}


def user_epsilons(delta: float, accountant: Accountant, participations: dict[str, int], *,
                  records: list | None = None, pld: bool = False) -> Epsilons:
    """The run's epsilons so far (senseshield.accounting): the user-level accountant,
    whose server figure is that of the agent sampled most often, and ``records``, the
    agents' DP-SGD histories."""
    return epsilons(delta, user=accountant, participations=max(participations.values(), default=0),
                    records=records or [], pld=pld)


def round_line(rec: dict, *, rounds: int, out: int, metrics: dict[tuple[str, int], Metrics],
               metric_name: str) -> tuple[str, float | None]:
    """The operator's line for the closed round ``rec`` (of ``rounds``; ``out`` devices of the
    plan not sampled): devices in / late / out, the metric the devices reported so far (of
    the newest round they evaluated), seconds; and that weighted metric (None: none yet)."""
    delivered = sum(len(c["updates"]) for c in rec["clusters"].values())
    failed = {a: why for c in rec["clusters"].values() for a, why in c.get("failed", {}).items()}
    late = sum(len(c["straggled"]) for c in rec["clusters"].values()) - len(failed)
    latest = max((rr for _, rr in metrics), default=0)
    pairs = [(m.metric, m.n_test) for (_, rr), m in metrics.items() if rr == latest]
    value = weighted_accuracy(pairs) if pairs else None
    shown = f"{metric_name} {value:.4g} (round {latest})" if pairs else f"{metric_name} pending"
    changes = "".join(f", {w} {', '.join(who)}" for w, who in (("joined", rec["joined"]), ("left", rec["left"])) if who)
    failures = f", {failed_phrase(failed)}" if failed else ""
    line = (f"round {rec['round']}/{rounds}: {delivered} in, {late} late{failures}, {out} out{changes}; {shown}; "
            f"{rec['seconds']:.1f} s")
    return line, value


def round_failure(rec: dict) -> str | None:
    """Why a job cannot go on after the closed round ``rec`` (one sentence), or None: no device
    delivered an update in it and devices said their round failed."""
    delivered = sum(len(c["updates"]) for c in rec["clusters"].values())
    failed = {a: why for c in rec["clusters"].values() for a, why in c.get("failed", {}).items()}
    if delivered or not failed:
        return None
    return f"round {rec['round']}: no device delivered an update; {failed_phrase(failed)}"


def failures(agent_rounds: dict[str, dict[int, dict]]) -> list[dict]:
    """report.json ``failures``: every round or evaluation a device said failed, and why,
    in round order."""
    out = [{"round": int(r), "agent": a, "phase": phase, "reason": why}
           for a, rounds in agent_rounds.items() for r, info in rounds.items()
           for phase, why in info.get("failed", {}).items()]
    return sorted(out, key=lambda f: (f["round"], f["agent"], f["phase"]))


def agent_rounds_of(state: JobState, agent_id: str, offsets: dict[str, float]) -> dict[str, dict]:
    """report.json ``agents[].rounds`` of ``agent_id``, on the coordinator's clock (its
    estimated offset in ``offsets``, :func:`clock_offsets`)."""
    return agent_round_records(state.agent_rounds, state.metrics, agent_id, offsets.get(agent_id, 0.0))


def straggling_now(state: JobState) -> tuple[dict, float | None] | None:
    """The straggling figures of the latest round with delivered updates and the median
    ratio so far (None before any): what the Prometheus endpoint shows."""
    from senseshield.trials.report import straggling_summary

    offsets = clock_offsets(state.metrics, state.uplink_delays)
    agents = [{"id": a, "rounds": agent_rounds_of(state, a, offsets)} for a in sorted(state.plan.cluster_of)]
    summary = straggling_summary(agents)
    return (summary["rounds"][-1], summary["median_ratio"]) if summary["rounds"] else None


def round_records(state: JobState) -> list[RoundRecord]:
    """Per closed round: the tally plus the metric from the agents' metrics (each agent's
    latest at or before the round, with the training metrics of its latest update)."""
    out = []
    ids = sorted(state.plan.cluster_of)
    by_agent: dict[str, dict[int, Metrics]] = {}
    for (a, rr), m in state.metrics.items():
        by_agent.setdefault(a, {})[rr] = m
    for rec in state.records:
        r = rec["round"]
        pairs = []
        for a in ids:
            rounds = [rr for rr in by_agent.get(a, {}) if rr <= r]
            if rounds:
                latest = by_agent[a][max(rounds)]
                pairs.append(({**latest.metrics, state.metric_name: latest.metric,
                               **latest_training(state.agent_rounds.get(a, {}), r)}, latest.n_test))
        eps, eps_server = rec["user_epsilon"], rec.get("user_epsilon_server", rec["user_epsilon"])
        if state.strategy.dp_level is not None:
            agent_eps = [m.epsilon for (aid, rr), m in state.metrics.items() if rr == r and m.epsilon is not None]
            eps = max([eps or 0.0, *agent_eps])
            eps_server = max([eps_server or 0.0, *agent_eps])
        record = rec["tally"].record(
            r, state.strategy, metric_name=state.metric_name, metrics=weighted_metrics(pairs), seconds=rec["seconds"],
            participants=rec["participants"], sample_rate=state.config.options.sample_rate,
            sampled=rec.get("sampled"),
            epsilon=eps, epsilon_server=eps_server, delta=state.config.options.delta,
        )
        out.append(record.model_copy(update={"joined": rec.get("joined", []), "left": rec.get("left", [])}))
    return out


def report_json(result: FleetReport) -> dict[str, Any]:
    """``result`` as report.json's object, in field order. Its two per-device lists
    (``agents``, ``server``) are JSON already and go in as they are: dumping them again would
    copy the largest part of a large fleet's report once more."""
    large = ("agents", "server")
    small = result.model_dump(mode="json", exclude=set(large))
    ordered = {name: getattr(result, name) if name in large else small.pop(name)
               for name in type(result).model_fields if name in large or name in small}
    return {**ordered, **small}


def report(state: JobState, *, fleet: str, key_id: str | None = None, rejected: Any = (),
           rejected_total: int = 0) -> FleetReport:
    """The job's report: the simulator's fields plus per-agent phase timings and straggling
    (``key_id``: the key server's key of the job; ``rejected``: the latest rejection reasons
    of the coordinator, ``rejected_total`` how many in all)."""
    import platform

    import torch

    from senseshield.trials.report import straggling_summary

    config, strategy, plan = state.config, state.strategy, state.plan
    rounds = round_records(state)
    latest: dict[str, Metrics] = {}
    for (a, r), m in sorted(state.metrics.items(), key=lambda x: x[0][1]):
        latest[a] = m
    clients = []
    agents = []
    offsets = clock_offsets(state.metrics, state.uplink_delays)
    for a in sorted(plan.cluster_of):
        hello = state.agents[a].hello if a in state.agents else None
        ratios = [v["he_ratio"] for v in state.agent_rounds.get(a, {}).values() if "he_ratio" in v]
        training = latest_training(state.agent_rounds.get(a, {}))
        clients.append(ClientRecord(
            id=a, cluster=plan.cluster_of[a], category=None,
            encryption_budget=plan.budget_of[a], he_ratio=float(np.mean(ratios)) if ratios else 0.0,
            accuracy=(latest[a].metric if a in latest else 0.0) if state.metric_name == "accuracy" else None,
            metric=latest[a].metric if a in latest else None,
            metrics={**(latest[a].metrics if a in latest else {}), **training},
            n_train=hello.n_samples if hello else 0, n_test=latest[a].n_test if a in latest else 0,
            bandwidth=hello.bandwidth if hello else 0.0, cpu_speed=hello.cpu_speed if hello else 0.0,
        ))
        offset = offsets.get(a, 0.0)
        agents.append({"id": a, "profile": hello.profile if hello else {}, "online": online(state.agents, a),
                       "clock_offset_s": offset,
                       "inference": latest[a].inference if a in latest else {},
                       "rounds": agent_round_records(state.agent_rounds, state.metrics, a, offset)})
    server = [{"round": rec["round"], "started_at": rec.get("started_at"), "finished_at": rec.get("finished_at"),
               "clusters": {str(k): v for k, v in rec["clusters"].items()}}
              for rec in state.records]
    straggling = straggling_summary(agents)
    o = config.options
    dp = strategy.dp_level is not None
    final = (state.user_epsilons(records=[m.dp_history for m in latest.values()], pld=True)
             if dp and rounds else None)
    sigma_record = state.sigma_record or {}
    return FleetReport(
        strategy=config.strategy, scheme=state.scheme, dataset=config.dataset,
        model=config.model, partition=config.partition, seed=config.seed,
        num_params=state.size, num_clusters=len(plan.clusters), cluster_ari=None,
        clustering_epsilon=o.cluster_epsilon if strategy.clusters_clients else None,
        # None: no device reported the metric (e.g. every round failed)
        final_accuracy=(rounds[-1].accuracy if rounds and rounds[-1].metrics else None)
        if state.metric_name == "accuracy" else None,
        metric_name=state.metric_name, final_metric=rounds[-1].metric if rounds else None,
        seconds_total=time.time() - state.started, rounds=rounds, clients=clients,
        config=config.model_dump(mode="json"),
        machine={"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                 "torch": torch.__version__},
        delta=o.delta if dp else None, **privacy_fields(strategy, final),
        noise_multiplier=state.sigma_user if state.sigma_user is not None else (max(sigma_record.values()) if sigma_record else None),
        fleet=fleet, run_id=state.run_id, key_id=key_id if state.scheme else None,
        input_shape=state.input_shape, num_classes=state.num_classes,
        round_deadline=state.round_deadline, bootstrap_seconds=state.bootstrap_seconds,
        agents=agents, server=server, straggling=straggling, straggling_events=state.straggling,
        budgets=plan.budget_notes, failures=failures(state.agent_rounds),
        refused=state.refused, declined=state.declined,
        rejected_messages=list(rejected), rejected_total=rejected_total,
    )
