"""The key server's state: one object (:class:`KeyServerState`), saved and loaded here alone.

Two files in the key directory hold what must survive a restart, each replaced atomically
(:func:`senseshield.runtime.files.write_atomic`, 0600; a file that cannot be written is a
:class:`~senseshield.errors.StorageError`, one sentence, and the service stops):

* ``ledger-<fleet>.json``, across jobs and never reset: ``"key|agent|starting model"`` ->
  ``"run/round/cluster"`` of the one aggregate that contribution was decrypted in (its
  released use, else its first), and ``"job|<run id>"`` -> when the job was first served
  (a job, a nonce, is served as one run);
* ``models-<fleet>.npz``, the run it serves: each cluster's current model (``c<k>``) and, in
  its ``meta`` JSON, the run id, the clusters' rounds, every verdict given, and per round the
  pinned plan, the challenge seed and sealed challenge, the agents' box keys and which
  contributions were spent in which cluster.

:meth:`KeyServerState.save` writes the ledger (when it changed) before the checkpoint, and
the service publishes a verdict only after both: a restart never finds a verdict without
its model, nor a decrypted contribution missing from the ledger. An unreadable file is one
sentence (:class:`~senseshield.errors.ConfigError`) naming it; the ledger must then be
restored from a backup.

Besides what is saved, the object holds the run's context (the job, its initial model and
key, given again by the coordinator's ``fleet/config`` at every start) and what is in flight
(aggregates being decrypted, the contributions they reserve, attempts refused at the
fingerprint check), which a restart loses without loss: nothing of it was decrypted or
answered. Each field says which of the three it is (``metadata``); what a request is checked
against (:func:`keyserver.verify.decide`) is read from here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from senseshield.errors import ConfigError
from senseshield.he.base import model_digest
from senseshield.runtime.files import View, json_pieces, write_pieces, write_with_atomic
from senseshield.runtime.protocol.messages import AggregateResult, Challenge

if TYPE_CHECKING:
    from senseshield.he import PublicKey, SecretKey
    from senseshield.job import Job

JOB_ENTRY = "job|"  # ledger entries of the jobs (nonces) served: "job|<run id>" -> when

PLACE = {"kind": "place"}  # where the state lives (the key directory, the fleet)
RUN = {"kind": "run"}  # the run's context: given again at every start (start_run), never saved
FLIGHT = {"kind": "flight"}  # in flight: lost with the process, nothing of it decrypted or answered


class Ledger(dict):
    """The ledger's entries (a dict of str), which knows whether it changed since it was last
    written (``changed``), so an unchanged ledger is not written again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(*args, **kwargs)
        self.changed = False

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self.changed = True

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.changed = True

    def setdefault(self, key: str, default: str) -> str:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def pop(self, *args: Any) -> Any:  # noqa: ANN401
        self.changed = True
        return super().pop(*args)

    def popitem(self) -> tuple[str, str]:
        self.changed = True
        return super().popitem()

    def clear(self) -> None:
        self.changed = True
        super().clear()

    def pieces(self) -> Iterator[str]:
        """The ledger as ``json.dumps(ledger, sort_keys=True)`` writes it, in pieces."""
        return json_pieces(View(self, ordered=True), depth=1)


@dataclass(eq=False)
class KeyServerState:
    """The key server's state (see the module docstring). Fields without ``metadata`` are
    saved; ``PLACE``, ``RUN`` and ``FLIGHT`` fields are not."""

    key_dir: Path = field(metadata=PLACE)
    fleet: str = field(metadata=PLACE)
    # -- saved: ledger-<fleet>.json (across jobs) ----------------------------------------
    ledger: dict[str, str] = field(default_factory=dict)
    # -- saved: models-<fleet>.npz (the run it serves) -----------------------------------
    run_id: str | None = None  # the job (nonce) served
    models: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # cluster -> (round, weights)
    results: dict[tuple[int, int], AggregateResult] = field(default_factory=dict)  # (round, cluster) -> verdict
    plans: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # round -> its pinned plan
    seeds: dict[int, bytes] = field(default_factory=dict)  # round -> its challenge seed
    challenges: dict[int, Challenge] = field(default_factory=dict)  # round -> its sealed challenge
    boxes: dict[int, dict[str, bytes]] = field(default_factory=dict)  # round -> agent -> X25519 box key
    spent: dict[int, dict[str, int]] = field(default_factory=dict)  # round -> agent -> cluster decrypted in
    # a buffered job: cluster -> round -> model_digest of the model it released that round
    digests: dict[int, dict[int, str]] = field(default_factory=dict)
    # -- the run's context ---------------------------------------------------------------
    job: Job | None = field(default=None, metadata=RUN)
    initial: np.ndarray | None = field(default=None, metadata=RUN)
    public: PublicKey | None = field(default=None, metadata=RUN)  # the job's key (None: nothing encrypted)
    secret: SecretKey | None = field(default=None, metadata=RUN)
    # -- in flight -----------------------------------------------------------------------
    pending: dict[tuple[int, int], Any] = field(default_factory=dict, metadata=FLIGHT)  # being decrypted: its Future
    reserved: dict[int, dict[str, int]] = field(default_factory=dict, metadata=FLIGHT)  # contributions of pending ones
    entries: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict, metadata=FLIGHT)  # their ledger entries
    # attempts refused at the fingerprint check (nothing decrypted, nothing spent): per
    # (round, cluster) the request digests and each attempt's {contributor: fingerprint}
    attempts: dict[tuple[int, int], set[str]] = field(default_factory=dict, metadata=FLIGHT)
    failed: dict[tuple[int, int], list[dict[str, str]]] = field(default_factory=dict, metadata=FLIGHT)
    # the receipt batches of requests still to come: (round, cluster, attempt) -> keyserver.verify.Staged
    staged: dict[tuple[int, int, str], Any] = field(default_factory=dict, metadata=FLIGHT)

    def __post_init__(self) -> None:
        self.key_dir = Path(self.key_dir)
        self._track_ledger()

    def _track_ledger(self) -> None:
        """The ledger as a :class:`Ledger`; one given as a plain dict (here or set whole later)
        is not known to be on disk: the next save writes it."""
        if not isinstance(self.ledger, Ledger):
            self.ledger = Ledger(self.ledger)
            self.ledger.changed = True

    # -- files ----------------------------------------------------------------------------
    @property
    def ledger_path(self) -> Path:
        return self.key_dir / f"ledger-{self.fleet}.json"

    @property
    def checkpoint_path(self) -> Path:
        return self.key_dir / f"models-{self.fleet}.npz"

    @classmethod
    def open(cls, key_dir: Path, fleet: str) -> KeyServerState:
        """The state of a key server starting in ``key_dir``: its ledger, no run yet."""
        state = cls(Path(key_dir), fleet)
        state.ledger = Ledger(state._read_ledger())  # as on disk
        return state

    def save(self) -> None:
        """The ledger (if it changed) then the run's checkpoint, each atomically, before
        anything that relies on them is answered. Both are written piece by piece: a fleet's
        worth of entries, box keys and sealed challenges is never one string in memory."""
        self._track_ledger()
        if self.ledger.changed:
            write_with_atomic(self.ledger_path, lambda fh: write_pieces(self.ledger.pieces(), fh))
            self.ledger.changed = False
        write_with_atomic(self.checkpoint_path, self._write_checkpoint)

    def _write_checkpoint(self, fh: BinaryIO) -> None:
        """The checkpoint, an uncompressed ``.npz`` as ``numpy.savez`` writes it: its ``meta``
        JSON (spooled to an unnamed temporary file in the key directory first, for its length)
        then each cluster's model."""
        # (each part with the depth at which its per-agent maps and lists are reached)
        meta = {"run_id": (self.run_id, 0), "rounds": ({str(k): r for k, (r, _) in self.models.items()}, 0),
                "results": ([[r, k, v.model_dump(mode="json")] for (r, k), v in self.results.items()], 0),
                "plans": ({str(r): {str(k): v for k, v in p.items()} for r, p in self.plans.items()}, 3),
                "seeds": ({str(r): seed.hex() for r, seed in self.seeds.items()}, 0),
                "spent": ({str(r): v for r, v in self.spent.items()}, 2),
                "challenges": ({str(r): {**c.model_dump(mode="json", exclude={"sealed"}), "sealed": c.sealed}
                                for r, c in self.challenges.items()}, 3),
                "boxes": ({str(r): View(v, value=bytes.hex) for r, v in self.boxes.items()}, 2),
                "digests": ({str(k): {str(r): d for r, d in v.items()} for k, v in self.digests.items()}, 0)}

        def pieces() -> Iterator[str]:
            yield "{"
            for i, (key, (value, depth)) in enumerate(meta.items()):
                yield f"{', ' if i else ''}{json.dumps(key)}: "
                yield from json_pieces(value, depth=depth)
            yield "}"

        # spooled in the key directory (the checkpoint holds the rounds' challenge seeds): a
        # private, unnamed file where the checkpoint itself goes
        with tempfile.TemporaryFile(dir=self.key_dir) as spool:
            size = write_pieces(pieces(), spool)
            spool.seek(0)
            with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                with zf.open("meta.npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array_header_1_0(
                        out, {"descr": "|u1", "fortran_order": False, "shape": (size,)})
                    shutil.copyfileobj(spool, out, 1 << 20)
                for k, (_, w) in self.models.items():
                    with zf.open(f"c{k}.npy", "w", force_zip64=True) as out:
                        np.lib.format.write_array(out, np.asanyarray(w), allow_pickle=False)

    def start_run(self, run_id: str, *, job: Job | None, initial: np.ndarray | None,
                  public: PublicKey | None = None, secret: SecretKey | None = None) -> bool:
        """Serve run ``run_id`` from now on: everything of the previous run is dropped (a late
        decryption of it included), the ledger stays. True if the checkpoint in the key
        directory is this run's, which is then resumed (its models, verdicts, plans, ...)."""
        saved = self._read_checkpoint()  # before anything changes: an unreadable one changes nothing
        resumed = saved is not None and saved[0]["run_id"] == run_id
        for f in fields(self):
            if f.name not in ("key_dir", "fleet", "ledger"):
                setattr(self, f.name, f.default if f.default_factory is MISSING else f.default_factory())
        self.run_id, self.job, self.initial, self.public, self.secret = run_id, job, initial, public, secret
        if resumed:
            meta, arrays = saved
            self.models = {int(k): (int(r), arrays[f"c{k}"]) for k, r in meta["rounds"].items()}
            self.results = {(int(r), int(k)): AggregateResult(**v) for r, k, v in meta.get("results", [])}
            self.plans = {int(r): {int(k): v for k, v in p.items()} for r, p in meta.get("plans", {}).items()}
            self.seeds = {int(r): bytes.fromhex(h) for r, h in meta.get("seeds", {}).items()}
            self.spent = {int(r): v for r, v in meta.get("spent", {}).items()}
            self.challenges = {int(r): Challenge(**c) for r, c in meta.get("challenges", {}).items()}
            self.boxes = {int(r): {a: bytes.fromhex(b) for a, b in v.items()} for r, v in meta.get("boxes", {}).items()}
            self.digests = {int(k): {int(r): d for r, d in v.items()} for k, v in meta.get("digests", {}).items()}
        return resumed

    def checkpoint_run(self) -> str | None:
        """The run id of the checkpoint in the key directory (None: none)."""
        saved = self._read_checkpoint()
        return None if saved is None else saved[0].get("run_id")

    def _read_ledger(self) -> dict[str, str]:
        path = self.ledger_path
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"The key server's ledger {path} cannot be read ({exc}); it records which "
                              "contributions were decrypted and must not be lost: restore it from a backup.") from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ConfigError(f"The key server's ledger {path} is not a JSON object of strings; restore it from a backup.")
        return data

    def _read_checkpoint(self) -> tuple[dict, dict[str, np.ndarray]] | None:
        """``(meta, arrays)`` of the checkpoint file, or None if there is none."""
        path = self.checkpoint_path
        if not path.exists():
            return None
        try:
            with np.load(path) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                arrays = {name: data[name].copy() for name in data.files if name != "meta"}
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"The key server's checkpoint {path} cannot be read ({exc}); move it away to "
                              "start its job anew (the ledger still bars what was decrypted).") from None
        return meta, arrays

    # -- the ledger -----------------------------------------------------------------------
    def served(self, run_id: str) -> str | None:
        """When job ``run_id`` was first served, if it was and is not the run the checkpoint
        resumes (a job runs once), else None."""
        when = self.ledger.get(JOB_ENTRY + run_id)
        if when is None or self.checkpoint_run() == run_id:
            return None
        return when

    def serve_job(self, when: str) -> None:
        """The run's job is served from now on (recorded once, at its first round)."""
        self.ledger.setdefault(JOB_ENTRY + self.run_id, when)

    def spend(self, r: int, k: int, contributors: list[str], *, released: bool) -> None:
        """Round ``r``'s contributions of cluster ``k`` have been through a decryption: spent
        for the round and (encrypted ones) in the ledger. An entry names the use that
        released its sum (``released``: accepted), else its first use (a refusal at
        unmasking, which a later round of this job may follow from the same model)."""
        self.spent.setdefault(r, {}).update({a: k for a in contributors})
        where = f"{self.run_id}/{r}/{k}"
        for entry in self.entries.pop((r, k), {}).values():
            known = self.ledger.get(entry)
            if known is None or (released and known.rsplit("/", 2)[0] == self.run_id):
                self.ledger[entry] = where

    # -- what a request is checked against ------------------------------------------------
    def model(self, k: int) -> tuple[int, np.ndarray]:
        """Cluster ``k``'s current ``(round, weights)`` (round 0: the initial model)."""
        return self.models.get(k, (0, self.initial))

    def start_digest(self, k: int) -> str:
        """model_digest of cluster ``k``'s current model: what every contribution trained from."""
        return model_digest(self.model(k)[1])

    def release(self, r: int, k: int, weights: np.ndarray) -> None:
        """Cluster ``k``'s model of round ``r`` (a buffered job also keeps its digest: a
        carried device trained from it)."""
        self.models[k] = (r, weights)
        if self.job is not None and self.job.options.buffer is not None:
            self.digests.setdefault(k, {})[r] = model_digest(weights)

    def start_digests(self, k: int) -> set[str]:
        """The models a contribution to cluster ``k`` may have trained from: its current one;
        in a buffered job also each model it had before in this run (the initial one included),
        which a device carried from an earlier round started from."""
        current = {self.start_digest(k)}
        if self.job is None or self.job.options.buffer is None:
            return current
        return current | {model_digest(self.initial)} | set(self.digests.get(k, {}).values())

    def forget_before(self, r: int) -> None:
        """Drop the pinned plans, challenge seeds, sealed challenges, box keys and spent
        contributions of the rounds before ``r``: what the key server keeps of a run then
        does not grow with its rounds. Those rounds are over: a request for one is stale (its
        cluster has a later model) or refused (no plan), a plan for one comes after a later
        round's, and what was decrypted stays barred by the ledger."""
        for kept in (self.plans, self.seeds, self.challenges, self.boxes, self.spent):
            for old in [rr for rr in kept if rr < r]:
                del kept[old]
        for old in [key for key in self.staged if key[0] < r]:
            del self.staged[old]

    def taken(self, r: int) -> dict[str, int]:
        """Round ``r``'s contributions spent or reserved: agent -> cluster."""
        return {**self.spent.get(r, {}), **self.reserved.get(r, {})}

    def released(self) -> frozenset[tuple[int, int]]:
        """(round, cluster) of this run whose sum was released (accepted)."""
        return frozenset(rk for rk, v in self.results.items() if v.accepted)

    @property
    def job_min_encryptors(self) -> int:
        return self.job.options.min_encryptors if self.job is not None else 1
