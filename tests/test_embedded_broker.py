"""The embedded (amqtt, in-process) broker of `senseshield fleet up`, over the real network.

The same kinds of checks as tests/test_transport.py runs against Mosquitto, made with
:class:`Link` speaking ``EmbeddedBroker.protocol`` (MQTT 3.1.1: amqtt 0.12 has no MQTT 5).
"""

from __future__ import annotations

import gc
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from senseshield.runtime.broker import EmbeddedBroker
from senseshield.errors import ConfigError
from senseshield.runtime.protocol import encode_frame
from senseshield.runtime.transport import Link

PROTOCOL = EmbeddedBroker.protocol


def frame(fleet="lab", sender="a", n=4, **fields) -> bytes:
    return encode_frame(
        schema="test", version=1, fleet=fleet, sender=sender, round=1, fields=fields,
        sections={"x": np.arange(n, dtype=np.float32)},
    )


def link(url, client_id, fleet="lab", **kw) -> Link:
    return Link(url, client_id=client_id, fleet=fleet, on_frame=lambda t, f: None,
                protocol=PROTOCOL, **kw)


def listener(url, suffix="t/#", client_id=None, **kw):
    inbox: queue.Queue = queue.Queue()
    rx = Link(url, client_id=client_id or f"listener-{suffix}", fleet="lab",
              on_frame=lambda t, f: inbox.put((t, f)), protocol=PROTOCOL, **kw)
    rx.subscribe(suffix)
    rx.start()
    return rx, inbox


def broker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "embedded-mqtt-broker"]


@pytest.fixture()
def broker():
    with EmbeddedBroker() as b:
        yield b


def test_protocol_is_mqtt_311_and_mqtt_5_is_refused(broker):
    assert EmbeddedBroker.protocol == "3.1.1"
    assert broker.url == f"mqtt://127.0.0.1:{broker.port}" and broker.port > 0
    v5 = Link(broker.url, client_id="v5", fleet="lab", on_frame=lambda t, f: None)  # default "5"
    with pytest.raises(ConnectionError):
        v5.start(timeout=1.5)  # CONNACK "unsupported protocol version"
    with pytest.raises(ConfigError, match="protocol '4'"):
        Link(broker.url, client_id="x", fleet="lab", on_frame=lambda t, f: None, protocol="4")


def test_frames_round_trip(broker):
    rx, inbox = listener(broker.url)
    tx = link(broker.url, "tx")
    tx.start()
    tx.publish("t/one", frame(k=7))
    got_topic, got = inbox.get(timeout=10)
    assert got_topic == "ss/v1/lab/t/one" and got.fields == {"k": 7}
    np.testing.assert_array_equal(got.sections["x"], np.arange(4, dtype=np.float32))
    tx.stop(), rx.stop()


def test_a_3_mb_frame_travels_in_1_mb_chunks(broker):
    rx, inbox = listener(broker.url)
    tx = link(broker.url, "tx")  # default chunk_bytes: 1 MB
    tx.start()
    tx.publish("t/big", frame(n=750_000))
    _, got = inbox.get(timeout=20)
    assert got.sections["x"].size == 750_000 and got.sections["x"][-1] == 749_999
    tx.stop(), rx.stop()


def test_a_late_subscriber_gets_the_retained_message_and_clearing_works(broker):
    tx = link(broker.url, "tx")
    tx.start()
    tx.publish("t/config", frame(k=1), retain=True)
    tx.publish("t/config", frame(k=2), retain=True)  # replaces the first
    rx, inbox = listener(broker.url)
    _, got = inbox.get(timeout=10)
    assert got.fields == {"k": 2}
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.3)
    rx.stop()
    # Link sends a retained frame unchunked (up to max_retained_bytes): the broker takes it
    assert broker.max_message_bytes > tx.max_retained_bytes + (1 << 20)
    tx.publish("t/model", frame(n=3_000_000), retain=True)  # 12 MB in one MQTT message
    model, model_inbox = listener(broker.url, suffix="t/model", client_id="model")
    assert model_inbox.get(timeout=10)[1].sections["x"].size == 3_000_000
    model.stop()
    tx.clear_retained("t/config"), tx.clear_retained("t/model")
    late, late_inbox = listener(broker.url, client_id="late")
    with pytest.raises(queue.Empty):
        late_inbox.get(timeout=0.5)
    tx.stop(), late.stop()


def test_a_new_client_gets_only_the_retained_messages_it_subscribed_to(broker):
    # amqtt 0.12 on its own sends a connecting client the retained messages matching any
    # client's subscriptions (here a's "t/#"); EmbeddedBroker limits them to the client's own
    a, _ = listener(broker.url, client_id="a")
    a.publish("t/secret", frame(k=1), retain=True)
    a.publish("t/mine", frame(k=2), retain=True)
    c, inbox = listener(broker.url, suffix="t/mine", client_id="c")
    got_topic, got = inbox.get(timeout=10)
    assert got_topic == "ss/v1/lab/t/mine" and got.fields == {"k": 2}
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.5)
    c.stop(), a.stop()


def test_last_will_marks_a_killed_process_offline(broker):
    rx, inbox = listener(broker.url, suffix="agents/+/status")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from senseshield.runtime.protocol import encode_frame
        from senseshield.runtime.transport import Link
        will = encode_frame(schema="status", version=1, fleet="lab", sender="pi-1", round=0,
                            fields={{"online": False}})
        link = Link("{broker.url}", client_id="pi-1", fleet="lab", on_frame=lambda t, f: None,
                    will=("agents/pi-1/status", will), protocol="{PROTOCOL}")
        link.start()
        print("up", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        child.kill()  # SIGKILL: no DISCONNECT, the socket just closes
        topic_, got = inbox.get(timeout=10)
        assert topic_ == "ss/v1/lab/agents/pi-1/status"
        assert got.sender == "pi-1" and got.fields == {"online": False}
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        rx.stop()
    # the will was retained: a later subscriber still sees the process offline
    late, late_inbox = listener(broker.url, suffix="agents/+/status", client_id="late")
    assert late_inbox.get(timeout=10)[1].fields == {"online": False}
    late.stop()


def test_stop_then_start_on_the_same_port_and_links_come_back(broker):
    rx, inbox = listener(broker.url)
    tx = link(broker.url, "tx")
    tx.start()
    port = broker.port
    broker.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    broker.start()
    assert broker.port == port
    assert rx.wait_connected(15) and tx.wait_connected(15)  # paho reconnects, Link resubscribes
    deadline = time.monotonic() + 10
    while True:  # the resubscription may land just after the CONNACK
        tx.publish("t/after", frame(k=2))
        try:
            _, got = inbox.get(timeout=0.5)
            break
        except queue.Empty:
            assert time.monotonic() < deadline
    assert got.fields == {"k": 2}
    tx.stop(), rx.stop()


def test_two_brokers_at_once_are_independent():
    with EmbeddedBroker() as one, EmbeddedBroker() as two:
        assert one.port != two.port
        rx1, inbox1 = listener(one.url)
        rx2, inbox2 = listener(two.url)
        tx = link(one.url, "tx")
        tx.start()
        tx.publish("t/x", frame(k=1))
        assert inbox1.get(timeout=10)[1].fields == {"k": 1}
        with pytest.raises(queue.Empty):
            inbox2.get(timeout=0.3)
        tx.stop(), rx1.stop(), rx2.stop()


def test_a_message_over_the_size_limit_drops_its_sender_only():
    with EmbeddedBroker(max_message_bytes=100_000) as broker:
        rx, inbox = listener(broker.url)
        dropped = threading.Event()
        raw = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="raw",
                          protocol=mqtt.MQTTv311)
        raw.on_disconnect = lambda *a: dropped.set()
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        raw.publish("ss/v1/lab/t/huge", b"\0" * 200_000, qos=1)
        assert dropped.wait(10)
        raw.loop_stop()
        tx = link(broker.url, "tx", chunk_bytes=50_000)  # chunks under the limit still pass
        tx.start()
        tx.publish("t/ok", frame(n=100_000))
        assert inbox.get(timeout=10)[1].sections["x"].size == 100_000
        tx.stop(), rx.stop()


def test_stop_is_clean_no_thread_socket_or_warning_left():
    before = len(broker_threads())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        broker = EmbeddedBroker().start()
        assert len(broker_threads()) == before + 1
        socket.create_connection(("127.0.0.1", broker.port), timeout=2).close()  # a port probe
        tx = link(broker.url, "tx")
        tx.start()
        broker.stop()
        broker.stop()  # idempotent
        tx.stop()  # the broker went away under it: only ends its network thread
        gc.collect()
    assert len(broker_threads()) == before and not broker.running
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", broker.port), timeout=1).close()


def test_a_port_in_use_is_a_clear_error(broker):
    with pytest.raises(RuntimeError, match="did not start"):
        EmbeddedBroker(port=broker.port).start(timeout=5)
