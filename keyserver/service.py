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
(and the model again), never a second application. That state (the ledger across jobs, the
run, its models, verdicts and rounds) is one object saved in one place,
:class:`keyserver.state.KeyServerState`; whether a request is accepted is one pure function
over it, :func:`keyserver.verify.decide`; this service decodes, asks, acts and publishes. ``keyserver/status`` (retained, with an
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

import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from senseshield import defaults
from senseshield.engine.aggregation import decrypt_aggregate
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, SecretKey
from senseshield.he.base import job_key
from senseshield.he.fingerprint import SEED_BYTES
from senseshield.he.packed import STRUCTURES
from senseshield.development import development_mode
from senseshield.processes import release_memory
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
    ReceiptBatch,
)
from senseshield.rounds import apply_mean
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.files import write_atomic
from senseshield.runtime.keyfiles import check_private, secure_dir, write_secret
from senseshield.runtime.service import Inbound, Service
from keyserver.state import KeyServerState
from keyserver.verify import Decrypting, Refuse, Reject, Replay, Rules, decide, stage_batch
from keyserver.metrics import METRICS_PORT_ENV, KeyServerMetrics
from senseshield.runtime.metrics import metrics_port as live_port
from senseshield.job import announced_run

log = logging.getLogger("senseshield.keyserver")

NO_KEY_ID = "none"  # announced when the run's strategy encrypts nothing


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
        # CKKS sums cannot be checked against fingerprints: decrypted only if the operator
        # says the coordinator is trusted to sum honestly (docs/security.md#ckks)
        self.rules = Rules(trust=self.trust, min_contributors=min_contributors, min_fraction=min_fraction,
                           min_encryptors=min_encryptors, allow_unverifiable=allow_unverifiable)
        # a run must be a job an operator the trust file pins signed (senseshield.runtime.jobsig),
        # unless told otherwise; without a trust file there is no pinned operator to check against
        self.require_signed_jobs = not (allow_unsigned_jobs or development_mode() or self.trust.tofu)
        self.threads = threads if threads is not None else defaults.shared_threads()
        self.key_structure = key_structure
        # aggregates decrypt on these workers while the service's thread goes on verifying
        # and answering (gmpy2 releases the GIL); each aggregate's blocks use ``threads``
        self.workers = workers if workers is not None else max(2, defaults.shared_threads())
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="decrypt")
        # the ledger, the run it serves, its models, verdicts and rounds (keyserver.state)
        self.state = KeyServerState.open(self.key_dir, self.fleet)
        self.on(FleetConfig, self._on_config)
        self.on(RoundOpen, self._on_round_open)
        self.on(AggregateRequest, self._on_request)
        self.on(ReceiptBatch, self._on_receipts)
        self.watch("coordinator")
        metrics_port = live_port(metrics_port, METRICS_PORT_ENV)
        self.metrics = KeyServerMetrics(metrics_port, metrics_host) if metrics_port is not None else None
        if self.metrics is not None:
            self.metrics.watch(self.link)
            self.metrics.ledger(len(self.state.ledger))

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
        state = self.state
        if msg.run_id == state.run_id:
            return
        served = state.served(msg.run_id)
        if served is not None:  # each job (nonce) is served as one run: no round of it is unmasked twice
            self._refuse_run(msg.run_id, f"Job {msg.run_id} is refused: this key server already served it "
                                         f"({served}) and a job runs once; the operator signs a new job (a new "
                                         "nonce) to run it again.")
            return
        secret = public = None
        if scheme is None:
            announcement = PublicKeyAnnouncement(scheme="", key_id=NO_KEY_ID, key=b"", run_id=msg.run_id)
        else:
            secret = load_or_generate(self.key_dir, scheme, config.key_bits, self.key_structure)
            # per-client masks (sensecrypt) on the masked scheme: its key aggregates ragged masks
            public = job_key(secret.public_key, per_client_masks=strategy.per_client_masks)
            announcement = PublicKeyAnnouncement(scheme=scheme, key_id=public.key_id, key=public.to_bytes(),
                                                 run_id=msg.run_id)
        # everything of the previous run is dropped (a late decryption of it too); the
        # checkpoint of this run, if it is in the key directory, is resumed
        if state.start_run(msg.run_id, job=config, initial=msg.initial.copy(), public=public, secret=secret):
            for k in sorted(state.models):
                self._publish_model(k)
            self.log.info("resumed run %s: cluster rounds %s, %d verdicts", state.run_id,
                          {k: r for k, (r, _) in state.models.items()}, len(state.results))
        if self.metrics is not None:
            self.metrics.job(msg.run_id, config.strategy, scheme)
        self.send("keys/public", announcement, retain=True)
        self.log.info("run %s: %s, scheme %s, key %s", state.run_id, config.strategy, scheme or "none", announcement.key_id)
        if public is not None and not public.verifiable and not self.rules.allow_unverifiable:
            self.log.warning("run %s: %s aggregates cannot be verified; they will be refused (--allow-unverifiable "
                             "trusts the coordinator to sum honestly)", state.run_id, scheme)

    def _refuse_unsigned(self, msg: FleetConfig) -> bool:
        """True (logged, and announced for the run so the coordinator fails the job at once)
        if the run is not the job an operator signed (:func:`job_refusal`)."""
        reason = job_refusal(msg.run_id, msg.config, msg.submission, self.trust, fleet=self.fleet,
                             required=self.require_signed_jobs, initial=msg.initial)
        if reason is None:
            return False
        if msg.run_id == self.state.run_id:  # the run it serves stays announced: a forged config changes nothing
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

    def _on_request(self, item: Inbound) -> None:
        """keyserver.verify.decide says what becomes of the request; this acts on it."""
        msg: AggregateRequest = item.message  # type: ignore[assignment]
        r, k, state = item.round, msg.cluster, self.state
        t = time.perf_counter()
        decision = decide(state, self.rules, item.sender, r, msg)
        staged = state.staged.pop((r, k, msg.attempt), None)  # its receipts were read: kept no longer
        t_verify = time.perf_counter() - t + (staged.seconds if staged is not None else 0.0)
        if isinstance(decision, Reject):  # logged, no verdict
            raise ProtocolError(decision.reason)
        if isinstance(decision, Replay):  # a re-sent request (reconnect, restart): the same verdict
            if decision.warning:
                self.log.warning("%s", decision.warning)
            self.log.info("round %d cluster %d: re-sent request; answering with the recorded verdict", r, k)
            self._replay(r, k)
            return
        if isinstance(decision, Decrypting):
            self.log.info("round %d cluster %d: re-sent request while it is being decrypted; the verdict follows", r, k)
            return
        if isinstance(decision, Refuse):
            reason = f"refused: {decision.reason}"
            if decision.retry:  # nothing decrypted or spent: the coordinator may look for the one at fault
                state.attempts.setdefault((r, k), set()).add(decision.attempt)
                state.failed.setdefault((r, k), []).append(decision.prints)
            self.log.warning("round %d cluster %d %s", r, k, reason)
            self._answer(r, k, AggregateResult(run_id=state.run_id, cluster=k, accepted=False, reason=reason,
                                               timings={"verify": t_verify}, retry=decision.retry))
            return
        for note in decision.notes:
            self.log.info("round %d cluster %d: %s", r, k, note)
        for a, why in decision.excluded.items():
            self.log.warning("round %d cluster %d: %s's update refused: %s", r, k, a, why)
        # a new attempt after a refusal at the fingerprint check: that verdict is replaced. The
        # contributions are taken now (a second aggregate that reuses one is refused even while
        # this one decrypts) and spent, with their ledger entries, when the verdict is recorded
        distinct, excluded = decision.contributors, decision.excluded
        state.results.pop((r, k), None)
        state.reserved.setdefault(r, {}).update({a: k for a in distinct})
        if decision.entries:
            state.entries[(r, k)] = decision.entries
        aggregate, secret, threads, run_id = decision.aggregate, state.secret, self.threads, state.run_id
        if decision.pads is not None:  # masked: remove exactly their pads
            secret.bind_contributions(aggregate.ciphertext, decision.pads, decision.contexts, masks=decision.masks)

        def decrypt() -> tuple[np.ndarray, float]:  # a worker thread: pure computation
            t = time.perf_counter()
            return decrypt_aggregate(aggregate, secret, threads=threads), time.perf_counter() - t

        future = self._pool.submit(decrypt)
        state.pending[(r, k)] = future
        future.add_done_callback(lambda f: self.call_soon(
            f"decryption of round {r} cluster {k}", lambda: self._decrypted(run_id, r, k, f, distinct, t_verify, excluded)))

    def _decrypted(self, run_id: str, r: int, k: int, future: Future, distinct: list[str], t_verify: float,
                   excluded: dict[str, str] | None = None) -> None:
        """The service's thread, once round ``r``'s aggregate of cluster ``k`` is decrypted:
        apply the mean to the cluster's model, spend the contributions, record and answer."""
        state = self.state
        if run_id != state.run_id or state.pending.pop((r, k), None) is not future:
            return  # the run changed meanwhile
        for a in distinct:
            state.reserved.get(r, {}).pop(a, None)
        try:
            mean, t_decrypt = future.result()
        except ProtocolError as exc:  # the scheme's own check (masked: a sum that is not the named one)
            # the contributions are spent all the same: a refusal after unmasking is an answer
            # about their sum, which a coordinator must not be able to ask for twice
            state.spend(r, k, distinct, released=False)
            self.log.warning("round %d cluster %d refused at decryption: %s", r, k, exc)
            self._answer(r, k, AggregateResult(run_id=run_id, cluster=k, accepted=False,
                                               reason=f"refused: {exc}", timings={"verify": t_verify},
                                               excluded=excluded or {}))
            return
        except Exception as exc:  # noqa: BLE001 - a verdict, and the service goes on
            self.log.exception("round %d cluster %d: decryption failed", r, k)
            self._answer(r, k, AggregateResult(run_id=run_id, cluster=k, accepted=False,
                                               reason=f"refused: decryption failed ({type(exc).__name__})",
                                               timings={"verify": t_verify}))
            return
        state.release(r, k, apply_mean(state.model(k)[1], mean, server_lr=state.job.options.server_lr))
        state.spend(r, k, distinct, released=True)
        self.log.info("round %d cluster %d: %d verified contributors (%.3f s), decrypted in %.3f s", r, k,
                      len(distinct), t_verify, t_decrypt)
        self._answer(r, k, AggregateResult(run_id=run_id, cluster=k, accepted=True,
                                           timings={"decrypt": t_decrypt, "verify": t_verify},
                                           excluded=excluded or {}))

    def _on_receipts(self, item: Inbound) -> None:
        """A batch of a large request's receipts: checked now, kept until the request
        (keyserver.verify.stage_batch)."""
        reason = stage_batch(self.state, self.rules, item.sender, item.round, item.message)  # type: ignore[arg-type]
        if reason is not None:
            raise ProtocolError(reason)

    # -- trust: the round's plan, its challenge, the contributions ------------------------
    def _on_round_open(self, item: Inbound) -> None:
        msg: RoundOpen = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"Round plan from {item.sender!r}; only the coordinator opens rounds.")
        state = self.state
        if state.job is None or msg.run_id != state.run_id:
            raise ProtocolError(f"Round plan for run {msg.run_id!r}; the current run is {state.run_id!r}.")
        r = item.round
        try:
            # one string per device across rounds and the state's maps (a fleet's names, twice a round)
            plan = {int(k): sorted({sys.intern(a) for a in v}) for k, v in msg.clusters.items()}
        except ValueError:
            raise ProtocolError("A round plan's cluster ids must be integers.") from None
        members = [a for v in plan.values() for a in v]
        if r < 1 or not plan or len(members) != len(set(members)):
            raise ProtocolError(f"Round plan {r} is empty, for round < 1, or puts an agent in two clusters.")
        if r > state.job.rounds:  # a sum the operator did not sign for (a DP job: budget beyond its epsilon)
            raise ProtocolError(f"Round plan {r}: job {state.run_id} has {state.job.rounds} rounds (the operator "
                                "signed them); no round after the last is opened.")
        if r in state.plans:
            if state.plans[r] != plan:
                raise ProtocolError(f"Round {r} was already opened with another plan; a round's plan is pinned.")
            if r in state.challenges:  # a re-sent plan (reconnect): the same challenge again
                self.send("keyserver/challenges", state.challenges[r], round=r, retain=True)
            return
        if state.plans and r < max(state.plans):
            raise ProtocolError(f"Round plan {r} comes after round {max(state.plans)}; rounds only move forward.")
        state.serve_job(f"first round opened at {time.strftime('%Y-%m-%d %H:%M:%S')}")  # saved with the round
        state.forget_before(r - 1)  # the round before stays: its verdict may still be under way
        state.plans[r] = plan
        state.seeds[r] = os.urandom(SEED_BYTES)
        context = f"{self.fleet}/{state.run_id}/{r}".encode()
        sealed, boxes = {}, {}
        for agent in members:
            box = self.trust.box_key(agent) if not self.trust.tofu else None
            if box is None and self.trust.tofu and msg.box_keys.get(agent):
                box = unb64(msg.box_keys[agent], f"box key of {agent}")
            if box is None:
                self.log.warning("round %d: no box key for %s; it cannot sign a fingerprint this round", r, agent)
                continue
            boxes[agent] = box
            sealed[agent] = b64(self.identity.seal(state.seeds[r], box, context))
        state.boxes[r] = boxes
        state.challenges[r] = Challenge(run_id=state.run_id, box_key=b64(self.identity.box_key), sealed=sealed)
        state.save()  # the job's ledger entry, then the round (its seed), before its challenge is out
        self.send("keyserver/challenges", state.challenges[r], round=r, retain=True)
        if self.metrics is not None:
            self.metrics.ledger(len(state.ledger))
            self.metrics.round_opened(r)
        self.log.info("round %d opened: clusters %s; challenge sealed to %d agents", r,
                      {k: len(v) for k, v in plan.items()}, len(sealed))

    def _answer(self, r: int, k: int, result: AggregateResult) -> None:
        """Record the verdict with the model it produced and the contributions it spent (one
        save, the ledger first: a restart never finds a model without its verdict, nor a
        decrypted contribution missing from the ledger), then publish both."""
        self.state.results[(r, k)] = result
        self.state.save()
        release_memory()  # the request's receipts and the checkpoint's encoding are gone
        if self.metrics is not None:
            self.metrics.ledger(len(self.state.ledger))
            self.metrics.verdict(k, result.accepted, result.reason, result.timings)
        if self.kill_after_apply == r:
            import signal

            self.log.warning("fault drill: killing myself (SIGKILL) after applying round %d", r)
            os.kill(os.getpid(), signal.SIGKILL)
        self._replay(r, k)

    def _replay(self, r: int, k: int) -> None:
        """Publish the verdict on round ``r`` of cluster ``k`` and, if it was accepted and is
        still the cluster's latest, its model (retained)."""
        result = self.state.results[(r, k)]
        if result.accepted and self.state.models.get(k, (0, None))[0] == r:
            self._publish_model(k)
        self.send("keyserver/results", result, round=r)

    def _publish_model(self, k: int) -> None:
        state = self.state
        r, w = state.models[k]
        model = ClusterModel(run_id=state.run_id, cluster=k, model=state.job.model, weights=w.astype(np.float32))
        self.send(f"clusters/{k}/model", model, round=r, retain=True)

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
