"""The coordinator's checkpoint: one place where a running job's state is persisted.

:class:`RunState` is what a restarted coordinator needs to resume a job after its last closed
round (the fleet plan, the round records, the agents' metrics and hellos, the accountant, the
sampler, ...); :class:`Checkpoint` writes it to ``--state-dir/coordinator-<fleet>.json``
atomically (:func:`senseshield.runtime.files.write_atomic`: the old checkpoint or the new
one, never a part) after every round and admission, reads it back when the job starts again,
and removes it when the job ends. An unreadable checkpoint is one sentence
(:class:`~senseshield.errors.ConfigError`) naming the file, never a traceback.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from senseshield.errors import ConfigError
from senseshield.results import RoundTally
from senseshield.runtime.files import write_atomic
from senseshield.runtime.protocol.messages import Hello, Metrics
from senseshield.strategies.base import FleetPlan


@dataclass
class RunState:
    """A job's state after its ``completed`` rounds (the JSON format is
    :meth:`to_json`; keys of round numbers and clusters are strings there)."""

    run_id: str
    config: dict[str, Any]  # the job (Job.model_dump(mode="json")): a checkpoint of another config is not resumed
    completed: int
    plan: FleetPlan
    hellos: dict[str, Hello]
    sampler: dict[str, Any]  # numpy bit generator state
    accountant: list  # senseshield.accounting.Accountant history
    model_round: dict[int, int] = field(default_factory=dict)
    sigma_user: float | None = None
    sigma_record: dict[str, float] = field(default_factory=dict)
    uplink_delays: dict[str, list[float]] = field(default_factory=dict)
    participations: dict[str, int] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)  # per closed round, with its RoundTally under "tally"
    metrics: dict[tuple[str, int], Metrics] = field(default_factory=dict)
    agent_rounds: dict[str, dict[int, dict]] = field(default_factory=dict)
    straggling: list[dict] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    bootstrap_seconds: float = 0.0
    in_flight: dict | None = None  # the round under way when it was written

    def to_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "run_id": self.run_id,
            "config": self.config,
            "completed": self.completed,
            "cluster_of": plan.cluster_of,
            "budget_of": plan.budget_of,
            "budget_notes": plan.budget_notes,
            "uplink_delays": self.uplink_delays,
            "fixed_masks": {str(k): np.flatnonzero(m).tolist() for k, m in plan.fixed_masks.items()},
            "rankings": {str(k): v.tolist() for k, v in plan.rankings.items()},
            "model_round": {str(k): r for k, r in self.model_round.items()},
            "sigma_user": self.sigma_user,
            "sigma_record": self.sigma_record,
            "hellos": {a: h.model_dump(mode="json") for a, h in self.hellos.items()},
            "sampler": self.sampler,
            "accountant": self.accountant,
            "participations": self.participations,
            "records": [{**rec, "tally": asdict(rec["tally"])} for rec in self.records],
            "metrics": [[a, r, m.model_dump(mode="json")] for (a, r), m in self.metrics.items()],
            "agent_rounds": self.agent_rounds,
            "straggling": self.straggling,
            "refused": self.refused,
            "declined": self.declined,
            "admitted": self.admitted,
            "active": sorted(self.active),
            "bootstrap_seconds": self.bootstrap_seconds,
            "in_flight": self.in_flight,
        }

    @classmethod
    def from_json(cls, state: dict[str, Any], size: int) -> "RunState":
        """The state :meth:`to_json` wrote, for a model of ``size`` parameters (the fixed masks)."""
        fixed = {}
        for k, idx in state["fixed_masks"].items():
            m = np.zeros(size, dtype=bool)
            m[idx] = True
            fixed[int(k)] = m
        return cls(
            run_id=state["run_id"],
            config=state["config"],
            completed=int(state["completed"]),
            plan=FleetPlan(state["cluster_of"], state["budget_of"], fixed, state.get("budget_notes", {}),
                           {int(k): np.asarray(v, dtype=np.float64) for k, v in state.get("rankings", {}).items()}),
            hellos={a: Hello(**h) for a, h in state["hellos"].items()},
            sampler=state["sampler"],
            accountant=[tuple(h) for h in state["accountant"]],
            model_round={int(k): r for k, r in state["model_round"].items()},
            sigma_user=state["sigma_user"],
            sigma_record=state["sigma_record"],
            uplink_delays=state.get("uplink_delays", {}),
            participations=dict(state.get("participations", {})),
            records=[{**rec, "tally": RoundTally(**rec["tally"])} for rec in state["records"]],
            metrics={(a, int(r)): Metrics(**m) for a, r, m in state["metrics"]},
            agent_rounds={a: {int(r): v for r, v in rounds.items()} for a, rounds in state["agent_rounds"].items()},
            straggling=state["straggling"],
            refused=state["refused"],
            declined=state.get("declined", {}),
            admitted=state.get("admitted", {}),
            active=set(state.get("active", [])),
            bootstrap_seconds=state["bootstrap_seconds"],
            in_flight=state.get("in_flight"),
        )


class Checkpoint:
    """The checkpoint file ``path`` (None: nothing is kept, e.g. no ``--state-dir``)."""

    def __init__(self, path: Path | None, log: logging.Logger | None = None) -> None:
        self.path = path
        self.log = log or logging.getLogger("senseshield.coordinator")

    @classmethod
    def of_fleet(cls, state_dir: Path | None, fleet: str, log: logging.Logger | None = None) -> "Checkpoint":
        return cls(None if state_dir is None else state_dir / f"coordinator-{fleet}.json", log)

    def save(self, state: RunState) -> None:
        """Replace the checkpoint with ``state`` atomically (StorageError if it cannot be written)."""
        if self.path is not None:
            write_atomic(self.path, json.dumps(state.to_json()))

    def load(self, run_id: str, config: dict[str, Any], size: int) -> RunState | None:
        """The checkpoint of job ``run_id`` with this ``config``; None if there is none, or it
        is another job's, or another configuration's (then a warning: the job starts anew).
        ConfigError, one sentence, if the file cannot be read as a checkpoint."""
        if self.path is None or not self.path.exists():
            return None
        try:
            raw = json.loads(self.path.read_text())
            if raw["run_id"] != run_id:
                return None  # the checkpoint of another job
            if raw["config"] != config:
                self.log.warning("state in %s is for another configuration of job %s; starting it anew", self.path, run_id)
                return None
            return RunState.from_json(raw, size)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            what = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc).split("\n")[0]
            raise ConfigError(
                f"The coordinator's checkpoint {str(self.path)!r} cannot be read ({what}); move it away to start "
                f"job {run_id} anew."
            ) from None

    def clear(self) -> None:
        if self.path is not None and self.path.exists():
            self.path.unlink()
