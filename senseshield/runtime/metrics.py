"""What the coordinator's and the key server's Prometheus endpoints share (``prometheus-client``).

Each service that is given a metrics port (``--metrics-port``, or its environment variable)
serves its own registry on ``http://HOST:PORT/metrics``: :func:`metrics_port` reads the
port, :func:`serve` starts the endpoint, :func:`message_kind` and :func:`refusal_kind` turn a
rejected message's topic and a refusal's sentence into a short label value (a label with a
few values, never the sentence itself), and :func:`count_rejections` counts every message
the service's MQTT link rejects (envelope, signature, schema, or a handler's ProtocolError).
"""

from __future__ import annotations

import os
import re
from typing import Any

from senseshield.errors import ConfigError

REFUSAL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # first match wins: the specific phrases come before the general ones
    ("fingerprint", ("not the product of the signed contributions",)),
    ("min_contributors", ("fewer than the minimum",)),
    ("dp_shares", ("noise shares",)),
    ("min_encryptors", ("encryptor", "sealed")),
    ("reused", ("already decrypted", "already released")),
    ("unverifiable", ("cannot be checked",)),
    ("stale_model", ("trained from",)),
    ("plaintext", ("plaintext",)),
    ("mask", ("mask",)),
    ("weights", ("weigh",)),
    ("box_key", ("box key",)),
    ("plan", ("never opened", "is over", "plan")),
    ("receipt", ("receipt", "contributor list", "signed for cluster")),
    ("deadline", ("no update arrived",)),
    ("aggregation", ("aggregation failed",)),
    ("decryption", ("decrypt",)),
)
"""Refusal kinds (``kind`` label) and the phrases of the refusal sentences that name them."""


def refusal_kind(reason: str) -> str:
    """The kind of a refusal sentence (a key server's verdict, as the coordinator receives it
    too): ``job`` (a job it does not serve: not signed by a pinned operator, served before),
    one of :data:`REFUSAL_KINDS`' names, else ``other``."""
    text = reason.lower().removeprefix("refused: ")
    if text.startswith("job "):
        return "job"
    for kind, phrases in REFUSAL_KINDS:
        if any(p in text for p in phrases):
            return kind
    return "other"


def message_kind(where: str) -> str:
    """The kind of a rejected message from where it was rejected: the last level of its topic
    (``ss/v1/lab/agents/c000/update`` -> ``update``), else the loop step with its numbers
    left out (``closing round 3`` -> ``closing round``)."""
    if "/" in where:
        return where.rstrip("/").rsplit("/", 1)[-1] or "unknown"
    words = re.sub(r"\s+", " ", re.sub(r"\d+", "", where)).strip()
    return words or "unknown"


def metrics_port(port: int | None, env: str) -> int | None:
    """``port``, else the port in environment variable ``env`` (None: no endpoint). A port
    outside 1..65535 (0: any free port, for tests) or a variable that is not a number is a
    ConfigError naming it."""
    where = f"--metrics-port {port}"
    if port is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return None
        where = f"{env}={text!r}"
        try:
            port = int(text)
        except ValueError:
            raise ConfigError(f"{where} is not allowed; give a port in 1..65535.") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"{where} is not allowed; give a port in 1..65535.")
    from senseshield.extras import require

    require(("prometheus_client",), f"{where} (the Prometheus endpoint)")
    return port


def serve(registry: Any, port: int, host: str) -> tuple[Any, Any, int]:
    """Serve ``registry`` on ``http://host:port/metrics`` (a daemon thread): (server, thread,
    the port, useful when ``port`` is 0). A port in use is a ConfigError naming it."""
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"The metrics endpoint cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          "give another --metrics-port.") from None
    return server, thread, server.server_port


def count_rejections(link: Any, counter: Any) -> None:
    """Count every message ``link`` (a :class:`~senseshield.runtime.transport.Link`) rejects on
    ``counter`` (a Counter labelled ``kind``: :func:`message_kind`)."""
    link.on_rejection = lambda where, reason: counter.labels(message_kind(where)).inc()
