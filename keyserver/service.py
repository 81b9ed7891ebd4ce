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
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from senseshield import defaults
from senseshield.engine.aggregation import decrypt_aggregate
from senseshield.errors import ConfigError, ProtocolError
from senseshield.he import SCHEMES, PublicKey, SecretKey
from senseshield.runtime.protocol.messages import (
    AggregateRequest,
    AggregateResult,
    ClusterModel,
    FleetConfig,
    PublicKeyAnnouncement,
    aggregate_from_message,
)
from senseshield.rounds import apply_mean
from senseshield.runtime.identity import Identity, Trust
from senseshield.runtime.keyfiles import check_private, secure_dir, write_secret
from senseshield.runtime.service import Inbound, Service
from senseshield.job import Job, announced_run

log = logging.getLogger("senseshield.keyserver")

NO_KEY_ID = "none"  # announced when the run's strategy encrypts nothing


def load_or_generate(key_dir: Path, scheme: str, key_bits: int) -> SecretKey:
    """The key pair of ``scheme`` stored in ``key_dir``, generated on first use."""
    factory = SCHEMES.get(scheme)
    has_bits = "key_bits" in factory.info().params
    path = key_dir / (f"{scheme}-{key_bits}.key" if has_bits else f"{scheme}.key")
    if path.exists():
        check_private(path)
        secret = factory.secret_key_from_bytes(path.read_bytes())
        log.info("loaded %s key %s from %s", scheme, secret.public_key.key_id, path)
        return secret
    t = time.perf_counter()
    secret = factory.generate(**({"key_bits": key_bits} if has_bits else {}))
    write_secret(path, secret.to_bytes(include_secret=True))
    (key_dir / (path.stem + ".pub")).write_bytes(secret.public_key.to_bytes())
    log.info("generated %s key %s in %.1f s; secret in %s", scheme, secret.public_key.key_id, time.perf_counter() - t, path)
    return secret


class KeyServer(Service):
    """``keyserver serve``: see the module docstring."""

    def __init__(
        self,
        broker: str,
        *,
        fleet: str,
        key_dir: Path,
        min_contributors: int = 2,
        protocol: str = "5",
        threads: int | None = None,
        kill_after_apply: int | None = None,
        identity: Identity | None = None,
        trust: Trust | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise ConfigError(f"--threads {threads} is not allowed; use 1 or more.")
        if min_contributors < 1:
            raise ConfigError(f"--min-contributors {min_contributors} is not allowed; it must be at least 1.")
        super().__init__(broker, fleet=fleet, client_id="keyserver", logger=log, protocol=protocol,
                         status_topic="keyserver/status", identity=identity, trust=trust, role="keyserver")
        self.key_dir = secure_dir(Path(key_dir))
        self.kill_after_apply = kill_after_apply  # fault drill: SIGKILL itself after applying this round
        self.min_contributors = min_contributors
        self.threads = threads if threads is not None else defaults.shared_threads()
        self.run_id: str | None = None
        self.config: Job | None = None
        self.secret: SecretKey | None = None
        self.public: PublicKey | None = None
        self.initial: np.ndarray | None = None
        self.models: dict[int, tuple[int, np.ndarray]] = {}  # cluster -> (round, weights)
        self.results: dict[tuple[int, int], AggregateResult] = {}  # (round, cluster) -> result
        self.on(FleetConfig, self._on_config)
        self.on(AggregateRequest, self._on_request)
        self.watch("coordinator")

    # -- handlers -------------------------------------------------------------------------
    def _on_config(self, item: Inbound) -> None:
        msg: FleetConfig = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"fleet/config from {item.sender!r}; only the coordinator may set it.")
        if msg.run_id == self.run_id:
            return
        config, _, scheme = announced_run(msg.config)  # checked before anything changes
        self.run_id, self.config, self.initial = msg.run_id, config, msg.initial.copy()
        self.models, self.results = {}, {}
        if scheme is None:
            self.secret = self.public = None
            announcement = PublicKeyAnnouncement(scheme="", key_id=NO_KEY_ID, key=b"", run_id=msg.run_id)
        else:
            self.secret = load_or_generate(self.key_dir, scheme, config.key_bits)
            self.public = self.secret.public_key
            announcement = PublicKeyAnnouncement(scheme=scheme, key_id=self.public.key_id, key=self.public.to_bytes(),
                                                 run_id=msg.run_id)
        self._restore()
        self.send("keys/public", announcement, retain=True)
        self.log.info("run %s: %s, scheme %s, key %s", self.run_id, config.strategy, scheme or "none", announcement.key_id)

    def _on_request(self, item: Inbound) -> None:
        msg: AggregateRequest = item.message  # type: ignore[assignment]
        if item.sender != "coordinator":
            raise ProtocolError(f"Aggregate from {item.sender!r}; only the coordinator may send aggregates.")
        if self.config is None or msg.run_id != self.run_id:
            raise ProtocolError(f"Aggregate for run {msg.run_id!r}; the current run is {self.run_id!r}.")
        r, k = item.round, msg.cluster
        if (r, k) in self.results:  # a re-sent request (reconnect, restart): the same verdict
            self.log.info("round %d cluster %d: re-sent request; answering with the recorded verdict", r, k)
            self._replay(r, k)
            return
        last = self.models.get(k, (0, None))[0]
        if r <= last:
            raise ProtocolError(f"Aggregate for round {r} of cluster {k} is stale; the cluster is at round {last}.")
        distinct = sorted(set(msg.contributors))
        if len(distinct) < self.min_contributors:
            reason = (
                f"refused: {len(distinct)} distinct contributor(s) {distinct}, fewer than the "
                f"minimum {self.min_contributors}; decrypting would reveal an individual update"
            )
            self.log.warning("round %d cluster %d %s", r, k, reason)
            self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=False, reason=reason))
            return
        t = time.perf_counter()
        # sizes, masks, weights and the ciphertext's blocks are all checked before decrypting
        aggregate = aggregate_from_message(msg, self.public, round=r, size=self.initial.size)
        mean = decrypt_aggregate(aggregate, self.secret, threads=self.threads)
        t_decrypt = time.perf_counter() - t
        current = self.models.get(k, (0, self.initial))[1]
        new = apply_mean(current, mean, server_lr=self.config.options.server_lr)
        self.models[k] = (r, new)
        self.log.info("round %d cluster %d: %d contributors, decrypted in %.3f s", r, k, len(distinct), t_decrypt)
        self._answer(r, k, AggregateResult(run_id=self.run_id, cluster=k, accepted=True, timings={"decrypt": t_decrypt}))

    def _answer(self, r: int, k: int, result: AggregateResult) -> None:
        """Record the verdict with the model it produced (one checkpoint: a restart never
        finds a model without its verdict), then publish both."""
        self.results[(r, k)] = result
        self._checkpoint()
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
                "results": [[r, k, v.model_dump(mode="json")] for (r, k), v in self.results.items()]}
        tmp = self.key_dir / f".models-{self.fleet}.tmp.npz"
        np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, self._state_path())

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
        for k in sorted(self.models):
            self._publish_model(k)
        self.log.info("resumed run %s: cluster rounds %s, %d verdicts", self.run_id,
                      {k: r for k, (r, _) in self.models.items()}, len(self.results))

    # -- main -----------------------------------------------------------------------------
    def run(self) -> None:
        self.start(["fleet/config", "keyserver/requests"])
        try:
            while not self.stopping.is_set():
                self.pump(0.5)
        finally:
            self.stop()
