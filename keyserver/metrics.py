"""The key server's optional Prometheus endpoint (``prometheus-client``): the job it serves,
the rounds opened, the aggregates it decrypted or refused (and why), how long verifying and
decrypting (unmasking) took, and its ledger. The key server feeds it through the hooks below,
on its own thread (``grep -n metrics keyserver/service.py``)."""

from __future__ import annotations

from typing import Any

from senseshield.runtime.metrics import count_rejections, refusal_kind, serve

METRICS_PORT_ENV = "SENSESHIELD_KEYSERVER_METRICS_PORT"
"""Prometheus port when ``keyserver serve --metrics-port`` is not given (its own variable, so
a coordinator on the same host with ``SENSESHIELD_METRICS_PORT`` does not take the same port)."""

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class KeyServerMetrics:
    """The key server's endpoint on ``port`` (0: a free port, :attr:`port`), ``host`` (default:
    localhost only). Its own registry.

    * ``senseshield_keyserver_job_info{job,strategy,scheme}`` (1 for the job it serves),
      ``senseshield_keyserver_round`` (latest round opened);
    * ``senseshield_keyserver_aggregates_total{result}`` (accepted: decrypted and applied;
      refused), ``senseshield_keyserver_refusals_total{kind}`` (aggregates and jobs refused,
      by kind of reason: min_contributors, fingerprint, reused, job, ...);
    * ``senseshield_keyserver_verify_seconds``, ``senseshield_keyserver_decrypt_seconds``
      (histograms: checks of a request; decryption or unmasking of an accepted aggregate),
      ``senseshield_keyserver_last_decrypt_seconds{cluster}``;
    * ``senseshield_keyserver_ledger_entries`` (contributions and jobs its ledger records);
    * ``senseshield_keyserver_rejected_messages_total{kind}`` (messages rejected, by kind).
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.job_info = Gauge("senseshield_keyserver_job_info", "1 for the job the key server serves.",
                              ("job", "strategy", "scheme"), registry=registry)
        self.round = Gauge("senseshield_keyserver_round", "Latest round opened (its plan pinned).", registry=registry)
        self.aggregates = Counter("senseshield_keyserver_aggregates", "Aggregate requests answered, by verdict.",
                                  ("result",), registry=registry)
        self.refusals = Counter("senseshield_keyserver_refusals", "Aggregates and jobs refused, by kind of reason.",
                                ("kind",), registry=registry)
        self.verify_seconds = Histogram("senseshield_keyserver_verify_seconds", "Seconds checking an aggregate request.",
                                        buckets=SECONDS_BUCKETS, registry=registry)
        self.decrypt_seconds = Histogram("senseshield_keyserver_decrypt_seconds", "Seconds decrypting (unmasking) an "
                                         "accepted aggregate.", buckets=SECONDS_BUCKETS, registry=registry)
        self.last_decrypt = Gauge("senseshield_keyserver_last_decrypt_seconds", "Seconds of the cluster's latest "
                                  "decryption.", ("cluster",), registry=registry)
        self.ledger_entries = Gauge("senseshield_keyserver_ledger_entries", "Entries of the key server's ledger.",
                                    registry=registry)
        self.rejected = Counter("senseshield_keyserver_rejected_messages", "Messages rejected, by message kind.",
                                ("kind",), registry=registry)
        self.server_handle, self.thread, self.port = serve(registry, port, host)

    def watch(self, link: Any) -> None:
        """Count the messages the key server's link rejects."""
        count_rejections(link, self.rejected)

    def job(self, job_id: str, strategy: str, scheme: str | None) -> None:
        """The key server serves job ``job_id`` from now on."""
        self.job_info.clear()
        self.job_info.labels(job_id, strategy, scheme or "none").set(1)
        self.round.set(0)
        self.last_decrypt.clear()

    def round_opened(self, r: int) -> None:
        self.round.set(r)

    def verdict(self, k: int, accepted: bool, reason: str, timings: dict[str, float]) -> None:
        """A verdict on cluster ``k``'s aggregate (once per verdict, not per replay)."""
        self.aggregates.labels("accepted" if accepted else "refused").inc()
        if "verify" in timings:
            self.verify_seconds.observe(timings["verify"])
        if accepted and "decrypt" in timings:
            self.decrypt_seconds.observe(timings["decrypt"])
            self.last_decrypt.labels(str(k)).set(timings["decrypt"])
        if not accepted:
            self.refusals.labels(refusal_kind(reason)).inc()

    def job_refused(self) -> None:
        """A job the key server does not serve (not signed by a pinned operator, served before)."""
        self.refusals.labels("job").inc()

    def ledger(self, entries: int) -> None:
        self.ledger_entries.set(entries)

    def close(self) -> None:
        self.server_handle.shutdown()
        self.server_handle.server_close()
