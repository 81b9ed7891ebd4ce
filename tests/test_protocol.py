"""Wire envelope and chunking: round trips and rejection of malformed frames."""

import json
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from senseshield.errors import ProtocolError
from senseshield.runtime.protocol import Reassembler, decode_frame, encode_frame, split_frame

numeric = st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_])


@st.composite
def section_arrays(draw):
    dtype = draw(numeric)
    elements = None
    if dtype in (np.float32, np.float64):
        elements = st.floats(-1e6, 1e6, allow_nan=False, width=32 if dtype is np.float32 else 64)
    return draw(arrays(dtype, array_shapes(min_dims=0, max_dims=3, max_side=5), elements=elements))


@settings(max_examples=60)
@given(
    st.dictionaries(st.text("abcxyz_", min_size=1, max_size=6), section_arrays(), max_size=4),
    st.binary(max_size=200),
    st.integers(0, 10_000),
    st.dictionaries(st.text(min_size=1, max_size=5), st.integers() | st.text(max_size=5) | st.booleans(), max_size=4),
)
def test_round_trip_keeps_every_section_and_field(arrays_, blob, round_, fields):
    data = encode_frame(
        schema="update", version=3, fleet="lab", sender="pi-7", round=round_,
        fields=fields, sections={**arrays_, "_blob": blob}, sent_at=12.5,
    )
    frame = decode_frame(data)
    assert (frame.schema, frame.version, frame.fleet, frame.sender, frame.round) == ("update", 3, "lab", "pi-7", round_)
    assert frame.fields == fields and frame.sent_at == 12.5
    assert frame.sections["_blob"] == blob
    for name, value in arrays_.items():
        got = frame.sections[name]
        assert got.shape == value.shape and got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    # a sender's check of its own frame: the same sections, as views of the frame's bytes
    viewed = decode_frame(data, views=True)
    assert bytes(viewed.sections["_blob"]) == blob and isinstance(viewed.sections["_blob"], memoryview)
    for name, value in arrays_.items():
        got = viewed.sections[name]
        assert got.shape == value.shape and got.dtype == value.dtype and not got.flags.owndata
        np.testing.assert_array_equal(got, value)


def _frame(**sections) -> bytes:
    return encode_frame(schema="s", version=1, fleet="f", sender="a", round=1, fields={}, sections=sections)


def _with_header(data: bytes, mutate) -> bytes:
    (hlen,) = struct.unpack_from(">I", data, 5)
    header = json.loads(data[9 : 9 + hlen])
    mutate(header)
    encoded = json.dumps(header).encode()
    return data[:5] + struct.pack(">I", len(encoded)) + encoded + data[9 + hlen :]


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: b"XXXX" + d[4:], "magic"),
        (lambda d: d[:4] + b"\x09" + d[5:], "Frame version 9 is not supported"),
        (lambda d: d[:-1], "runs past the end"),
        (lambda d: d + b"\x00", "trailing bytes"),
        (lambda d: d[:7], "shorter than"),
        (lambda d: d[:5] + struct.pack(">I", 10**6) + d[9:], "does not fit"),
        (lambda d: d[:9] + b"!" + d[10:], "not valid JSON"),
        (lambda d: _with_header(d, lambda h: h["sections"][0].update(shape=[5])), "declares shape [5]"),
        (lambda d: _with_header(d, lambda h: h["sections"][0].update(dtype="c128")), "dtype 'c128'"),
        (lambda d: _with_header(d, lambda h: h.update(round=-1)), "rounds are >= 0"),
        (lambda d: _with_header(d, lambda h: h.pop("fleet")), "'fleet' is missing"),
        (lambda d: _with_header(d, lambda h: h["sections"].append(h["sections"][0])), "repeated"),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(make, reason):
    good = _frame(x=np.arange(3, dtype=np.float32))
    decode_frame(good)
    for views in (False, True):
        with pytest.raises(ProtocolError, match=re.escape(reason)):
            decode_frame(make(good), views=views)


def test_non_finite_floats_and_bad_booleans_are_rejected():
    with pytest.raises(ProtocolError, match="NaN or inf"):
        decode_frame(_frame(x=np.array([1.0, np.nan])))
    data = _frame(m=np.array([True, False]))
    with pytest.raises(ProtocolError, match="boolean"):
        decode_frame(data[:-1] + b"\x02")
    with pytest.raises(ProtocolError, match="NaN or inf"):
        decode_frame(_frame(x=np.array([1.0, np.nan])), views=True)
    assert decode_frame(data, views=True).sections["m"].tolist() == [True, False]


def test_size_limit_is_enforced_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode_frame(_frame(x=np.zeros(1000)), max_bytes=1000)
    assert decode_frame(_frame(x=np.zeros(10)), max_bytes=1000).schema == "s"


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 20_000), st.integers(1024, 4096), st.randoms(use_true_random=False))
def test_chunks_reassemble_in_any_order(size, limit, rnd):
    frame = _frame(x=np.arange(size, dtype=np.uint8))
    chunks = split_frame(frame, limit=limit, fleet="f", sender="a", round=1)
    assert all(len(c) <= limit for c in chunks)
    if len(chunks) == 1:
        assert chunks[0] == frame
        return
    rnd.shuffle(chunks)
    assembler = Reassembler()
    results = [assembler.add(decode_frame(c), now=0.0) for c in chunks]
    assert results[:-1] == [None] * (len(chunks) - 1) and results[-1] == frame
    assert assembler.pending == 0


def test_reassembler_rejects_tampering_and_expires_idle_parts():
    frame = _frame(x=np.arange(5000, dtype=np.uint8))
    chunks = [decode_frame(c) for c in split_frame(frame, limit=1024, fleet="f", sender="a", round=1)]
    assembler = Reassembler(max_idle=10)
    assembler.add(chunks[0], now=0.0)
    assert assembler.add(chunks[1], now=9.0) is None  # still alive: 9 s since its last chunk
    assert assembler.add(chunks[2], now=18.0) is None
    assert assembler.held_bytes == sum(len(c.sections["data"]) for c in chunks[:3])
    assembler.expire(now=28.5)  # idle for 10.5 s: dropped without waiting for another chunk
    assert assembler.pending == 0 and assembler.held_bytes == 0 and assembler.dropped == 1
    tampered = Reassembler()
    for c in chunks[:-1]:
        tampered.add(c, now=0.0)
    last = chunks[-1]
    last.sections["data"] = bytes(len(last.sections["data"]))
    with pytest.raises(ProtocolError, match="checksum"):
        tampered.add(last, now=0.0)
    small = Reassembler(max_bytes=2000)
    with pytest.raises(ProtocolError):
        for c in chunks:
            small.add(c, now=0.0)


def test_reassembler_evicts_the_oldest_incomplete_streams_first():
    def stream(sender: str) -> list:
        frame = _frame(x=np.arange(5000, dtype=np.uint8))
        return [decode_frame(c) for c in split_frame(frame, limit=1024, fleet="f", sender=sender, round=1)]

    assembler = Reassembler(max_bytes=6000)
    a, b = stream("a"), stream("b")
    for c in a[:-1]:
        assembler.add(c, now=0.0)
    for c in b[:-1]:  # b's chunks push a (the oldest) out; the total stays within 6000 bytes
        assembler.add(c, now=1.0)
        assert assembler.held_bytes <= 6000
    assert assembler.dropped == 1 and assembler.pending == 1
    assert assembler.add(b[-1], now=1.0) is not None  # b completes
    assert assembler.held_bytes == 0
    liar = stream("c")
    liar[1].fields["index"] = 0  # same index again, another payload size: fine (replaced)
    assembler.add(liar[0], now=2.0)
    liar[2].sections["data"] = bytes(5000)  # more bytes than the stream's declared total
    with pytest.raises(ProtocolError, match="exceed its total"):
        assembler.add(liar[2], now=2.0)
    assert assembler.held_bytes == 0


def test_a_checked_frame_lets_its_signed_bytes_go_and_then_has_no_raw_bytes():
    from senseshield.runtime.identity import Identity

    me = Identity.generate("a")
    data = encode_frame(schema="s", version=1, fleet="f", sender="a", round=1, fields={},
                        sections={"x": b"payload" * 100}, signer=me)
    frame = decode_frame(data)
    assert isinstance(frame.signed, memoryview) and frame.raw == data  # a view of the frame, not a copy
    frame.release_signed()
    assert frame.sections["x"] == b"payload" * 100
    with pytest.raises(ProtocolError, match="let its signed bytes go"):
        frame.raw
