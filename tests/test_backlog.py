"""The inbound backlog: first in, first out, never more than its budget in memory, the rest in
a temporary file (against a plain deque, and between two threads)."""

from __future__ import annotations

import threading
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from senseshield.runtime.backlog import Backlog

# a script of operations: ("put", payload size) or ("get",)
ops = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, 300)), st.tuples(st.just("get"))), max_size=80)


@settings(max_examples=150, deadline=None)
@given(script=ops, budget=st.integers(0, 700))
def test_it_is_a_fifo_and_never_holds_more_than_its_budget_in_memory(script, budget):
    backlog, model = Backlog(budget), deque()
    n = 0
    for op in script:
        if op[0] == "put":
            payload = bytes([n % 251]) * op[1]
            backlog.put(n % 3, f"t/{n}", payload, float(n))
            model.append((n % 3, f"t/{n}", payload, float(n)))
            n += 1
        else:
            got = backlog.get(timeout=0)
            assert (tuple(got) if got is not None else None) == (model.popleft() if model else None)
        sizes = [len(e[2]) for e in model]
        assert len(backlog) == len(model) and backlog.pending_bytes == sum(sizes)
        # in memory: at most the budget, or one entry alone when it is larger
        assert backlog.memory <= max(budget, sizes[0] if sizes else 0)
    while model:
        assert tuple(backlog.get(timeout=0)) == model.popleft()
    assert backlog.get(timeout=0) is None and backlog.pending_bytes == 0
    backlog.close()


def test_what_does_not_fit_goes_to_the_file_and_comes_back_in_order():
    backlog = Backlog(1000)
    for i in range(50):
        backlog.put(0, "update", bytes([i]) * 400, i)
    assert backlog.memory == 800 and backlog.spilled_total == 48 and backlog.pending_bytes == 50 * 400
    for i in range(50):
        backlog.put(1, "later", b"", 100 + i)  # still behind the file's entries
    got = [backlog.get(timeout=0) for _ in range(100)]
    assert [e.when for e in got] == [*range(50), *range(100, 150)]
    assert all(e.payload == bytes([i]) * 400 for i, e in enumerate(got[:50]))
    assert backlog.memory_peak == 800
    backlog.put(0, "again", b"x" * 10)  # the file was read to its end: memory again
    assert backlog.spilled_total == 98 and backlog.memory == 10
    backlog.close()


def test_a_producer_and_a_consumer_thread_see_every_entry_in_order():
    backlog, got = Backlog(4096), []

    def consume():
        while (entry := backlog.get(timeout=10)) is not None and entry.kind == 0:
            got.append(entry)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i in range(2000):
        backlog.put(0, "t", i.to_bytes(4, "little") * 64, float(i))
    backlog.put(1)
    consumer.join(30)
    assert [int.from_bytes(e.payload[:4], "little") for e in got] == list(range(2000))
    assert backlog.memory_peak <= 4096 and backlog.spilled_total > 0
    backlog.close()


def test_close_wakes_a_waiting_consumer_and_drops_what_waits():
    backlog = Backlog(0)
    backlog.put(0, "t", b"abc")
    backlog.put(0, "t", b"def")  # in the file
    waiter = threading.Event()
    result = []

    def wait_empty():
        backlog.get(timeout=0), backlog.get(timeout=0)
        waiter.set()
        result.append(backlog.get())  # waits until closed

    thread = threading.Thread(target=wait_empty)
    thread.start()
    assert waiter.wait(10)
    backlog.close()
    thread.join(10)
    assert result == [None] and backlog.closed and backlog.get(timeout=0) is None
    backlog.put(0, "t", b"after")  # a closed backlog takes nothing
    assert len(backlog) == 0


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="memory_bytes=-1"):
        Backlog(-1)
