"""The MQTT link against a real Mosquitto broker (started by the tests)."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.errors import ConfigError
from senseshield.runtime.protocol import encode_frame
from senseshield.runtime.transport import CHUNK_WINDOW, Link, parse_broker, topic
from tests.broker import Mosquitto


def frame(fleet="lab", sender="a", n=4, **fields) -> bytes:
    return encode_frame(
        schema="test", version=1, fleet=fleet, sender=sender, round=1, fields=fields,
        sections={"x": np.arange(n, dtype=np.float32)},
    )


def listener(broker_url, suffix="t/#", fleet="lab", **kw):
    inbox: queue.Queue = queue.Queue()
    link = Link(broker_url, client_id=f"listener-{suffix}", fleet=fleet,
                on_frame=lambda t, f: inbox.put((t, f)), **kw)
    link.subscribe(suffix)
    link.start()
    return link, inbox


def test_frames_round_trip_through_the_broker(mosquitto):
    rx, inbox = listener(mosquitto.url)
    tx = Link(mosquitto.url, client_id="tx", fleet="lab", on_frame=lambda t, f: None)
    tx.start()
    tx.publish("t/one", frame(k=7))
    got_topic, got = inbox.get(timeout=10)
    assert got_topic == "ss/v1/lab/t/one" and got.fields == {"k": 7}
    np.testing.assert_array_equal(got.sections["x"], np.arange(4, dtype=np.float32))
    tx.stop(), rx.stop()


def test_a_fan_out_without_waiting_for_each_acknowledgement_still_delivers_every_frame_in_order(mosquitto):
    """The coordinator's plans (issue 22 item 5): ``wait=False`` hands frames to paho's QoS 1
    queue without a round trip each; every one arrives, in order."""
    rx, inbox = listener(mosquitto.url)
    tx = Link(mosquitto.url, client_id="tx", fleet="lab", on_frame=lambda t, f: None)
    tx.start()
    for i in range(300):
        assert tx.publish(f"t/{i}", frame(k=i), wait=False)
    got = [inbox.get(timeout=30)[1].fields["k"] for _ in range(300)]
    assert got == list(range(300))
    tx.stop(), rx.stop()


def test_a_fan_out_keeps_a_bounded_number_of_messages_waiting_for_the_broker(mosquitto):
    """``wait=False`` publishes: past twice ``max_inflight`` unacknowledged messages the link
    waits for the oldest, so a fan-out to a whole fleet does not sit in memory at once."""
    rx, inbox = listener(mosquitto.url)
    tx = Link(mosquitto.url, client_id="tx-bounded", fleet="lab", on_frame=lambda t, f: None, max_inflight=5)
    tx.start()
    most = 0
    for i in range(400):
        assert tx.publish(f"t/{i}", frame(k=i), wait=False)
        most = max(most, len(tx._unacknowledged))
    assert most <= 10 + 1
    assert [inbox.get(timeout=30)[1].fields["k"] for _ in range(400)] == list(range(400))
    tx.stop(), rx.stop()
    # messages published while the link is down never raise or block a fan-out (paho keeps them)
    down = Link(mosquitto.url, client_id="tx-down", fleet="lab", on_frame=lambda t, f: None, max_inflight=1)
    down.start()
    down._client.disconnect()
    for i in range(5):
        down.publish(f"t/down/{i}", frame(k=i), wait=False)
    down.stop()


def test_a_slow_receiver_keeps_what_waits_in_a_file_and_loses_nothing(mosquitto):
    """Frames arrive while the receiver is busy: the link takes them off the network at once,
    holds at most its memory budget of them in memory (the rest in its temporary file) and
    hands every one over, in order, once the receiver goes on."""
    busy, got = __import__("threading").Event(), []

    def slow(t, f):
        busy.wait(30)
        got.append(f.fields["k"])

    rx = Link(mosquitto.url, client_id="rx-slow", fleet="lab", on_frame=slow, memory_bytes=64 << 10)
    rx.subscribe("t/#")
    rx.start()
    tx = Link(mosquitto.url, client_id="tx", fleet="lab", on_frame=lambda t, f: None)
    tx.start()
    for i in range(200):
        assert tx.publish(f"t/{i}", frame(k=i, n=4096), wait=False)  # 16 KiB each
    deadline = time.monotonic() + 30
    while rx.pending_bytes < 199 * 16384 and time.monotonic() < deadline:  # the first one is being handled
        time.sleep(0.05)
    assert rx.pending_bytes >= 199 * 16384 and rx._inbound.spilled_total > 0
    busy.set()
    while len(got) < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == list(range(200))
    assert rx.pending_memory_peak <= 64 << 10 and rx.dropped_inbound == 0
    tx.stop(), rx.stop()


def test_large_frames_are_chunked_under_the_broker_limit(tmp_path):
    broker = Mosquitto(tmp_path, message_size_limit=100_000)
    broker.start()
    try:
        rx, inbox = listener(broker.url)
        tx = Link(broker.url, client_id="tx", fleet="lab", on_frame=lambda t, f: None, chunk_bytes=64_000)
        tx.start()
        handed, waiting = [], []
        publish = tx._client.publish

        def counting(*args, **kwargs):  # the real client's publish, counting what awaits a PUBACK
            waiting.append(sum(not info.is_published() for info in handed))
            handed.append(publish(*args, **kwargs))
            return handed[-1]

        tx._client.publish = counting
        assert tx.publish("t/big", frame(n=750_000))  # 3 MB: 30x the broker's limit
        _, got = inbox.get(timeout=20)
        assert got.sections["x"].size == 750_000 and got.sections["x"][-1] == 749_999
        # the chunks are made as the broker takes them: a few await their PUBACK at a time,
        # never a second copy of the whole frame
        assert len(handed) >= 47 and max(waiting) <= CHUNK_WINDOW
        tx.stop(), rx.stop()
    finally:
        broker.stop()


def test_bad_messages_are_rejected_and_the_link_keeps_working(mosquitto):
    rx, inbox = listener(mosquitto.url)
    raw = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="raw", protocol=mqtt.MQTTv5)
    raw.connect("127.0.0.1", mosquitto.port)
    raw.loop_start()
    raw.publish("ss/v1/lab/t/junk", b"not a frame", qos=1).wait_for_publish(5)
    raw.publish("ss/v1/lab/t/other", frame(fleet="other-fleet"), qos=1).wait_for_publish(5)
    raw.publish("ss/v1/lab/t/good", frame(k=1), qos=1).wait_for_publish(5)
    got_topic, _ = inbox.get(timeout=10)
    assert got_topic.endswith("t/good")
    reasons = " | ".join(rx.rejected)
    assert "SenseShield magic" in reasons and "fleet 'other-fleet'" in reasons
    raw.loop_stop(), rx.stop()


def test_last_will_marks_a_killed_process_offline(mosquitto):
    rx, inbox = listener(mosquitto.url, suffix="agents/+/status")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from senseshield.runtime.protocol import encode_frame
        from senseshield.runtime.transport import Link
        will = encode_frame(schema="status", version=1, fleet="lab", sender="pi-1", round=0,
                            fields={{"online": False}})
        link = Link("{mosquitto.url}", client_id="pi-1", fleet="lab", on_frame=lambda t, f: None,
                    will=("agents/pi-1/status", will))
        link.start()
        print("up", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        child.kill()  # no clean disconnect: the broker publishes the will
        _, got = inbox.get(timeout=40)
        assert got.sender == "pi-1" and got.fields == {"online": False}
    finally:
        child.kill()
        child.wait()
        rx.stop()


def test_links_reconnect_and_resubscribe_after_a_broker_restart(mosquitto):
    rx, inbox = listener(mosquitto.url)
    tx = Link(mosquitto.url, client_id="tx", fleet="lab", on_frame=lambda t, f: None)
    tx.start()
    mosquitto.stop()
    mosquitto.start()
    # ready again = reconnected *and* re-subscribed (the SUBACK is in), so nothing is lost
    deadline = time.monotonic() + 30
    while min(rx.connects, tx.connects) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rx.connects >= 2 and tx.connects >= 2 and rx.connected and tx.connected
    tx.publish("t/after", frame(k=2))
    _, got = inbox.get(timeout=10)
    assert got.fields == {"k": 2}
    tx.stop(), rx.stop()


def test_unreachable_broker_and_bad_urls_are_clear_errors():
    with pytest.raises(ConnectionError, match="within 1 s"):
        Link("mqtt://127.0.0.1:1", client_id="x", fleet="lab", on_frame=lambda t, f: None).start(timeout=1)
    with pytest.raises(ConfigError, match="mqtt://HOST"):
        parse_broker("http://example")
    for url in ("mqtt://h:99999", "mqtt://h:0", "h:0", "mqtts://h:0", "mqtt://h:x"):
        with pytest.raises(ConfigError, match="invalid port; use a number in 1..65535"):
            parse_broker(url)  # :0 used to become 1883 silently
    with pytest.raises(ConfigError, match="Fleet name 'a/b'"):
        topic("a/b", "x")
    assert parse_broker("10.0.0.2") == ("10.0.0.2", 1883)
