"""An in-process MQTT broker (amqtt) so that ``senseshield fleet up`` needs nothing installed.

amqtt 0.12 is an MQTT **3.1.1** broker only: a CONNECT with protocol level 5 is refused
(CONNACK "unacceptable protocol version"). A :class:`~senseshield.runtime.transport.Link` to this
broker must therefore be made with ``protocol=EmbeddedBroker.protocol`` ("3.1.1").

The broker runs on its own asyncio loop in a daemon thread, listens on the loopback by
default, allows anonymous clients and keeps everything (sessions, retained messages) in
memory: a restart starts empty, like a Mosquitto with ``persistence false``.

amqtt has no message size limit of its own (it would read a 256 MB PUBLISH into memory);
this wrapper adds one (``max_message_bytes``, 32 MB by default: room for a
:class:`~senseshield.runtime.transport.Link`'s 1 MB chunks and for its unchunked retained frames of
up to ``Link.max_retained_bytes``, 16 MB). A client that sends a larger packet is
disconnected (its last will, if any, is published), as Mosquitto does with
``message_size_limit``.

Other amqtt 0.12 behaviour worth knowing (fixed or worked around here where noted):

- a connecting client was sent the retained messages of *other* clients' subscriptions
  (fixed in ``_Broker._publish_retained_messages_for_subscription``);
- ``Broker.shutdown`` could hang on Python 3.11 (worked around in ``_Broker.close``);
- a socket closed before its CONNECT was never closed by amqtt (closed here);
- the broker does not enforce keep-alive (its read timeout handler does nothing): a client
  that vanishes without its socket being closed (power or network loss, not a killed
  process, whose socket the OS closes) keeps its session and its last will is never
  published. Fine on the loopback; for devices on a real network use Mosquitto;
- a subscriber has 5 s to acknowledge a QoS 1 message; later the broker logs a warning
  (the message was delivered and is not resent).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout

from amqtt.adapters import StreamReaderAdapter, StreamWriterAdapter
from amqtt.broker import Broker

log = logging.getLogger("senseshield.runtime.broker")

DEFAULT_MAX_MESSAGE_BYTES = 32 << 20  # > Link.max_retained_bytes (16 MB) + headers


class MessageTooLarge(Exception):
    """A client sent a packet larger than the broker's limit (its connection is dropped)."""


class _LimitedReader(StreamReaderAdapter):
    """amqtt reads a PUBLISH payload in one ``read(n)``; refuse ``n`` above the limit.

    The exception is not one of amqtt's own (MQTTError/NoDataError, which its reader loop
    swallows and carries on from mid-packet): amqtt logs it and closes the connection.
    """

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        super().__init__(reader)
        self._limit = limit

    async def read(self, n: int = -1) -> bytes:
        if self._limit and n > self._limit:
            raise MessageTooLarge(
                f"packet of {n:,} bytes over the broker's {self._limit:,}-byte limit"
            )
        return await super().read(n)


class _Broker(Broker):
    """amqtt's Broker with a message size limit and one fix (see the methods)."""

    def __init__(self, *args, max_message_bytes: int, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._max_message_bytes = max_message_bytes
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def close(self, timeout: float) -> None:
        """Shut down without hanging: end the connections first, then amqtt's shutdown.

        amqtt's ``shutdown`` cancels each client's reader task and waits for it to end; on
        Python 3.11 ``asyncio.wait_for`` swallows a cancellation that coincides with a packet
        arriving (fixed in 3.12), and that reader then waits for the client's next packet:
        ``shutdown`` hung until the client went away. Closing the sockets first makes every
        reader see EOF and end however the cancellation goes.
        """
        for server in self._servers.values():
            if server.instance is not None:
                server.instance.close()  # no new connections
        for session, _ in list(self._sessions.values()):
            session.will_flag = False  # the broker stopping is not the clients failing
        for writer in list(self._connections.values()):
            writer.close()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=timeout / 2)
        try:
            await asyncio.wait_for(self.shutdown(), timeout / 2)
        finally:
            for writer in list(self._connections.values()):
                writer.transport.abort()

    async def _publish_retained_messages_for_subscription(  # noqa: ANN001
        self, subscription, session
    ) -> None:
        """Send retained messages only for a filter this session has actually subscribed to.

        amqtt 0.12 also calls this on every CONNECT for every filter of *every* client
        (``for topic in self._subscriptions``, a broker-wide dict), so a new client got the
        retained messages of other clients' subscriptions, even with none of its own. On a
        SUBSCRIBE the filter is registered before this call, so that case is unaffected.
        """
        topic_filter = subscription[0]
        subscribers = self._subscriptions.get(topic_filter, ())
        if any(s.client_id == session.client_id for s, _ in subscribers):
            await super()._publish_retained_messages_for_subscription(subscription, session)

    async def stream_connected(self, reader, writer, listener_name: str) -> None:  # noqa: ANN001
        task = asyncio.current_task()
        self._connections[task] = writer
        try:
            limited = _LimitedReader(reader, self._max_message_bytes)
            await self._client_connected(listener_name, limited, StreamWriterAdapter(writer))
        except MessageTooLarge as exc:  # only if the CONNECT itself is too large
            log.warning("embedded broker: %s; connection closed", exc)
        finally:
            # amqtt leaves the socket open when a client goes away before its CONNECT (a port
            # probe, a client that gave up): close it here; a no-op when amqtt already did
            writer.close()
            self._connections.pop(task, None)


class _DuplicateNoise(logging.Filter):
    """Drop two amqtt ERROR records that only repeat a WARNING logged just before them.

    - "No data from <client>" when a connection closes before its CONNECT (a port probe);
      "Failed to initialize client session" follows as a WARNING.
    - the traceback of a broadcast task that ended in "Timeout waiting for PUBACK" (amqtt
      gives a subscriber 5 s to acknowledge a QoS 1 message; the message was delivered, and
      amqtt already warned "Timeout waiting for PUBACK for packet ID n").
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, TimeoutError) and "PUBACK" in str(exc):
            return False
        return not str(record.msg).startswith("No data from")


_NOISE_FILTER = _DuplicateNoise()


class EmbeddedBroker:
    """An amqtt broker on ``host:port`` (port 0: a free port) in a background thread.

    >>> with EmbeddedBroker() as broker:                         # doctest: +SKIP
    ...     link = Link(broker.url, ..., protocol=EmbeddedBroker.protocol)
    """

    #: the MQTT version a :class:`~senseshield.runtime.transport.Link` must speak with this broker
    protocol = "3.1.1"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        log_level: int = logging.WARNING,
    ) -> None:
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.log_level = log_level
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: _Broker | None = None

    # -- public ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"mqtt://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Start listening; return once the port accepts TCP connections."""
        if self.running:
            raise RuntimeError(f"Embedded broker on {self.url} is already running.")
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(self.log_level)
        amqtt_broker_log = logging.getLogger("amqtt.broker")
        if _NOISE_FILTER not in amqtt_broker_log.filters:
            amqtt_broker_log.addFilter(_NOISE_FILTER)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_broker())
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                self._close_loop(loop)
                started.set()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                self._close_loop(loop)

        self._loop = loop
        self._thread = threading.Thread(target=run, name="embedded-mqtt-broker", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or failure:
            self.stop()
            reason = f": {failure[0]}" if failure else f" within {timeout:g} s"
            raise RuntimeError(
                f"Embedded MQTT broker did not start on {self.host}:{self.port}{reason}"
            )
        log.info("embedded MQTT broker listening on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Disconnect every client (no last wills), close the listener, end the thread.

        Idempotent; a stopped broker can be started again (on the same port).
        """
        loop, thread, broker = self._loop, self._thread, self._broker
        self._loop = self._thread = self._broker = None
        if loop is None or thread is None:
            return
        if thread.is_alive() and broker is not None and broker.transitions.state == "started":
            future = asyncio.run_coroutine_threadsafe(broker.close(timeout * 0.8), loop)
            try:
                future.result(timeout)
            except (FutureTimeout, asyncio.TimeoutError):
                log.warning("embedded broker: shutdown took over %g s; stopping anyway", timeout)
            except Exception:  # noqa: BLE001 - stop() must always end the thread
                log.exception("embedded broker: shutdown failed")
        if thread.is_alive():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # the loop closed meanwhile (a failed start)
                pass
            thread.join(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedBroker({self.url}, {'running' if self.running else 'stopped'})"

    # -- internals (broker thread) --------------------------------------------------------
    async def _start_broker(self) -> None:
        bind = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        config = {
            "listeners": {"default": {"type": "tcp", "bind": bind}},
            # only anonymous auth: no $SYS publisher, no packet/event loggers
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
            },
        }
        self._broker = _Broker(config, max_message_bytes=self.max_message_bytes)
        await self._broker.start()  # returns with the socket listening: connections are accepted
        server = self._broker._servers["default"].instance  # noqa: SLF001 - amqtt has no accessor
        if not server.is_serving():
            raise RuntimeError("the listener is not serving")
        self.port = server.sockets[0].getsockname()[1]  # the port the OS picked when port=0

    @staticmethod
    def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
        """Cancel whatever amqtt left running (client handlers, plugin tasks), then close."""
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


# ---- broker limits for a fleet's size ---------------------------------------------------------

MESSAGES_PER_DEVICE = 8
"""Messages a broker must be able to queue toward the coordinator per device of the fleet: a
device's hello, bootstrap vector, update and metrics may all be on their way at once (a
fleet's worth of them arrives together at a job's start and a round's end), and each may
be re-sent once before the coordinator has taken the first (devices re-send what is not
acknowledged). An update larger than one chunk (1 MB) counts once per chunk."""

MOSQUITTO_DEFAULT_QUEUE = 1000  # Mosquitto's own max_queued_messages, kept as the floor
INFLIGHT_MESSAGES = 100  # per client, sent and not yet acknowledged (Mosquitto's default: 20)


def queue_limits(fleet_size: int, *, chunks_per_update: int = 1) -> dict[str, int]:
    """Mosquitto's per-client queue settings for a fleet of ``fleet_size`` devices whose
    updates travel in ``chunks_per_update`` MQTT messages: ``max_queued_messages`` (the
    coordinator subscribes to every device's topics, and a full queue makes the broker
    drop QoS 1 messages for that client, silently for the sender) and
    ``max_inflight_messages``. docs/operating-a-fleet.md, "The broker", explains the rule."""
    if fleet_size < 0 or chunks_per_update < 1:
        raise ValueError(f"fleet_size {fleet_size} and chunks_per_update {chunks_per_update}: give >= 0 and >= 1.")
    per_device = MESSAGES_PER_DEVICE + 2 * (chunks_per_update - 1)
    return {"max_queued_messages": max(MOSQUITTO_DEFAULT_QUEUE, per_device * fleet_size),
            "max_inflight_messages": INFLIGHT_MESSAGES}


# ---- Mosquitto as a child process ------------------------------------------------------------

MOSQUITTO_PATHS = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


def mosquitto_binary() -> str | None:
    """Path of the Mosquitto broker (Debian puts it in /usr/sbin), or None."""
    import shutil
    from pathlib import Path

    for candidate in MOSQUITTO_PATHS:
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found:
            return found
    return None


class MosquittoProcess:
    """A Mosquitto broker run as a child process, anonymous, without persistence, on one
    address (``host``) and a free port; used by trials and by the integration tests.

    ``start`` returns once it accepts TCP connections; ``stop`` terminates it (SIGKILL after
    5 s); a stopped broker can be started again on the same port (its log is appended).

    Its per-client queue is sized for ``fleet_size`` devices (:func:`queue_limits`);
    ``max_queued_messages`` overrides it (a test gives a deliberately small one).
    :meth:`dropped` counts the broker's "messages are being dropped" lines in its log.
    ``extra``: more configuration (e.g. a site's bridge, :func:`senseshield.runtime.sites.mosquitto_bridge`).
    """

    def __init__(self, workdir, host: str = "127.0.0.1", *, message_size_limit: int = 0,  # noqa: ANN001
                 fleet_size: int = 3000, max_queued_messages: int | None = None,
                 max_inflight_messages: int | None = None, extra: str = "") -> None:
        import socket
        from pathlib import Path

        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "mosquitto.conf"
        self.host, self.message_size_limit, self.extra = host, message_size_limit, extra
        limits = queue_limits(fleet_size)
        for key, value in (("max_queued_messages", max_queued_messages), ("max_inflight_messages", max_inflight_messages)):
            if value is not None:
                limits[key] = value
        self._write_config(limits)
        self.log = workdir / "mosquitto.log"
        self.process = None

    def _write_config(self, limits: dict[str, int]) -> None:
        self.limits = dict(limits)
        self.config.write_text(
            f"listener {self.port} {self.host}\nallow_anonymous true\npersistence false\n"
            f"message_size_limit {self.message_size_limit}\nlog_dest stderr\n"
            + "".join(f"{key} {value}\n" for key, value in self.limits.items()) + self.extra
        )

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "MosquittoProcess":
        import socket
        import subprocess
        import time

        from senseshield.errors import ConfigError

        binary = mosquitto_binary()
        if binary is None:
            raise ConfigError("Mosquitto is not installed (apt-get install mosquitto); `make test` installs it.")
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([binary, "-c", str(self.config)], stdout=out, stderr=out,
                                            start_new_session=True)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise ConfigError(f"mosquitto exited at start; see {self.log}.")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise ConfigError(f"mosquitto did not listen on {self.host}:{self.port} within {timeout:g} s.")

    def dropped(self) -> list[str]:
        """The clients the broker said it dropped outgoing messages for (its log's
        "Outgoing messages are being dropped for client X" lines, in order)."""
        if not self.log.exists():
            return []
        marker = "Outgoing messages are being dropped for client "
        return [line.split(marker, 1)[1].strip().rstrip(".")
                for line in self.log.read_text(errors="replace").splitlines() if marker in line]

    def stop(self) -> None:
        import subprocess

        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
