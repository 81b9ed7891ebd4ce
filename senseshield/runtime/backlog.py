"""A first-in first-out queue of received messages that holds at most a fixed number of bytes
in memory and keeps the rest in a temporary file (:class:`Backlog`).

A service's MQTT link takes every message off the network at once (so the broker's queue
toward it drains), and its decoder works through them at its own pace. When a whole fleet's
updates arrive faster than they are handled, what waits is a fleet's worth of updates: held
in memory it grows with the fleet. A :class:`Backlog` holds up to ``memory_bytes`` of them in
memory; beyond that it appends them to a file (unnamed, in the temporary directory, gone when
the process ends or the backlog is closed) and reads them back in order once the ones in
memory are taken. Once it has started writing to the file every later message goes there
too, until the file is read to its end (then it is emptied), so the order is always the
order of arrival.

Each entry is a kind (a small integer the caller defines, e.g. "a message" or "reconnected"),
a topic, a payload and a time. One producer and one consumer thread may use it at once (any
number, in fact: every method takes the one lock). The file holds received frames as they
arrived (signed, and for the masked scheme masked); it is private to the process (mode 0600,
unlinked at creation).
"""

from __future__ import annotations

import os
import struct
import tempfile
import threading
from collections import deque
from typing import NamedTuple

_HEAD = struct.Struct("<BdII")  # kind, time, topic bytes, payload bytes


class Entry(NamedTuple):
    """One entry of a :class:`Backlog`."""

    kind: int
    topic: str
    payload: bytes
    when: float


class Backlog:
    """A FIFO of :class:`Entry` holding at most ``memory_bytes`` of payloads in memory (one
    entry more if it alone is larger), the rest in a temporary file (in ``$TMPDIR``). See the
    module docstring."""

    def __init__(self, memory_bytes: int) -> None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes={memory_bytes} is not allowed; give 0 or more.")
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._memory: deque[Entry] = deque()
        self._in_memory = 0  # payload bytes of the entries in memory
        self._fd: int | None = None  # the spill file (created on first need)
        self._write_at = 0  # where the next spilled entry goes
        self._read_at = 0  # where the oldest spilled entry starts
        self._spilled = 0  # entries in the file not yet read
        self._on_disk = 0  # payload bytes of those entries
        self._closed = False
        self.spilled_total = 0  # entries ever written to the file
        self.memory_peak = 0  # the most payload bytes ever held in memory at once

    # ---- what it holds ------------------------------------------------------------------
    @property
    def pending_bytes(self) -> int:
        """Payload bytes waiting (in memory and in the file)."""
        return self._in_memory + self._on_disk

    @property
    def memory(self) -> int:
        """Payload bytes waiting in memory."""
        return self._in_memory

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __len__(self) -> int:
        return len(self._memory) + self._spilled

    # ---- producer and consumer ----------------------------------------------------------
    def put(self, kind: int, topic: str = "", payload: bytes = b"", when: float = 0.0) -> None:
        """Append an entry (in memory if it fits and nothing waits in the file, else to the
        file). OSError if the file cannot be written (the entry is then not queued)."""
        entry = Entry(kind, topic, bytes(payload), when)
        size = len(entry.payload)
        with self._lock:
            if self._closed:
                return
            if self._spilled == 0 and (self._in_memory + size <= self.memory_bytes or not self._memory):
                self._memory.append(entry)
                self._in_memory += size
                self.memory_peak = max(self.memory_peak, self._in_memory)
            else:
                self._spill(entry)
            self._ready.notify()

    def get(self, timeout: float | None = None) -> Entry | None:
        """The oldest entry, waiting up to ``timeout`` s (None: until there is one); None when
        the wait ended without one or the backlog is closed."""
        with self._lock:
            if not self._ready.wait_for(lambda: self._closed or self._memory or self._spilled, timeout):
                return None
            if self._closed:
                return None
            if self._memory:
                entry = self._memory.popleft()
                self._in_memory -= len(entry.payload)
                return entry
            return self._unspill()

    def close(self) -> None:
        """End it: a waiting :meth:`get` returns None at once, later ones too; what waits is
        dropped and the file closed."""
        with self._lock:
            self._closed = True
            self._memory.clear()
            self._in_memory = self._on_disk = self._spilled = 0
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._ready.notify_all()

    # ---- the file (under the lock) ------------------------------------------------------
    def _spill(self, entry: Entry) -> None:
        if self._fd is None:
            handle = tempfile.TemporaryFile(prefix="senseshield-backlog-")
            self._fd = os.dup(handle.fileno())
            handle.close()
        topic = entry.topic.encode()
        record = _HEAD.pack(entry.kind, entry.when, len(topic), len(entry.payload)) + topic + entry.payload
        written = 0
        while written < len(record):
            written += os.pwrite(self._fd, memoryview(record)[written:], self._write_at + written)
        self._write_at += len(record)
        self._spilled += 1
        self._on_disk += len(entry.payload)
        self.spilled_total += 1

    def _read(self, n: int) -> bytes:
        data = os.pread(self._fd, n, self._read_at)
        while len(data) < n:  # a short read: go on where it stopped
            more = os.pread(self._fd, n - len(data), self._read_at + len(data))
            if not more:
                raise OSError(f"the backlog file ended {n - len(data)} bytes early")
            data += more
        self._read_at += n
        return data

    def _unspill(self) -> Entry:
        kind, when, topic_len, payload_len = _HEAD.unpack(self._read(_HEAD.size))
        topic = self._read(topic_len).decode()
        payload = self._read(payload_len)
        self._spilled -= 1
        self._on_disk -= payload_len
        if self._spilled == 0:  # read to its end: empty it (the next spill starts at 0)
            os.ftruncate(self._fd, 0)
            self._write_at = self._read_at = 0
        return Entry(kind, topic, payload, when)
