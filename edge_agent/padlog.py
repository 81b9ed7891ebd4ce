"""A device's record of every (job, round) it has masked in: no pad is used twice.

A one-time pad is safe only once. The pads of a contribution are derived in a context the
coordinator cannot choose (fleet, the operator-signed job nonce, round, cluster, plan digest
and ring: :func:`senseshield.he.base.round_context`, :func:`senseshield.he.masked.pad_key`),
but a coordinator may still ask a device for a round it has already sent: re-announce the
job after a ``cancelled`` notice, re-send its plan after the device restarted, and so on.
Two different vectors masked with the same pad give their difference to whoever sees both.

So before an encrypted update leaves the device, the device appends one line to this file
and fsyncs it: the round's slot (SHA-256 of fleet, job and round), the context its pads were
derived in and the SHA-256 of the ciphertext sent (the slot names the agent too, and each
identity has its own file, ``pads-used-ID.log``). A slot is used once: the same ciphertext
may be sent again (a re-sent plan gets the saved frame), a different one never
(:meth:`PadLog.refusal`), across cancels, new jobs and restarts. The file keeps no secret
(digests only), is 0600 beside the device's identity, and grows by 147 bytes a round.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from senseshield.errors import ConfigError

def file_name(agent_id: str) -> str:
    """The pad log's file name of agent ``agent_id`` (one file per identity: ``fleet up`` keeps
    every local agent's identity in one folder)."""
    return f"pads-used-{agent_id}.log"
_LINE = "{slot} {context} {ciphertext}\n"
ALREADY_SENT = ("this device already sent a masked update in this round of this job, and a second, different one "
                "would let whoever sees both subtract them (a one-time pad is used once, whatever the coordinator "
                "asks); the round is skipped")
"""Why a slot already used takes no other vector (the agent's log line)."""
LINE_BYTES = len(_LINE.format(slot="0" * 16, context="0" * 64, ciphertext="0" * 64))


def slot_of(fleet: str, run_id: str, r: int, agent_id: str) -> str:
    """The slot of agent ``agent_id`` in round ``r`` of job ``run_id``: it masks one vector in it, ever."""
    return hashlib.sha256(f"{fleet}/{run_id}/{int(r)}/{agent_id}".encode()).hexdigest()[:16]


class PadLog:
    """The append-only file of used slots (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.used: dict[str, tuple[str, str]] = {}  # slot -> (context digest, ciphertext digest)
        self._cut: int | None = None  # the file ends in a cut line: its length without it (cut before the next record)
        if self.path.is_symlink():
            raise ConfigError(f"The pad log {self.path} is a symbolic link; give the file itself.")
        if self.path.exists():
            try:
                text = self.path.read_text()
            except OSError as exc:
                raise ConfigError(f"The pad log {self.path} cannot be read ({exc.strerror or exc}); it records the "
                                  "rounds this device has masked in and must not be lost.") from None
            # the text after the last newline is a line cut by a crash before its fsync: the
            # frame it was for was never sent
            for n, line in enumerate(text.split("\n")[:-1], 1):
                parts = line.split()
                if len(parts) != 3:
                    raise ConfigError(f"The pad log {self.path} has a broken line {n}; restore it from a backup "
                                      "(it records the rounds this device has masked in).")
                self.used.setdefault(parts[0], (parts[1], parts[2]))
            if text and not text.endswith("\n"):
                self._cut = len(text[: text.rfind("\n") + 1].encode())

    def refusal(self, slot: str, context: bytes, ciphertext: bytes) -> str | None:
        """Why ``ciphertext`` masked in ``context`` must not be sent in ``slot`` (one sentence
        without the round), or None: it may (a new slot, or the very ciphertext already sent)."""
        known = self.used.get(slot)
        if known is None:
            return None
        if known == (_digest(context), _digest(ciphertext)):
            return None
        return ALREADY_SENT

    def record(self, slot: str, context: bytes, ciphertext: bytes) -> None:
        """Append the slot, fsynced, before the ciphertext is sent (a no-op for a slot it already holds)."""
        if slot in self.used:
            return
        entry = (_digest(context), _digest(ciphertext))
        line = _LINE.format(slot=slot, context=entry[0], ciphertext=entry[1])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._cut is not None:  # the cut line's frame was never sent: drop it
            os.truncate(self.path, self._cut)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.used[slot], self._cut = entry, None


def _digest(data: bytes) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()
