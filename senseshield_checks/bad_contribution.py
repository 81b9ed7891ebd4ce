"""A device with a genuine signing key that sends, every round, a bad update before its real
one (issue 23 item 1), written apart from the services.

Each round ``r >= 2``, as soon as the round's plan is on the broker, the attacker takes the
device's update of round ``r - 1``, re-signs its receipt for round ``r`` with the device's key
(same ciphertext, same digest, the fingerprint of round ``r - 1``'s challenge) and publishes
it as the device's round-``r`` update, ahead of the device's genuine one. The coordinator's
checks pass (signature, run, cluster, samples, digest); only the key server's fingerprint
check (a secret per-round challenge) can tell. Before issue 23 the coordinator kept this
first update and dropped the genuine one as a duplicate, and the key server refused the
whole cluster's aggregate: the cluster lost the round.
"""

from __future__ import annotations

import threading

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.runtime.identity import Identity
from senseshield.runtime.protocol.envelope import Frame, decode_frame, encode_frame
from senseshield.runtime.transport import parse_broker


def resign(frame: Frame, signer: Identity, **changes) -> bytes:  # noqa: ANN003
    """``frame`` re-encoded with ``changes`` (header facts or sections), signed by ``signer``."""
    args = dict(schema=frame.schema, version=frame.version, fleet=frame.fleet, sender=frame.sender,
                round=frame.round, fields=dict(frame.fields), sections=dict(frame.sections), signer=signer)
    args.update(changes)
    return encode_frame(**args)


def stale_update(update: Frame, r: int, signer: Identity) -> bytes:
    """The device's earlier ``update`` made into a round-``r`` update: its receipt re-signed for
    round ``r`` (the old fingerprint, which does not match under round ``r``'s challenge)."""
    receipt = decode_frame(bytes(update.sections["receipt"]))
    sections = dict(update.sections)
    sections["receipt"] = resign(receipt, signer, round=r)
    return resign(update, signer, round=r, sections=sections)


class BadDevice:
    """Watches ``device``'s updates and round plans on ``fleet`` and sends the stale update
    every round (see the module docstring); :attr:`sent` lists the rounds it attacked."""

    def __init__(self, url: str, fleet: str, device: str, key_file) -> None:  # noqa: ANN001
        self.fleet, self.device = fleet, device
        self.signer = Identity.load_or_create(device, key_file)
        self.updates: dict[int, Frame] = {}
        self.sent: list[int] = []
        self.lock = threading.Lock()
        host, port = parse_broker(url)
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"bad-{device}")
        self.client.on_message = self._on_message
        prefix = f"ss/v1/{fleet}"
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(
            [(f"{prefix}/agents/{device}/update", 1), (f"{prefix}/agents/{device}/inbox", 1)])
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:  # noqa: ANN001
        try:
            frame = decode_frame(bytes(message.payload))
        except Exception:  # noqa: BLE001 - chunks and other frames: not material
            return
        with self.lock:
            if frame.schema == "update" and frame.sender == self.device:
                self.updates.setdefault(frame.round, frame)  # the genuine one (ours are round + 1)
            elif frame.schema == "round-plan" and frame.round >= 2 and frame.round not in self.sent:
                old = self.updates.get(frame.round - 1)
                if old is None:
                    return
                self.sent.append(frame.round)
                payload = stale_update(old, frame.round, self.signer)
                self.client.publish(f"ss/v1/{self.fleet}/agents/{self.device}/update", payload, qos=1)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def rounds_lost(report: dict, device: str | None = None) -> int:
    """Rounds in which some cluster's model did not change (a refused or failed aggregate);
    with ``device``, only that device's cluster counts (another cluster of one device is
    refused by the minimum of contributors, attack or not)."""
    clusters = {c["id"]: c["cluster"] for c in report["clients"]}
    where = "model unchanged" if device is None else f"cluster {clusters[device]}: model unchanged"
    return sum(any(where in n for n in r.get("notes", [])) for r in report["rounds"])


def named(report: dict, device: str) -> list[int]:
    """Rounds whose notes say ``device``'s update was refused."""
    return [r["round"] for r in report["rounds"] if any(f"refused the update of {device}" in n for n in r.get("notes", []))]

