"""The key server: the only holder of the secret key; decrypts aggregates, never updates.

It waits for the coordinator's ``fleet/config``, loads or generates the key pair of the
run's HE scheme in ``--key-dir`` (secret file mode 0600 in a 0700 directory), publishes
only the public key (retained ``keys/public``), and for every ``keyserver/requests``
aggregate with at least ``min_contributors`` distinct contributors it decrypts the mean
update, applies it to the cluster's model (W <- W + eta_g * mean) and publishes the new
cluster model (retained ``clusters/<k>/model``) and a result on ``keyserver/results``.
Fewer contributors: refused, logged, and the reason goes back in the result.

The global models live here because whoever decrypts the mean sees the new model anyway;
they are checkpointed in the key directory together with every verdict given, so a restart
resumes the run and a re-sent request for a round already applied gets the same verdict
(and the model again), never a second application. ``keyserver/status`` (retained, with an
offline last will) tells the coordinator when the key server is back, so it re-sends what
is pending. The key directory and its key files are checked at start: a directory it
cannot write or a key file group/other can read stops it there.

Decryption is off the service's thread: a verified aggregate goes to a pool of ``workers``
threads (each spreading its blocks over ``threads``; gmpy2 releases the GIL), so the
clusters of a round decrypt concurrently while the service keeps verifying, answering and
publishing; the result comes back to the service's thread, which applies it, checkpoints
and answers. The default key of packed Paillier is the subgroup key (``--key-structure``),
whose decryption is ~4x faster than the standard key's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from senseshield import defaults
from senseshield.engine.aggregation import decrypt_aggregate
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, PublicKey, SecretKey
from senseshield.he.base import job_key, model_digest, round_context
from senseshield.he.fingerprint import SEED_BYTES
from senseshield.he.packed import STRUCTURES
from senseshield.development import development_mode
from senseshield.runtime.identity import b64, unb64
from senseshield.runtime.jobsig import job_refusal
from senseshield.runtime.protocol.messages import (
    AggregateRequest,
    AggregateResult,
    Challenge,
    RoundOpen,
    ClusterModel,
    FleetConfig,
    PublicKeyAnnouncement,
    aggregate_from_message,
)
from senseshield.rounds import apply_mean
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.files import npz_bytes, write_atomic
from senseshield.runtime.keyfiles import check_private, secure_dir, write_secret
from senseshield.runtime.service import Inbound, Service
from keyserver.verify import FINGERPRINT_MISMATCH, Checks, at_fault, verify  # noqa: F401 (re-exported)
from keyserver.metrics import METRICS_PORT_ENV, KeyServerMetrics
from senseshield.runtime.metrics import metrics_port as live_port
from senseshield.job import Job, announced_run

log = logging.getLogger("senseshield.keyserver")

NO_KEY_ID = "none"  # announced when the run's strategy encrypts nothing
JOB_ENTRY = "job|"  # ledger entries of the jobs (nonces) served: "job|<run id>" -> when


def load_or_generate(key_dir: Path, scheme: str, key_bits: int, structure: str = "subgroup") -> SecretKey:
    """The key pair of ``scheme`` stored in ``key_dir``, generated on first use. ``structure``
    (schemes that have it: packed Paillier) picks the subgroup or the standard key; each has
    its own file, so switching never reuses the other one."""
    factory = SCHEMES.get(scheme)
    params = factory.info().params
    options = {"key_bits": key_bits} if "key_bits" in params else {}
    stem = f"{scheme}-{key_bits}" if options else scheme
    if "structure" in params:
        options["structure"] = structure
        stem += "" if structure == params["structure"] else f"-{structure}"
    path = key_dir / f"{stem}.key"
    if path.is_symlink() or path.exists():
        check_private(path)  # a regular 0600 file of this user, not a link
        secret = factory.secret_key_from_bytes(path.read_bytes())
        log.info("loaded %s key %s%s from %s", scheme, secret.public_key.key_id, _structure(secret), path)
        return secret
    t = time.perf_counter()
    secret = factory.generate(**options)
    write_secret(path, secret.to_bytes(include_secret=True))
    write_atomic(key_dir / (path.stem + ".pub"), secret.public_key.to_bytes(), mode=0o644)
    log.info("generated %s key %s%s in %.1f s; secret in %s", scheme, secret.public_key.key_id, _structure(secret),
             time.perf_counter() - t, path)
    return secret


def _structure(secret: SecretKey) -> str:
    structure = getattr(secret, "structure", None)
    return f" ({structure} key)" if structure else ""


class KeyServer(Service):
    """``keyserver serve``: see the module docstring."""

    def __init__(
        self,
        broker: str,
        *,
        fleet: str,
        key_dir: Path,
        min_contributors: int = 2,
        min_fraction: float = 0.0,
        min_encryptors: int = 2,
        allow_unverifiable: bool = False,
        allow_unsigned_jobs: bool = False,
        protocol: str = "5",
        threads: int | None = None,
        workers: int | None = None,
        key_structure: str = "subgroup",
        kill_after_apply: int | None = None,
        identity: Identity | None = None,
        trust: Trust | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        """``metrics_port``: serve Prometheus metrics there (None: off, unless
        ``SENSESHIELD_KEYSERVER_METRICS_PORT`` gives one; keyserver.metrics), on ``metrics_host``."""
        if threads is not None and threads < 1:
            raise ConfigError(f"--threads {threads} is not allowed; use 1 or more.")
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers {workers} is not allowed; use 1 or more.")
        if key_structure not in STRUCTURES:
            raise ConfigError(f"--key-structure {key_structure!r} is not allowed; use one of: {', '.join(STRUCTURES)}.")
        if min_contributors < 1:
            raise ConfigError(f"--min-contributors {min_contributors} is not allowed; it must be at least 1.")
        if min_encryptors < 1:
            raise ConfigError(f"--min-encryptors {min_encryptors} is not allowed; it must be at least 1.")
        if not 0.0 <= min_fraction <= 1.0:
            raise ConfigError(f"--min-fraction {min_fraction} is not allowed; give a fraction of the cluster in 0..1.")
        super().__init__(broker, fleet=fleet, client_id="keyserver", logger=log, protocol=protocol,
                         status_topic="keyserver/status", identity=identity, trust=trust, role="keyserver")
        self.key_dir = secure_dir(Path(key_dir))
        self.kill_after_apply = kill_after_apply  # fault drill: SIGKILL itself after applying this round
        self.min_contributors = min_contributors
        self.min_fraction = min_fraction
        self.min_encryptors = min_encryptors
        # CKKS sums cannot be checked against fingerprints: decrypted only if the operator
        # says the coordinator is trusted to sum honestly (docs/security.md#ckks)
        self.allow_unverifiable = allow_unverifiable
        # a run must be a job an operator the trust file pins signed (senseshield.runtime.jobsig),
        # unless told otherwise; without a trust file there is no pinned operator to check against
        self.require_signed_jobs = not (allow_unsigned_jobs or development_mode() or self.trust.tofu)
        self.threads = threads if threads is not None else defaults.shared_threads()
        self.key_structure = key_structure
        # aggregates decrypt on these workers while the service's thread goes on verifying
        # and answering (gmpy2 releases the GIL); each aggregate's blocks use ``threads``
        self.workers = workers if workers is not None else max(2, defaults.shared_threads())
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="decrypt")
        self.pending: dict[tuple[int, int], Future] = {}  # (round, cluster) being decrypted
        self.reserved: dict[int, dict[str, int]] = {}  # contributions of pending aggregates
        self.run_id: str | None = None
        self.config: Job | None = None
        self.secret: SecretKey | None = None
        self.public: PublicKey | None = None
        self.initial: np.ndarray | None = None
        self.models: dict[int, tuple[int, np.ndarray]] = {}  # cluster -> (round, weights)
        self.results: dict[tuple[int, int], AggregateResult] = {}  # (round, cluster) -> result
        # the contribution bookkeeping (checkpointed): each round's pinned plan, its challenge
        # seed, and which agent's contribution went into which decrypted aggregate
        self.plans: dict[int, dict[int, list[str]]] = {}
        self.seeds: dict[int, bytes] = {}
        self.spent: dict[int, dict[str, int]] = {}
        self.challenges: dict[int, Challenge] = {}
        self.boxes: dict[int, dict[str, bytes]] = {}  # round -> agent -> X25519 box key (masked pads)
        # across jobs (its own file, never reset): "key|agent|starting model" -> "run/round/cluster"
        # of the one aggregate that contribution was decrypted in
        self.ledger: dict[str, str] = self._load_ledger()
        self._ledger_keys: dict[tuple[int, int], dict[str, str]] = {}
        # attempts refused at the fingerprint check (nothing decrypted, nothing spent): per
        # (round, cluster) the request digests and each attempt's {contributor: fingerprint}
        self.attempts: dict[tuple[int, int], set[str]] = {}
        self.failed: dict[tuple[int, int], list[dict[str, str]]] = {}
        self.on(FleetConfig, self._on_config)
        self.on(RoundOpen, self._on_round_open)
        self.on(AggregateRequest, self._on_request)
        self.watch("coordinator")
        metrics_port = live_port(metrics_port, METRICS_PORT_ENV)
        self.metrics = KeyServerMetrics(metrics_port, metrics_host) if metrics_port is not None else None
        if self.metrics is not None:
            self.metrics.watch(self.link)
            self.metrics.ledger(len(self.ledger))

    # -- handlers -------------------------------------------------------------------------
    def _on_config(self, item: Inbound) -> None:
        msg: FleetConfig = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"fleet/config from {item.sender!r}; only the coordinator may set it.")
        config, strategy, scheme = announced_run(msg.config)  # checked before anything changes
        # every config is checked, whatever its run id: the run id is the signed job's nonce
        # and a config re-sent under the current run must still be that very job
        if self._refuse_unsigned(msg):
            return
        if msg.run_id == self.run_id:
            return
        if self._served_elsewhere(msg.run_id):
            return
        self.run_id, self.config, self.initial = msg.run_id, config, msg.initial.copy()
        self.models, self.results = {}, {}
        self.plans, self.seeds, self.spent, self.challenges, self.boxes = {}, {}, {}, {}, {}
        self.pending, self.reserved, self._ledger_keys = {}, {}, {}  # a late result of the previous run is dropped
        self.attempts, self.failed = {}, {}
        if scheme is None:
            self.secret = self.public = None
            announcement = PublicKeyAnnouncement(scheme="", key_id=NO_KEY_ID, key=b"", run_id=msg.run_id)
        else:
            self.secret = load_or_generate(self.key_dir, scheme, config.key_bits, self.key_structure)
            # per-client masks (sensecrypt) on the masked scheme: its key aggregates ragged masks
            self.public = job_key(self.secret.public_key, per_client_masks=strategy.per_client_masks)
            announcement = PublicKeyAnnouncement(scheme=scheme, key_id=self.public.key_id, key=self.public.to_bytes(),
                                                 run_id=msg.run_id)
        self._restore()
        if self.metrics is not None:
            self.metrics.job(msg.run_id, config.strategy, scheme)
        self.send("keys/public", announcement, retain=True)
        self.log.info("run %s: %s, scheme %s, key %s", self.run_id, config.strategy, scheme or "none", announcement.key_id)
        if self.public is not None and not self.public.verifiable and not self.allow_unverifiable:
            self.log.warning("run %s: %s aggregates cannot be verified; they will be refused (--allow-unverifiable "
                             "trusts the coordinator to sum honestly)", self.run_id, scheme)

    def _refuse_unsigned(self, msg: FleetConfig) -> bool:
        """True (logged, and announced for the run so the coordinator fails the job at once)
        if the run is not the job an operator signed (:func:`job_refusal`)."""
        reason = job_refusal(msg.run_id, msg.config, msg.submission, self.trust, fleet=self.fleet,
                             required=self.require_signed_jobs, initial=msg.initial)
        if reason is None:
            return False
        if msg.run_id == self.run_id:  # the run it serves stays announced: a forged config changes nothing
            self.log.error("%s (the run it serves goes on unchanged)", reason)
            return True
        self._refuse_run(msg.run_id, reason)
        return True

    def _refuse_run(self, run_id: str, reason: str) -> None:
        """Log ``reason`` and announce it for ``run_id`` (the coordinator fails that job at once)."""
        self.log.error("%s", reason)
        if self.metrics is not None:
            self.metrics.job_refused()
        self.send("keys/public", PublicKeyAnnouncement(scheme="", key_id=NO_KEY_ID, key=b"", run_id=run_id,
                                                       refused=reason), retain=True)

    def _served_elsewhere(self, run_id: str) -> bool:
        """True (refused, announced) if job ``run_id`` was already served and is not the run
        this key server's checkpoint resumes: each job (nonce) is served as one run, so no
        round of it is unmasked twice, whatever the coordinator re-sends."""
        if JOB_ENTRY + run_id not in self.ledger or self._checkpoint_run() == run_id:
            return False
        self._refuse_run(run_id, f"Job {run_id} is refused: this key server already served it "
                                 f"({self.ledger[JOB_ENTRY + run_id]}) and a job runs once; the operator signs a "
                                 "new job (a new nonce) to run it again.")
        return True

    def _checkpoint_run(self) -> str | None:
        """The run id of the checkpoint in the key directory (None: none)."""
        path = self._state_path()
        if not path.exists():
            return None
        with np.load(path) as data:
            return json.loads(bytes(data["meta"]).decode()).get("run_id")

    def _on_request(self, item: Inbound) -> None:
        msg: AggregateRequest = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"Aggregate from {item.sender!r}; only the coordinator may send aggregates.")
        if self.config is None or msg.run_id != self.run_id:
            raise ProtocolError(f"Aggregate for run {msg.run_id!r}; the current run is {self.run_id!r}.")
        r, k = item.round, msg.cluster
        attempt = hashlib.sha256(msg.receipts + b"|" + msg.ciphertext).hexdigest()
        if (r, k) in self.results and not self._another_attempt(r, k, attempt):
            # a re-sent request (reconnect, restart): the same verdict
            self.log.info("round %d cluster %d: re-sent request; answering with the recorded verdict", r, k)
            self._replay(r, k)
            return
        if (r, k) in self.pending:
            self.log.info("round %d cluster %d: re-sent request while it is being decrypted; the verdict follows", r, k)
            return
        busy = sorted(rr for rr, kk in self.pending if kk == k)
        if busy:
            raise ProtocolError(f"Aggregate for round {r} of cluster {k} while its round {busy[0]} is being "
                                "decrypted; re-send it after that verdict.")
        last = self.models.get(k, (0, None))[0]
        if r <= last:
            raise ProtocolError(f"Aggregate for round {r} of cluster {k} is stale; the cluster is at round {last}.")
        # sizes, masks, weights and the ciphertext's blocks: a malformed request is rejected
        # (logged, no verdict) before anything is verified or decrypted
        aggregate = aggregate_from_message(msg, self.public, round=r, size=self.initial.size)
        t = time.perf_counter()
        prints: dict[str, str] = {}
        plans: dict[str, str] = {}  # contributor -> the plan digest its receipt signs (its pads' context)
        try:
            refusal, weights = self._verify(r, k, msg, aggregate, prints, plans)
        except ProtocolError as exc:  # a malformed receipt or ciphertext: a verdict, not silence
            refusal, weights = str(exc), {}
        distinct = sorted(weights)
        t_verify = time.perf_counter() - t
        if refusal is not None:
            reason = f"refused: {refusal}"
            retry = refusal.startswith(FINGERPRINT_MISMATCH)
            if retry:  # nothing decrypted or spent: the coordinator may look for the one at fault
                self.attempts.setdefault((r, k), set()).add(attempt)
                self.failed.setdefault((r, k), []).append(prints)
            self.log.warning("round %d cluster %d %s", r, k, reason)
            self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=False, reason=reason,
                                               timings={"verify": t_verify}, retry=retry))
            return
        excluded = at_fault(self.failed.get((r, k), []), prints, r)
        for a, why in excluded.items():
            self.log.warning("round %d cluster %d: %s's update refused: %s", r, k, a, why)
        # the contributions are taken now (a second aggregate that reuses one is refused even
        # while this one decrypts) and spent when the verdict is recorded
        self.reserved.setdefault(r, {}).update({a: k for a in distinct})
        run_id, secret, threads = self.run_id, self.secret, self.threads
        if aggregate.ciphertext is not None and self.public.needs_contributors:  # masked: remove exactly their pads
            masks = msg.contributor_masks() if self.public.ragged_masks else {}  # checked against the receipts
            secret.bind_contributions(aggregate.ciphertext, [(self.boxes[r][a], weights[a]) for a in distinct],
                                      [round_context(self.fleet, self.run_id, r, k, plans[a]) for a in distinct],
                                      masks=[masks[a] for a in distinct] if masks else None)

        def decrypt() -> tuple[np.ndarray, float]:  # a worker thread: pure computation
            t = time.perf_counter()
            return decrypt_aggregate(aggregate, secret, threads=threads), time.perf_counter() - t

        future = self._pool.submit(decrypt)
        self.pending[(r, k)] = future
        future.add_done_callback(lambda f: self.call_soon(
            f"decryption of round {r} cluster {k}", lambda: self._decrypted(run_id, r, k, f, distinct, t_verify, excluded)))

    def _another_attempt(self, r: int, k: int, attempt: str) -> bool:
        """Whether a request for round ``r`` of cluster ``k``, which has a verdict, is a new
        attempt to evaluate: the verdict refused at the fingerprint check (nothing decrypted
        or spent) and this request is not one already refused; at most a cluster's members
        plus two attempts per round."""
        prior = self.results[(r, k)]
        tried = self.attempts.get((r, k), set())
        if not prior.retry or attempt in tried:
            return False
        limit = len(self.plans.get(r, {}).get(k, [])) + 2
        if len(tried) >= limit:
            self.log.warning("round %d cluster %d: %d attempts refused at the fingerprint check; no more "
                             "this round", r, k, len(tried))
            return False
        del self.results[(r, k)]
        return True

    def _decrypted(self, run_id: str, r: int, k: int, future: Future, distinct: list[str], t_verify: float,
                   excluded: dict[str, str] | None = None) -> None:
        """The service's thread, once round ``r``'s aggregate of cluster ``k`` is decrypted:
        apply the mean to the cluster's model, spend the contributions, record and answer."""
        if run_id != self.run_id or self.pending.pop((r, k), None) is not future:
            return  # the run changed meanwhile
        for a in distinct:
            self.reserved.get(r, {}).pop(a, None)
        try:
            mean, t_decrypt = future.result()
        except ProtocolError as exc:  # the scheme's own check (masked: a sum that is not the named one)
            # the contributions are spent all the same: a refusal after unmasking is an answer
            # about their sum, which a coordinator must not be able to ask for twice
            self._spend(r, k, distinct, released=False)
            self.log.warning("round %d cluster %d refused at decryption: %s", r, k, exc)
            self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=False,
                                               reason=f"refused: {exc}", timings={"verify": t_verify},
                                               excluded=excluded or {}))
            return
        except Exception as exc:  # noqa: BLE001 - a verdict, and the service goes on
            self.log.exception("round %d cluster %d: decryption failed", r, k)
            self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=False,
                                               reason=f"refused: decryption failed ({type(exc).__name__})",
                                               timings={"verify": t_verify}))
            return
        current = self.models.get(k, (0, self.initial))[1]
        new = apply_mean(current, mean, server_lr=self.config.options.server_lr)
        self.models[k] = (r, new)
        self._spend(r, k, distinct, released=True)
        self.log.info("round %d cluster %d: %d verified contributors (%.3f s), decrypted in %.3f s", r, k,
                      len(distinct), t_verify, t_decrypt)
        self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=True,
                                           timings={"decrypt": t_decrypt, "verify": t_verify},
                                           excluded=excluded or {}))

    def _spend(self, r: int, k: int, distinct: list[str], *, released: bool) -> None:
        """Round ``r``'s contributions of cluster ``k`` have been through a decryption: spent
        for the round, and (encrypted ones) in the ledger, written before the verdict. An entry
        names the use that released its sum (``released``: accepted), else its first use (a
        refusal at unmasking, which a later round of this job may follow from the same model)."""
        self.spent.setdefault(r, {}).update({a: k for a in distinct})
        entries = self._ledger_keys.pop((r, k), {})
        if entries:
            where = f"{self.run_id}/{r}/{k}"
            for entry in entries.values():
                known = self.ledger.get(entry)
                if known is None or (released and known.rsplit("/", 2)[0] == self.run_id):
                    self.ledger[entry] = where
            self._save_ledger()

    def _save_ledger(self) -> None:
        """The ledger on disk (0600, atomically) before any verdict or round that relies on it."""
        write_atomic(self._ledger_path(), json.dumps(self.ledger, sort_keys=True))
        if self.metrics is not None:
            self.metrics.ledger(len(self.ledger))

    def _ledger_path(self) -> Path:
        return self.key_dir / f"ledger-{self.fleet}.json"

    def _load_ledger(self) -> dict[str, str]:
        path = self._ledger_path()
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

    # -- trust: the round's plan, its challenge, the contributions ------------------------
    def _on_round_open(self, item: Inbound) -> None:
        msg: RoundOpen = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"Round plan from {item.sender!r}; only the coordinator opens rounds.")
        if self.config is None or msg.run_id != self.run_id:
            raise ProtocolError(f"Round plan for run {msg.run_id!r}; the current run is {self.run_id!r}.")
        r = item.round
        try:
            plan = {int(k): sorted(set(v)) for k, v in msg.clusters.items()}
        except ValueError:
            raise ProtocolError("A round plan's cluster ids must be integers.") from None
        members = [a for v in plan.values() for a in v]
        if r < 1 or not plan or len(members) != len(set(members)):
            raise ProtocolError(f"Round plan {r} is empty, for round < 1, or puts an agent in two clusters.")
        if r > self.config.rounds:  # a sum the operator did not sign for (a DP job: budget beyond its epsilon)
            raise ProtocolError(f"Round plan {r}: job {self.run_id} has {self.config.rounds} rounds (the operator "
                                "signed them); no round after the last is opened.")
        if r in self.plans:
            if self.plans[r] != plan:
                raise ProtocolError(f"Round {r} was already opened with another plan; a round's plan is pinned.")
            if r in self.challenges:  # a re-sent plan (reconnect): the same challenge again
                self.send("keyserver/challenges", self.challenges[r], round=r, retain=True)
            return
        if self.plans and r < max(self.plans):
            raise ProtocolError(f"Round plan {r} comes after round {max(self.plans)}; rounds only move forward.")
        if JOB_ENTRY + self.run_id not in self.ledger:  # the job is served from now on (before its checkpoint)
            self.ledger[JOB_ENTRY + self.run_id] = f"first round opened at {time.strftime('%Y-%m-%d %H:%M:%S')}"
            self._save_ledger()
        self.plans[r] = plan
        self.seeds[r] = os.urandom(SEED_BYTES)
        context = f"{self.fleet}/{self.run_id}/{r}".encode()
        sealed, boxes = {}, {}
        for agent in members:
            box = self.trust.box_key(agent) if not self.trust.tofu else None
            if box is None and self.trust.tofu and msg.box_keys.get(agent):
                box = unb64(msg.box_keys[agent], f"box key of {agent}")
            if box is None:
                self.log.warning("round %d: no box key for %s; it cannot sign a fingerprint this round", r, agent)
                continue
            boxes[agent] = box
            sealed[agent] = b64(self.identity.seal(self.seeds[r], box, context))
        self.boxes[r] = boxes
        self.challenges[r] = Challenge(run_id=self.run_id, box_key=b64(self.identity.box_key), sealed=sealed)
        self._checkpoint()
        self.send("keyserver/challenges", self.challenges[r], round=r, retain=True)
        if self.metrics is not None:
            self.metrics.round_opened(r)
        self.log.info("round %d opened: clusters %s; challenge sealed to %d agents", r,
                      {k: len(v) for k, v in plan.items()}, len(sealed))

    def _verify(self, r: int, k: int, msg: AggregateRequest, aggregate,  # noqa: ANN001
                prints: dict[str, str], plans: dict[str, str]) -> tuple[str | None, dict[str, int]]:
        """keyserver.verify.verify over this round's bookkeeping; the ledger entries of an
        aggregate that may be decrypted are kept until it is spent."""
        checks = Checks(
            trust=self.trust, run_id=self.run_id, plan=self.plans.get(r),
            taken={**self.spent.get(r, {}), **self.reserved.get(r, {})}, public=self.public, secret=self.secret,
            seed=self.seeds.get(r), boxes=self.boxes.get(r, {}), ledger=self.ledger,
            start_digest=model_digest(self.models.get(k, (0, self.initial))[1]),
            min_contributors=self.min_contributors, min_fraction=self.min_fraction,
            min_encryptors=self.min_encryptors,
            job_min_encryptors=self.config.options.min_encryptors if self.config is not None else 1,
            allow_unverifiable=self.allow_unverifiable, log=self.log,
            released=frozenset(rk for rk, v in self.results.items() if v.accepted))
        refusal, weights, entries = verify(checks, r, k, msg, aggregate, prints, plans)
        if refusal is None and entries:
            self._ledger_keys[(r, k)] = entries
        return refusal, weights

    def _answer(self, r: int, k: int, result: AggregateResult) -> None:
        """Record the verdict with the model it produced (one checkpoint: a restart never
        finds a model without its verdict), then publish both."""
        self.results[(r, k)] = result
        self._checkpoint()
        if self.metrics is not None:
            self.metrics.verdict(k, result.accepted, result.reason, result.timings)
        if self.kill_after_apply == r:
            import signal

            self.log.warning("fault drill: killing myself (SIGKILL) after applying round %d", r)
            os.kill(os.getpid(), signal.SIGKILL)
        self._replay(r, k)

    def _replay(self, r: int, k: int) -> None:
        """Publish the verdict on round ``r`` of cluster ``k`` and, if it was accepted and is
        still the cluster's latest, its model (retained)."""
        result = self.results[(r, k)]
        if result.accepted and self.models.get(k, (0, None))[0] == r:
            self._publish_model(k)
        self.send("keyserver/results", result, round=r)

    def _publish_model(self, k: int) -> None:
        r, w = self.models[k]
        model = ClusterModel(run_id=self.run_id, cluster=k, model=self.config.model, weights=w.astype(np.float32))
        self.send(f"clusters/{k}/model", model, round=r, retain=True)

    # -- checkpoint -----------------------------------------------------------------------
    def _state_path(self) -> Path:
        return self.key_dir / f"models-{self.fleet}.npz"

    def _checkpoint(self) -> None:
        arrays = {f"c{k}": w for k, (_, w) in self.models.items()}
        meta = {"run_id": self.run_id, "rounds": {str(k): r for k, (r, _) in self.models.items()},
                "results": [[r, k, v.model_dump(mode="json")] for (r, k), v in self.results.items()],
                "plans": {str(r): {str(k): v for k, v in p.items()} for r, p in self.plans.items()},
                "seeds": {str(r): seed.hex() for r, seed in self.seeds.items()},
                "spent": {str(r): v for r, v in self.spent.items()},
                "challenges": {str(r): c.model_dump(mode="json") for r, c in self.challenges.items()},
                "boxes": {str(r): {a: b.hex() for a, b in v.items()} for r, v in self.boxes.items()}}
        write_atomic(self._state_path(), npz_bytes(meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays))

    def _restore(self) -> None:
        path = self._state_path()
        if not path.exists():
            return
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta["run_id"] != self.run_id:
                return
            self.models = {int(k): (int(r), data[f"c{k}"].copy()) for k, r in meta["rounds"].items()}
            self.results = {(int(r), int(k)): AggregateResult(**v) for r, k, v in meta.get("results", [])}
            self.plans = {int(r): {int(k): v for k, v in p.items()} for r, p in meta.get("plans", {}).items()}
            self.seeds = {int(r): bytes.fromhex(h) for r, h in meta.get("seeds", {}).items()}
            self.spent = {int(r): v for r, v in meta.get("spent", {}).items()}
            self.challenges = {int(r): Challenge(**c) for r, c in meta.get("challenges", {}).items()}
            self.boxes = {int(r): {a: bytes.fromhex(b) for a, b in v.items()} for r, v in meta.get("boxes", {}).items()}
        for k in sorted(self.models):
            self._publish_model(k)
        self.log.info("resumed run %s: cluster rounds %s, %d verdicts", self.run_id,
                      {k: r for k, (r, _) in self.models.items()}, len(self.results))

    # -- main -----------------------------------------------------------------------------
    def run(self) -> None:
        self.start(["fleet/config", "keyserver/requests", "keyserver/rounds"])
        try:
            while not self.stopping.is_set():
                self.pump(0.5)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.stop()
            if self.metrics is not None:
                self.metrics.close()
