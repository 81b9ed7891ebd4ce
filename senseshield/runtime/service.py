"""The event loop the three fleet services share: one MQTT link, handlers on one thread.

paho's network thread only queues what arrives (:class:`~senseshield.runtime.transport.Link`),
so the broker's queue toward the service drains at network speed; the link's decoder thread
decodes each message (every envelope, signature and schema check of
:mod:`senseshield.runtime.protocol`, so a bad frame is rejected before it is queued) and
queues typed messages. The service's own thread takes them in order and calls the handler
registered for the message class, so handlers never race and long work (training,
decryption) never blocks the network thread's keepalives. The decoded messages waiting for
the service's thread hold at most :data:`DECODED_BYTES` of payload (one message more if it
alone is larger): beyond that the decoder waits, and what arrives meanwhile waits
undecoded in the link's queue, which keeps all but its first few MB in a temporary file.
However many devices send at once, what waits costs the process a bounded amount of memory.

A handler that raises :class:`ProtocolError`, :class:`ConfigError` or
:class:`KeyMismatchError` rejects that one message: the reason is logged and kept in
``rejected`` (the latest 1,000; ``rejected_total`` counts all), and the service carries on.
Any other exception is logged with its traceback and the service carries on too: one
message never stops a service. The one exception is :class:`StorageError` (a file the
service must keep could not be written): going on would leave rounds unsaved, so it ends
the service's loop and the CLI stops the service with one sentence (exit 74). The
services' own loop steps (closing a round, joining a run, training) run under the same
:meth:`Service.guard`.

Liveness: every service has a retained status topic (``agents/<id>/status``,
``coordinator/status``, ``keyserver/status``) with an "offline" last will, and
:meth:`Service.watch` follows a peer's: the service logs when the peer goes offline, what
it waits for (again every :data:`WAIT_REMINDER_S` s) and when it is back, and a hook may
act on it (the coordinator re-sends pending aggregate requests to a key server that is back).

Stopping: SIGTERM or SIGINT sets :attr:`Service.stopping`, which every loop checks; a service
whose work may be abandoned (the agent: local training, evaluation) sets
:attr:`Service.abandon_work`, and a signal then ends that work at once by raising
:class:`Stopped` in its thread, so a stop never waits for a round. Once the service has
said goodbye and disconnected, :func:`leave` ends the process at once, without waiting for
worker threads still busy with work the stop abandoned (a key server's decryption). The
link shares the :attr:`Service.stopping` event: connecting and waiting for the broker's
acknowledgement end at once on a stop (a broker that is down or a full queue toward it
never holds a stop up), and the goodbye waits at most :data:`GOODBYE_S` s. Every service
exits within 2 s of SIGTERM in any state (tests/test_liveness.py measures it).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from senseshield.errors import ConfigError, KeyMismatchError, ProtocolError, StorageError
from senseshield.runtime.protocol import Frame
from senseshield.runtime.protocol.envelope import DEFAULT_MAX_FRAME_BYTES
from senseshield.runtime.identity import Identity, Trust, check_frame
from senseshield.runtime.keyfiles import writable_dir  # noqa: F401 - re-exported for the roles
from senseshield.runtime.protocol.messages import Message, Status, from_frame, to_frame
from senseshield.runtime.transport import PREFIX, Link

M = TypeVar("M", bound=Message)

WAIT_REMINDER_S = 60.0
"""While a watched peer is offline, a service repeats what it waits for this often."""

GOODBYE_S = 0.5
"""How long a stopping service waits for the broker to take its "offline" status."""

WAIT_NOTE_S = 2.0
"""A wait that lasts longer than this is said in the log, once (:class:`WaitNote`)."""

DECODED_BYTES = 2 << 20
"""Most payload bytes of decoded messages waiting for the service's thread (the decoder waits
beyond: see the module docstring)."""


class WaitNote:
    """Says in the log what a service waits for and why, once, when the wait has lasted
    :data:`WAIT_NOTE_S` s (short waits stay quiet; a long one is one line, not one per loop)."""

    def __init__(self, log: logging.Logger, what: str, *, after: float = WAIT_NOTE_S) -> None:
        self.log, self.what, self.after = log, what, after
        self.since = time.monotonic()
        self.said = False

    def check(self) -> None:
        if not self.said and time.monotonic() - self.since >= self.after:
            self.said = True
            self.log.info("waiting for %s", self.what)


class Backoff:
    """When to send again something that was not answered: ``first`` s after it was sent,
    then twice as long after each repeat, at most ``cap`` s apart; every delay is drawn
    uniformly from half to one and a half times its nominal value, so devices that sent
    together (a fleet's hellos, a round's updates) do not repeat together. Inactive until
    :meth:`arm`; :meth:`disarm` once answered."""

    def __init__(self, first: float, cap: float, rng: random.Random | None = None) -> None:
        self.first, self.cap = first, cap
        self.rng = rng if rng is not None else random.Random()
        self.at: float | None = None  # when to repeat (time.monotonic()); None: inactive
        self.repeats = 0
        self._delay = first

    @property
    def armed(self) -> bool:
        return self.at is not None

    def arm(self, now: float | None = None, *, first: float | None = None) -> None:
        """Sent (again from the start): the first repeat is due ``first`` (default: the
        backoff's) s from now, jittered."""
        now = time.monotonic() if now is None else now
        self.repeats = 0
        self._delay = self.first if first is None else first
        self.at = now + self._jittered(self._delay)

    def disarm(self) -> None:
        self.at = None

    def due(self, now: float | None = None) -> bool:
        """True (and the next repeat scheduled, twice as far) when a repeat is due now."""
        if self.at is None:
            return False
        now = time.monotonic() if now is None else now
        if now < self.at:
            return False
        self.repeats += 1
        self._delay = min(max(self._delay, self.first) * 2, self.cap)
        self.at = now + self._jittered(self._delay)
        return True

    def _jittered(self, delay: float) -> float:
        return delay * self.rng.uniform(0.5, 1.5)


class Stopped(BaseException):
    """SIGTERM or SIGINT while :attr:`Service.abandon_work` is set: the work is
    abandoned (a BaseException, so no handler's ``except Exception`` swallows it)."""


@dataclass
class Peer:
    """A service another one depends on, followed through its retained status topic."""

    name: str  # its client id; the status topic is ``<name>/status``
    on_change: Callable[[bool], None] | None = None
    online: bool | None = None  # None: no status seen yet
    since: float = 0.0  # when the latest change was seen (this clock)
    reminded: float = 0.0

    @property
    def topic(self) -> str:
        return f"{self.name}/status"


@dataclass(frozen=True)
class Inbound:
    """A decoded message with where it came from (topic suffix inside the fleet's tree)."""

    suffix: str
    frame: Frame
    message: Message
    received: float  # time.time() on arrival

    @property
    def round(self) -> int:
        return self.frame.round

    @property
    def sender(self) -> str:
        return self.frame.sender

    @cached_property
    def nbytes(self) -> int:
        """Payload bytes of the message (its binary sections; summed once)."""
        return sum(len(v) if isinstance(v, bytes) else v.nbytes for v in self.frame.sections.values())


_RECONNECTED = object()


@dataclass(frozen=True)
class _Call:
    """Work a background thread hands back to the service's thread (:meth:`Service.call_soon`)."""

    where: str
    fn: Callable[[], None]


class Service:
    """Base of the key server, the coordinator and the edge agent."""

    def __init__(
        self,
        broker: str,
        *,
        fleet: str,
        client_id: str,
        logger: logging.Logger,
        protocol: str = "5",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        status_topic: str | None = None,
        identity: Identity | None = None,
        trust: Trust | None = None,
        role: str = "agent",
    ) -> None:
        """TLS and credentials: call ``self.link.secure(...)`` before :meth:`start` (the CLIs
        do), so the security options are defined once, on :class:`Link`.

        ``identity`` signs every frame this service sends (default: a fresh one, for tests
        and development); ``trust`` decides whose frames it accepts (default: trust on first
        use, which warns). A trust file that pins another key for this service's own name
        stops it here."""
        self.fleet = fleet
        self.name = client_id
        self.log = logger
        self.identity = identity if identity is not None else Identity.generate(client_id)
        if trust is None:
            logger.warning("%s: no --trust file: trusting every sender's key on first use (development only)",
                           client_id)
            trust = Trust(fleet=fleet, tofu=True)
        self.trust = trust
        own = trust.principals.get(client_id)
        if own is None:
            trust.add(self.identity.principal(role))
        elif own.sign is not None and own.sign != self.identity.sign_key:
            raise ConfigError(f"The trust file pins another key for {client_id!r} than its identity "
                              f"({self.identity.fingerprint}); give the matching --identity or update the trust file.")
        # SimpleQueue: its put is reentrant, so the signal handler may put while the service's
        # thread is inside get (queue.Queue's lock is not: a SIGTERM there deadlocked the service)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # payload bytes of the decoded messages in _queue, and the decoder's wait for room
        self._queued_bytes = 0
        self._room = threading.Condition(threading.Lock())
        self.queued_peak = 0  # the most payload bytes ever waiting there
        self._handlers: dict[type[Message], Callable[[Inbound], None]] = {}
        self.stopping = threading.Event()
        self.stop_signal: int | None = None  # the SIGTERM/SIGINT that stopped it (see leave)
        self.abandon_work = False  # True: a signal ends the service thread's work at once (Stopped)
        # called on the service's thread with each inbound message once it is handled (or rejected)
        self.after_message: Callable[[Inbound], None] | None = None
        self.status_topic = status_topic
        self.peers: dict[str, Peer] = {}  # status topic -> watched peer
        will = None
        if status_topic is not None:
            will = (status_topic, self.frame(Status(online=False)))
        self.link = Link(
            broker, client_id=client_id, fleet=fleet, on_frame=self._on_frame, will=will,
            protocol=protocol, max_frame_bytes=max_frame_bytes, stopping=self.stopping,
        )
        self.link.on_reconnect = lambda: self._queue.put(_RECONNECTED)
        # one list of rejections: the link's (envelope, chunking, schema) and the handlers'
        self.rejected: deque[str] = self.link.rejected

    # -- wiring ---------------------------------------------------------------------------
    def on(self, cls: type[M], handler: Callable[[Inbound], None]) -> None:
        """Call ``handler`` for every accepted message of class ``cls``."""
        self._handlers[cls] = handler

    def watch(self, name: str, on_change: Callable[[bool], None] | None = None) -> None:
        """Follow service ``name``'s status (``<name>/status``, retained, its last will when it
        dies): log when it goes offline and what this service waits for, and call
        ``on_change(online)`` on every change. Call before :meth:`start`."""
        peer = Peer(name, on_change)
        self.peers[peer.topic] = peer

    def peer_online(self, name: str) -> bool | None:
        """Whether watched peer ``name`` is online (None: no status seen yet)."""
        return self.peers[f"{name}/status"].online

    def frame(self, message: Message, *, round: int = 0, pieces: dict[str, list[bytes]] | None = None) -> bytes:
        """``message`` as a frame signed by this service (``pieces``: see :func:`to_frame`)."""
        return to_frame(message, fleet=self.fleet, sender=self.name, round=round, signer=self.identity, pieces=pieces)

    def send(self, suffix: str, message: Message, *, round: int = 0, retain: bool = False, wait: bool = True) -> int:
        """Publish ``message``; returns the frame's size in bytes (``wait=False``: do not wait
        for the broker's acknowledgement, see :meth:`Link.publish`)."""
        frame = self.frame(message, round=round)
        self.link.publish(suffix, frame, retain=retain, wait=wait)
        return len(frame)

    def start(self, subscriptions: list[str], *, timeout: float = 30.0) -> None:
        for suffix in [*subscriptions, *self.peers]:
            self.link.subscribe(suffix)
        self.log.info("%s: connecting to %s", self.name, self.link.broker)
        self.link.start(timeout=timeout)
        if self.stopping.is_set():
            return  # stopped while connecting: the caller's loop ends at once
        self.log.info("%s: connected to %s", self.name, self.link.broker)
        if self.status_topic is not None:
            self.send(self.status_topic, Status(online=True), retain=True)

    def stop(self) -> None:
        """Say goodbye (status offline) and disconnect."""
        if self.status_topic is not None and self.link.connected:
            try:
                frame = self.frame(Status(online=False))
                # the wait must end even when stopping (the link's waits do): the broker's
                # acknowledgement, up to GOODBYE_S
                self.link.stopping = threading.Event()
                self.link.publish(self.status_topic, frame, retain=True, timeout=GOODBYE_S)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            finally:
                self.link.stopping = self.stopping
        self.link.stop()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT end the loop cleanly (main thread only); with
        :attr:`abandon_work` set they end the work in hand at once (:class:`Stopped`)."""
        def _stop(signum, frame):  # noqa: ANN001
            # runs in the service's thread between two bytecodes, even inside this handler: a
            # later signal returns before taking any lock (the Event's is not reentrant)
            if self.stop_signal is not None:
                return
            self.stop_signal = signum
            self.stopping.set()
            self._queue.put(None)
            self.log.info("%s: signal %d, stopping", self.name, signum)
            if self.abandon_work:
                raise Stopped()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)

    # -- the loop -------------------------------------------------------------------------
    def pump(self, timeout: float) -> bool:
        """Handle at most one queued message, waiting up to ``timeout`` s; False if none."""
        self.link.expire_partials()
        self._remind()
        self.guard("tick", self.tick)
        try:
            item = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if item is None:
            return False
        if isinstance(item, _Call):
            self.guard(item.where, item.fn)
            return True
        if item is _RECONNECTED:
            self.log.info("%s: reconnected to the broker; re-sending state", self.name)
            self.guard("reconnect", self.on_reconnect)
            return True
        with self._room:
            self._queued_bytes -= item.nbytes
            self._room.notify()
        peer = self.peers.get(item.suffix)
        handler = self._handlers.get(type(item.message))
        if peer is not None and isinstance(item.message, Status):
            self.guard(item.suffix, lambda: self._on_peer_status(peer, item))
        elif handler is None:
            self.reject(item.suffix, f"{item.message.schema_name!r} is not expected here")
        else:
            self.guard(item.suffix, lambda: handler(item))
        if self.after_message is not None:
            self.after_message(item)
        return True

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None, *,
                   waiting: str | None = None) -> bool:
        """Handle messages until ``predicate()`` holds (True), ``timeout`` passes or a stop
        (False). ``waiting``: what is awaited and why, logged once if the wait lasts
        :data:`WAIT_NOTE_S` s."""
        end = None if timeout is None else time.monotonic() + timeout
        note = WaitNote(self.log, waiting) if waiting else None
        while not predicate():
            if self.stopping.is_set():
                return False
            if note is not None:
                note.check()
            left = 0.5 if end is None else min(0.5, end - time.monotonic())
            if end is not None and left <= 0:
                return predicate()
            self.pump(left)
        return True

    def drain(self) -> None:
        """Handle everything already queued without waiting."""
        while self.pump(0):
            pass

    def call_soon(self, where: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the service's thread, in turn with the messages, under :meth:`guard`
        (thread-safe: background work hands its result back this way)."""
        self._queue.put(_Call(where, fn))

    def on_reconnect(self) -> None:
        """Re-send what the broker may have lost (subclasses)."""

    def tick(self) -> None:
        """Called on the service's thread before each message it waits for (at least every
        0.5 s while it waits): timed work such as re-sending what was not answered
        (subclasses; must be quick)."""

    def reject(self, where: str, reason: str) -> None:
        self.log.warning("%s: rejected message on %s: %s", self.name, where, reason)
        self.link.note_rejection(where, reason)

    # -- peers ----------------------------------------------------------------------------
    def _on_peer_status(self, peer: Peer, item: Inbound) -> None:
        if item.sender != peer.name:
            raise ProtocolError(f"Status of {peer.name} from {item.sender!r}; only {peer.name} may publish it.")
        online = item.message.online  # type: ignore[attr-defined]
        if online == peer.online:
            return
        was, peer.online, peer.since, peer.reminded = peer.online, online, item.received, item.received
        if online and was is False:
            self.log.info("%s: %s is back online", self.name, peer.name)
        elif not online:
            self.log.warning("%s: %s offline since %s; waiting for it to come back",
                             self.name, peer.name, time.strftime("%H:%M:%S", time.localtime(peer.since)))
        if peer.on_change is not None:
            peer.on_change(online)

    def _remind(self) -> None:
        now = time.time()
        for peer in self.peers.values():
            if peer.online is False and now - peer.reminded >= WAIT_REMINDER_S:
                peer.reminded = now
                self.log.warning("%s: still waiting for %s (offline since %s, %.0f s)", self.name, peer.name,
                                 time.strftime("%H:%M:%S", time.localtime(peer.since)), now - peer.since)

    @property
    def rejected_total(self) -> int:
        """Every message rejected so far (``rejected`` keeps the latest 1,000 reasons)."""
        return self.link.rejected_total

    def guard(self, where: str, fn: Callable[[], None]) -> bool:
        """Run one handler or loop step; an exception rejects/logs it and the service goes
        on. True if ``fn`` finished. A :class:`StorageError` is raised on: the service stops."""
        try:
            fn()
            return True
        except StorageError:
            raise
        except (ProtocolError, ConfigError, KeyMismatchError) as exc:
            self.reject(where, str(exc))
        except Exception:  # noqa: BLE001 - one message never stops a service
            self.log.exception("%s: failed handling %s", self.name, where)
            self.link.note_rejection(where, "internal error")
        return False

    # -- internals ------------------------------------------------------------------------

    def _on_frame(self, full_topic: str, frame: Frame) -> None:
        # the link's decoder thread: check the signature, decode into the typed message
        # (raises ProtocolError -> Link rejects)
        check_frame(self.trust, frame)
        message = from_frame(frame)
        if not message.keeps_raw:
            frame.release_signed()  # checked: the received bytes go, the decoded sections stay
        suffix = full_topic.removeprefix(f"{PREFIX}/{self.fleet}/")
        item = Inbound(suffix, frame, message, self.link.received_at or time.time())
        size = item.nbytes
        with self._room:  # room for it (one message is always let in): the service's thread makes it
            while self._queued_bytes and self._queued_bytes + size > DECODED_BYTES and not self._closing():
                self._room.wait(0.1)
            self._queued_bytes += size
            self.queued_peak = max(self.queued_peak, self._queued_bytes)
        self._queue.put(item)

    def _closing(self) -> bool:
        """Whether the service is stopping or its link stopped (a decoder waiting for room gives up)."""
        return self.stopping.is_set() or self.link.closed


def leave(service: Service, code: int = 0) -> None:
    """After a service stopped on a signal (it said goodbye, disconnected, and every file it
    keeps is written atomically): end the process now with ``code``, its log flushed. Python
    would otherwise wait for worker threads busy with work the stop abandoned (a decryption)
    and then tear down torch and onnxruntime (about 0.9 s on an idle x86 core). Without a
    signal it returns, and the process exits as usual."""
    if service.stop_signal is None:
        return
    busy = [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if busy:
        service.log.info("%s: stopped; not waiting for %s", service.name, ", ".join(sorted(busy)))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def agent_of(suffix: str) -> str | None:
    """The agent id in ``agents/<id>/...``, else None."""
    parts = suffix.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == "agents" else None


def check_sender(item: Inbound) -> str:
    """An agent may only speak on its own topics: the frame's sender must match the topic."""
    agent = agent_of(item.suffix)
    if agent is None or agent != item.sender:
        raise ProtocolError(f"Sender {item.sender!r} may not publish on {item.suffix!r}.")
    return agent
