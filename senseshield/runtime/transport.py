"""One MQTT connection of a SenseShield process, speaking :mod:`senseshield.runtime.protocol` frames.

Thin on purpose: paho-mqtt (MQTT 5 by default, 3.1.1 for brokers without 5 such as the
embedded amqtt one of :mod:`senseshield.runtime.broker`; QoS 1, ``CallbackAPIVersion.VERSION2``)
does the network; this class adds the fleet's topic prefix, chunking of large frames,
reassembly, decoding with every check of the envelope, and the rule that a bad message is
logged, counted and dropped but never stops the process. Incomplete chunk streams hold at
most ``max_frame_bytes`` in all (oldest evicted first) and are dropped after
:data:`~senseshield.runtime.protocol.chunks.DEFAULT_MAX_IDLE` seconds without a chunk. paho reconnects by itself after a broker
or network loss; subscriptions are renewed on every (re)connect.

Draining: paho's network thread only appends each arriving message to the link's inbound
queue (and acknowledges it to the broker), so the broker's queue toward this client drains
at network speed however slow the process is at handling what arrives; the link's own
decoder thread reassembles, decodes and calls ``on_frame``. The inbound queue is a
:class:`~senseshield.runtime.backlog.Backlog`: it holds ``memory_bytes``
(:data:`DEFAULT_MEMORY_BYTES`) in memory and the rest in a temporary file, so what waits
does not grow the process with the fleet. It holds at most ``max_pending_bytes``
(:data:`DEFAULT_MAX_PENDING_BYTES`) in all; a message beyond that (or one the file cannot
take) is dropped, counted as a rejection and logged (at most once every :data:`DROP_NOTE_S`
s), never waited for: a sender that heard no answer sends again (see docs/protocol.md,
"Re-sending").

Waiting: :meth:`Link.publish` waits for the broker's acknowledgement in short slices and
gives up at once when the link's ``stopping`` event is set (a service being stopped), as
:meth:`Link.start` gives up connecting.

A secured broker (``deploy/ansible``): ``mqtts://HOST[:PORT]`` (default port 8883)
speaks TLS and needs ``ca_file``, the CA that signed the broker's certificate (the
certificate must name HOST; optional ``certfile``/``keyfile`` for client certificates);
``username``/``password`` are the device's credentials. Anything missing or unreadable is a
:class:`ConfigError` before any connection is tried.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.errors import ConfigError, ProtocolError
from senseshield.runtime.backlog import Backlog
from senseshield.runtime.protocol import CHUNK_SCHEMA, Frame, Reassembler, decode_frame, iter_chunks
from senseshield.runtime.protocol.envelope import DEFAULT_MAX_FRAME_BYTES

PREFIX = "ss/v1"
PROTOCOLS = {"5": mqtt.MQTTv5, "3.1.1": mqtt.MQTTv311}  # MQTT version -> paho constant
DEFAULT_CHUNK_BYTES = 1 << 20  # well under every broker's default message limit
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}  # URL scheme -> default port (mqtts: TLS)
DEFAULT_MAX_PENDING_BYTES = 1 << 30  # inbound messages received but not yet decoded (1 GiB)
DEFAULT_MEMORY_BYTES = 2 << 20  # of those, held in memory (the rest wait in a temporary file)
DEFAULT_MAX_INFLIGHT = 1000  # outgoing QoS 1 messages awaiting the broker's PUBACK at once
DROP_NOTE_S = 10.0  # an overflowing inbound queue is said in the log at most this often
CHUNK_WINDOW = 2  # chunks of one frame handed to paho and not yet acknowledged, at most (each held twice)
WAIT_SLICE_S = 0.05  # waits (connect, PUBACK) look at the stopping event this often

log = logging.getLogger("senseshield.runtime.transport")
MESSAGE, RECONNECTED = 0, 1  # kinds of inbound entries: a message; the link is connected again
FrameHandler = Callable[[str, Frame], None]


def parse_broker(url: str) -> tuple[str, int]:
    """``mqtt://host:port``, ``mqtts://host:port``, ``host:port`` or ``host`` -> (host, port);
    default port 1883, or 8883 for ``mqtts://`` (TLS, see :func:`broker_uses_tls`)."""
    text = url if "://" in url else f"mqtt://{url}"
    parsed = urlparse(text)
    if parsed.scheme not in DEFAULT_PORTS or not parsed.hostname:
        raise ConfigError(
            f"Broker {url!r} is not allowed; use mqtt://HOST[:PORT] or mqtts://HOST[:PORT] (TLS), "
            "e.g. mqtt://127.0.0.1:1883."
        )
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if port is None:
        return parsed.hostname, DEFAULT_PORTS[parsed.scheme]
    if not 1 <= port <= 65535:
        raise ConfigError(f"Broker {url!r} has an invalid port; use a number in 1..65535.")
    return parsed.hostname, port


def broker_uses_tls(url: str) -> bool:
    """True for ``mqtts://`` broker URLs (TLS)."""
    return url.strip().lower().startswith("mqtts://")


def check_security(
    broker: str,
    *,
    ca_file: str | os.PathLike | None = None,
    certfile: str | os.PathLike | None = None,
    keyfile: str | os.PathLike | None = None,
    username: str | None = None,
    password: str | None = None,
) -> None:
    """Raise :class:`ConfigError` (one sentence) unless TLS and credential settings fit ``broker``."""
    tls = broker_uses_tls(broker)
    parse_broker(broker)
    if tls and ca_file is None:
        raise ConfigError(
            f"Broker {broker!r} uses TLS but no CA file was given; use --ca-file PATH with the CA "
            "certificate that signed the broker's certificate."
        )
    if not tls and (ca_file is not None or certfile is not None or keyfile is not None):
        raise ConfigError(
            f"A CA or client certificate was given but broker {broker!r} is not a TLS URL; "
            "use mqtts://HOST[:PORT]."
        )
    if keyfile is not None and certfile is None:
        raise ConfigError("A client key file needs its client certificate file (certfile).")
    for what, path in (("CA file", ca_file), ("client certificate", certfile), ("client key", keyfile)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"The {what} {str(path)!r} does not exist or is not a file.")
    if password is not None and not username:
        raise ConfigError("A password was given without a username; use --username NAME.")
    if username is not None and (not username or any(c in username for c in "\x00\n\r")):
        raise ConfigError(f"MQTT username {username!r} is not allowed; use a non-empty single-line name.")


def _reason(exc: Exception) -> str:
    return str(getattr(exc, "reason", None) or exc).strip() or exc.__class__.__name__


def _settled(info) -> bool:  # noqa: ANN001 - a paho MQTTMessageInfo
    """Whether a message handed to paho needs no more waiting for: acknowledged by the broker,
    or published while the link was down (paho raises for those; it sends them again after the
    reconnect, and the services re-send their state then)."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        return True


def topic(fleet: str, suffix: str) -> str:
    """Full topic of ``suffix`` in ``fleet``'s tree (``ss/v1/<fleet>/<suffix>``)."""
    if not fleet or any(c in fleet for c in "/+#"):
        raise ConfigError(f"Fleet name {fleet!r} is not allowed; use letters, digits, '-' or '_'.")
    return f"{PREFIX}/{fleet}/{suffix}"


class Link:
    """A process's MQTT link: subscribe to fleet topics, publish frames, get decoded frames."""

    def __init__(
        self,
        broker: str,
        *,
        client_id: str,
        fleet: str,
        on_frame: FrameHandler,
        will: tuple[str, bytes] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        protocol: str = "5",
        ca_file: str | os.PathLike | None = None,
        certfile: str | os.PathLike | None = None,
        keyfile: str | os.PathLike | None = None,
        username: str | None = None,
        password: str | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        stopping: threading.Event | None = None,
        receive_maximum: int | None = None,
    ) -> None:
        """``protocol``: the MQTT version, "5" (default) or "3.1.1" (e.g. the embedded broker).

        ``max_pending_bytes``: most bytes of received messages waiting for the decoder thread
        (beyond: dropped and counted); ``memory_bytes``: how many of them wait in memory (the
        rest in a temporary file); ``max_inflight``: most outgoing QoS 1 messages sent and
        not yet acknowledged by the broker (paho queues the rest); ``stopping``: an event that,
        once set, ends every wait of this link at once (a service's stop); ``receive_maximum``
        (MQTT 5): how many QoS 1 messages the broker may have in flight toward this link at once
        (None: the broker's own limit, Mosquitto's ``max_inflight_messages``); a link that
        subscribes to a whole fleet's messages and drains at network speed may take many.

        ``ca_file`` (required by ``mqtts://`` URLs), ``certfile``/``keyfile``, ``username`` and
        ``password``: see :meth:`secure`, which may also be called after construction.
        """
        if protocol not in PROTOCOLS:
            raise ConfigError(f"MQTT protocol {protocol!r} is not supported; use one of {sorted(PROTOCOLS)}.")
        self.broker = broker
        self.host, self.port = parse_broker(broker)
        self.tls = broker_uses_tls(broker)
        self._tls_ready = False
        self._refused: str | None = None  # the broker's last refusal (CONNACK reason)
        self.protocol = protocol
        self.receive_maximum = receive_maximum
        self.fleet = fleet
        self.client_id = client_id
        self.on_frame = on_frame
        self.max_frame_bytes = max_frame_bytes
        self.chunk_bytes = chunk_bytes
        self.rejected: deque[str] = deque(maxlen=1000)  # the latest reasons
        self.rejected_total = 0  # every rejection, also those the deque no longer holds
        # called with (where, reason) after each rejection, on the thread that rejected it (a
        # Prometheus counter, senseshield.runtime.metrics); must be quick and must not raise
        self.on_rejection: Callable[[str, str], None] | None = None
        self._subscriptions: set[str] = set()
        self.max_retained_bytes = 16 << 20  # brokers must accept messages this large
        self._retained: dict[str, bytes] = {}  # re-published after a reconnect (brokers forget)
        self._ever_connected = False
        # called (on the decoder thread, after every message of the previous connection) after
        # every reconnect, so services re-send what the broker may have lost; must be quick
        # and must not raise
        self.on_reconnect: Callable[[], None] | None = None
        # time.time() at which the message now handed to on_frame arrived (network thread)
        self.received_at = 0.0
        self.connected_at = 0.0  # time.time() of the latest (re)connection
        self._connected = threading.Event()  # connected *and* every subscription acknowledged
        self.connects = 0  # how many times the link became ready (1 + reconnects)
        self._pending_suback: int | None = None
        self._lock = threading.Lock()
        self._reassembler = Reassembler(max_bytes=max_frame_bytes)
        self._reassembly_lock = threading.Lock()  # the decoder adds, the service's thread expires
        self.stopping = stopping if stopping is not None else threading.Event()
        self.max_pending_bytes = max_pending_bytes
        # network thread -> decoder thread (closed: the decoder ends)
        self.memory_bytes = memory_bytes
        self._inbound = Backlog(memory_bytes)
        self.pending_peak = 0  # the most bytes ever waiting there (memory and file)
        self.dropped_inbound = 0  # messages dropped because the inbound queue was full
        self._drop_noted = 0.0  # monotonic time of the latest log line about drops
        self._decoder: threading.Thread | None = None
        self._client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=PROTOCOLS[protocol],
        )
        self._client.reconnect_delay_set(min_delay=1, max_delay=10)
        self._client.max_inflight_messages_set(max_inflight)
        self.max_inflight = max_inflight
        self._unacknowledged: deque = deque()  # fan-out messages not yet acknowledged (oldest first)
        if will is not None:
            self._client.will_set(topic(fleet, will[0]), will[1], qos=1, retain=True)
        self._client.on_connect = self._on_connect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        if any(v is not None for v in (ca_file, certfile, keyfile, username, password)):
            self.secure(ca_file=ca_file, certfile=certfile, keyfile=keyfile, username=username, password=password)

    def secure(
        self,
        *,
        ca_file: str | os.PathLike | None = None,
        certfile: str | os.PathLike | None = None,
        keyfile: str | os.PathLike | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        """TLS and credentials for this link; call before :meth:`start`.

        ``ca_file``: PEM CA certificate(s) that signed the broker's certificate (``mqtts://``
        only; the certificate's names are checked against the URL's host); ``certfile`` and
        ``keyfile``: an optional client certificate; ``username``/``password``: the
        credentials (paho ``username_pw_set``). Raises :class:`ConfigError`.
        """
        check_security(self.broker, ca_file=ca_file, certfile=certfile, keyfile=keyfile,
                       username=username, password=password)
        if ca_file is not None:
            try:
                ssl.create_default_context(cafile=str(ca_file))
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ConfigError(
                    f"The CA file {str(ca_file)!r} is not a PEM CA certificate ({_reason(exc)})."
                ) from None
            try:
                self._client.tls_set(
                    ca_certs=str(ca_file), certfile=None if certfile is None else str(certfile),
                    keyfile=None if keyfile is None else str(keyfile), cert_reqs=ssl.CERT_REQUIRED,
                    tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ConfigError(
                    f"The client certificate {str(certfile)!r} (key {str(keyfile)!r}) could not be "
                    f"loaded ({_reason(exc)}); give PEM files."
                ) from None
            self._tls_ready = True
        if username is not None:
            self._client.username_pw_set(username, password)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, *, timeout: float = 10.0) -> None:
        """Connect (paho keeps reconnecting afterwards); raise ConnectionError after ``timeout``."""
        if self.tls and not self._tls_ready:
            check_security(self.broker)  # mqtts:// without a CA: one sentence, no connection
        self._start_decoder()
        properties = None
        if self.receive_maximum is not None and self.protocol == "5":
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            properties = Properties(PacketTypes.CONNECT)
            properties.ReceiveMaximum = self.receive_maximum
        try:
            self._client.connect_async(self.host, self.port, keepalive=15, properties=properties)
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"Cannot reach broker {self.host}:{self.port}: {exc}.") from None
        self._client.loop_start()
        deadline = time.monotonic() + timeout
        # a refusal (bad credentials, not authorised) ends the wait at once: retrying won't help
        while (not self._connected.wait(WAIT_SLICE_S) and self._refused is None and not self.stopping.is_set()
               and time.monotonic() < deadline):
            pass
        if self.stopping.is_set() and not self._connected.is_set():
            return  # stopped while connecting: the caller sees its stop (stop() ends the threads)
        if not self._connected.is_set():
            self._client.disconnect()
            self._client.loop_stop()
            if self._refused is not None:
                raise ConnectionError(
                    f"Broker {self.host}:{self.port} refused the connection ({self._refused}); "
                    "check the username and password."
                )
            hint = (" (TLS: is the CA file the one that signed the broker's certificate, and does "
                    f"the certificate name {self.host}?)") if self.tls else ""
            raise ConnectionError(
                f"No connection to broker {self.host}:{self.port} within {timeout:g} s; is it running?{hint}"
            )

    def stop(self, timeout: float = 1.0) -> None:
        """Disconnect cleanly (no last will) and stop the network and decoder threads (what
        is still queued inbound is not handled), waiting at most ``timeout`` s for each."""
        connected = self._connected.is_set()
        self._client.disconnect()
        # loop_stop joins the network thread, which first writes what is queued (up to the
        # DISCONNECT): bounded, as a broker that stopped reading would hold it up for good;
        # without a connection there is nothing to write (the thread may sleep between
        # reconnection attempts, up to 1 s: not waited for)
        stopper = threading.Thread(target=self._client.loop_stop, name=f"link-stop-{self.client_id}", daemon=True)
        stopper.start()
        stopper.join(timeout if connected else min(timeout, 0.1))
        if stopper.is_alive() and connected:
            log.warning("%s: the network thread did not end within %g s; not waiting for it", self.client_id, timeout)
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            self._inbound.close()
            if decoder is not threading.current_thread():
                decoder.join(timeout)  # a daemon thread: a handler busy beyond that is not waited for

    def _start_decoder(self) -> None:
        if self._decoder is not None and self._decoder.is_alive():
            return
        if self._inbound.closed:  # stopped before: a fresh queue
            self._inbound = Backlog(self.memory_bytes)
        self._decoder = threading.Thread(target=self._decode_loop, name=f"link-decoder-{self.client_id}", daemon=True)
        self._decoder.start()

    @property
    def pending_bytes(self) -> int:
        """Bytes of received messages not yet decoded (the inbound queue, memory and file)."""
        return self._inbound.pending_bytes

    @property
    def closed(self) -> bool:
        """Whether the link was stopped (its inbound queue closed)."""
        return self._inbound.closed

    @property
    def pending_memory_peak(self) -> int:
        """The most bytes of received messages ever held in memory at once (not yet decoded)."""
        return self._inbound.memory_peak

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    # -- messaging ----------------------------------------------------------------------
    def subscribe(self, suffix: str) -> None:
        """Subscribe to ``ss/v1/<fleet>/<suffix>`` (wildcards allowed); kept across reconnects."""
        full = topic(self.fleet, suffix)
        with self._lock:
            self._subscriptions.add(full)
        if self._client.is_connected():  # also between CONNACK and SUBACK (a repeat is harmless)
            self._client.subscribe(full, qos=1)

    def unsubscribe(self, suffix: str) -> None:
        """Stop receiving ``ss/v1/<fleet>/<suffix>`` (and stop re-subscribing after reconnects)."""
        full = topic(self.fleet, suffix)
        with self._lock:
            self._subscriptions.discard(full)
        if self._client.is_connected():
            self._client.unsubscribe(full)

    def publish(self, suffix: str, frame: bytes, *, retain: bool = False, timeout: float = 30.0,
                wait: bool = True) -> bool:
        """Publish a frame at QoS 1, chunked if larger than ``chunk_bytes``; wait for PUBACKs
        (``wait=False``: hand the frame to paho's queue and return, for fan-outs such as a
        round's plans, where one round trip per message would add up; QoS 1 still delivers).

        Returns False when the broker is unreachable right now (the message stays queued).
        A retained frame is remembered and re-published after every reconnect.
        """
        # never send what we'd refuse (checked over views of the frame: no copy of it)
        decoded = decode_frame(frame, max_bytes=self.max_frame_bytes, views=True)
        sender, round_ = decoded.sender, decoded.round
        del decoded
        parts = iter_chunks(frame, limit=self.chunk_bytes, fleet=self.fleet, sender=sender, round=round_)
        if retain and len(frame) > self.chunk_bytes:
            # a retained message must be one MQTT message (a late subscriber gets only the
            # last retained payload of a topic); up to max_retained_bytes it goes unchunked
            if len(frame) > self.max_retained_bytes:
                raise ValueError(
                    f"A retained message of {len(frame):,} bytes exceeds the limit of "
                    f"{self.max_retained_bytes:,} bytes."
                )
            parts = iter([frame])
        if retain:
            with self._lock:
                self._retained[suffix] = frame
        end = time.monotonic() + timeout
        infos, window = [], deque()
        for part in parts:
            info = self._client.publish(topic(self.fleet, suffix), part, qos=1, retain=retain)
            if not wait:
                self._bound_unacknowledged([info])
                continue
            infos.append(info)
            window.append(info)
            self._bound_window(window, CHUNK_WINDOW, end)
        if not wait:
            return True
        try:
            return self._wait_published(infos, max(0.0, end - time.monotonic()))
        except RuntimeError as exc:
            # not connected: paho keeps QoS 1 messages queued and sends them after the
            # reconnect; the services also re-send their state then (on_reconnect)
            log.warning("%s: publish to %s deferred (%s)", self.client_id, suffix, exc)
            return False

    def _bound_unacknowledged(self, infos: list) -> None:
        """A fan-out (``wait=False``) keeps at most ``max_inflight`` x 2 messages queued in
        paho (each a few KB with its packet): past that it waits for the oldest one's PUBACK,
        so a round's plans to 10,000 devices do not sit in memory at once. Not while the link
        is down (paho keeps them for the reconnect) or stopping."""
        self._unacknowledged.extend(infos)
        self._bound_window(self._unacknowledged, 2 * self.max_inflight)

    def _bound_window(self, pending: deque, most: int, end: float | None = None) -> None:
        """Wait until at most ``most`` of the messages in ``pending`` (oldest first) await
        their PUBACK, dropping the settled ones: a large frame's chunks are made as the broker
        takes them, so paho never holds a second copy of the whole frame. Not while the link
        is down (paho keeps them for the reconnect), stopping, or past ``end`` (monotonic)."""
        while pending and _settled(pending[0]):
            pending.popleft()
        while (len(pending) > most and self._connected.is_set() and not self.stopping.is_set()
               and (end is None or time.monotonic() < end)):
            try:
                pending[0].wait_for_publish(WAIT_SLICE_S)
            except (RuntimeError, ValueError):
                pass  # settled below
            while pending and _settled(pending[0]):
                pending.popleft()

    def _wait_published(self, infos: list, timeout: float) -> bool:
        """Wait for the broker's PUBACK of every message, in slices: False once ``timeout``
        passed or the link is stopping (the messages stay queued in paho)."""
        end = time.monotonic() + timeout
        for info in infos:
            while not info.is_published():
                left = end - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    return False
                info.wait_for_publish(min(WAIT_SLICE_S, left))
        return True

    def clear_retained(self, suffix: str) -> None:
        with self._lock:
            self._retained.pop(suffix, None)
        try:
            self._wait_published([self._client.publish(topic(self.fleet, suffix), b"", qos=1, retain=True)], 10.0)
        except RuntimeError as exc:  # not connected: paho sends the queued QoS 1 message after the reconnect
            log.warning("%s: clearing %s deferred (%s)", self.client_id, suffix, exc)

    # -- paho callbacks (network thread; must never raise) --------------------------------
    # VERSION2 callbacks get a ReasonCode for MQTT 5 and for 3.1.1 alike (paho maps the 3.1.1
    # CONNACK return code / socket error onto it), so one implementation serves both.
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            self._refused = str(reason_code)
            log.warning("%s: broker refused the connection: %s", self.client_id, reason_code)
            return
        self._refused = None
        with self._lock:
            subscriptions = sorted(self._subscriptions)
        if not subscriptions:
            self._ready(client)
            return
        # ready only once the broker has acknowledged every subscription: a frame published
        # between CONNACK and SUBACK would otherwise be lost for this link (and a peer told
        # "connected" would send it)
        result, mid = client.subscribe([(full, 1) for full in subscriptions])
        if result != mqtt.MQTT_ERR_SUCCESS:  # the connection dropped again; paho reconnects
            return
        with self._lock:
            self._pending_suback = mid

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        with self._lock:
            if mid != self._pending_suback:
                return  # a subscribe() made while connected
            self._pending_suback = None
        failed = [str(rc) for rc in reason_codes if rc.is_failure]
        if failed:
            log.warning("%s: the broker refused a subscription (%s)", self.client_id, ", ".join(failed))
        self._ready(client)

    def _ready(self, client) -> None:  # noqa: ANN001
        """Connected and subscribed: re-publish retained frames, run the reconnect hook."""
        self.connects += 1
        self.connected_at = time.time()  # what arrived before it came over the previous connection
        self._connected.set()
        if self._ever_connected:
            with self._lock:
                retained = list(self._retained.items())
            for suffix, frame in retained:
                client.publish(topic(self.fleet, suffix), frame, qos=1, retain=True)
            self._inbound.put(RECONNECTED)  # after what arrived over the previous connection
        self._ever_connected = True

    def _on_connect_fail(self, client, userdata) -> None:  # noqa: ANN001
        # socket or TLS handshake failure (e.g. a certificate that does not verify); paho retries
        log.debug("%s: connecting to %s:%s failed; retrying", self.client_id, self.host, self.port)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._connected.clear()
        with self._lock:
            self._pending_suback = None
        if reason_code.value != 0:
            log.warning("%s: connection lost (%s); reconnecting", self.client_id, reason_code)

    def _on_message(self, client, userdata, message) -> None:  # noqa: ANN001
        # network thread: queue and return (paho acknowledges the message when this returns);
        # never decode or wait here, so the broker's queue toward this client drains
        payload = message.payload
        if not payload:  # a cleared retained message
            return
        size, waiting = len(payload), self._inbound.pending_bytes
        if waiting + size > self.max_pending_bytes and waiting > 0:
            self._drop_inbound(message.topic, size)
            return
        try:
            self._inbound.put(MESSAGE, message.topic, payload, time.time())
        except OSError as exc:  # the temporary file cannot take it (disk full)
            self._drop_inbound(message.topic, size, why=f"its temporary file cannot take more ({exc.strerror or exc})")
            return
        self.pending_peak = max(self.pending_peak, waiting + size)

    def _drop_inbound(self, where: str, size: int, why: str = "") -> None:
        with self._lock:
            self.dropped_inbound += 1
            now = time.monotonic()
            say = now - self._drop_noted >= DROP_NOTE_S
            if say:
                self._drop_noted = now
        if say:
            log.warning("%s: inbound queue full (%d bytes waiting, limit %d%s): dropped a message of %d bytes on %s "
                        "(%d dropped so far; its sender re-sends what is not answered)", self.client_id,
                        self._inbound.pending_bytes, self.max_pending_bytes, f"; {why}" if why else "", size, where,
                        self.dropped_inbound)
        self.note_rejection(where, "inbound queue full")

    def _decode_loop(self) -> None:
        """The decoder thread: reassemble and decode what the network thread queued, in
        order, and hand each frame to ``on_frame``; never raises."""
        while True:
            entry = self._inbound.get()
            if entry is None:  # closed
                return
            if entry.kind == RECONNECTED:
                if self.on_reconnect is not None:
                    try:
                        self.on_reconnect()
                    except Exception:  # noqa: BLE001
                        log.exception("%s: reconnect hook failed", self.client_id)
                continue
            full_topic, payload, self.received_at = entry.topic, entry.payload, entry.when
            try:
                self._handle(full_topic, payload)
            except Exception:  # noqa: BLE001 - the decoder must survive anything
                log.exception("%s: decoding a message on %s failed", self.client_id, full_topic)
                self.note_rejection(full_topic, "decoder error")

    def _handle(self, full_topic: str, payload: bytes) -> None:
        try:
            frame = decode_frame(payload, max_bytes=self.max_frame_bytes)
            if frame.fleet != self.fleet:
                raise ProtocolError(f"Frame is for fleet {frame.fleet!r}, not {self.fleet!r}.")
            if frame.schema == CHUNK_SCHEMA:
                with self._reassembly_lock:
                    dropped = self._reassembler.dropped
                    try:
                        whole = self._reassembler.add(frame)
                    finally:
                        self._note_dropped(full_topic, dropped)
                if whole is None:
                    return
                frame = decode_frame(whole, max_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            self._reject(full_topic, str(exc))
            return
        try:
            self.on_frame(full_topic, frame)
        except ProtocolError as exc:
            self._reject(full_topic, str(exc))
        except Exception:  # a handler bug must not kill the decoder thread
            log.exception("%s: handler failed on %s", self.client_id, full_topic)
            self.note_rejection(full_topic, "handler error")

    def _reject(self, where: str, reason: str) -> None:
        log.warning("%s: rejected message on %s: %s", self.client_id, where, reason)
        self.note_rejection(where, reason)

    def note_rejection(self, where: str, reason: str) -> None:
        """Count one rejected message and keep its reason (the latest 1,000 reasons)."""
        with self._lock:
            self.rejected.append(f"{where}: {reason}")
            self.rejected_total += 1
        if self.on_rejection is not None:
            self.on_rejection(where, reason)

    def expire_partials(self) -> None:
        """Drop incomplete chunk streams that have been idle too long (call now and then)."""
        with self._reassembly_lock:
            dropped = self._reassembler.dropped
            self._reassembler.expire()
            self._note_dropped("chunks", dropped)

    def _note_dropped(self, where: str, before: int) -> None:
        n = self._reassembler.dropped - before
        if n:
            self._reject(where, f"{n} incomplete chunk stream(s) dropped (reassembly buffer full or idle)")
