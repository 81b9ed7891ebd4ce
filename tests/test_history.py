"""The coordinator's packed history (coordinator.history): settled rounds read back as they
were written, a late change to a settled round is kept, against a plain dict; a checkpoint
of a state with settled rounds is the same JSON as one of a state without."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.history import DeviceRounds, MetricsBook, RoundBook, Shelf
from coordinator.store import SqliteStore
from senseshield.runtime.files import json_pieces
from senseshield.runtime.protocol.messages import Metrics
from tests.test_checkpoint import full_state

records = st.dictionaries(st.sampled_from(["cluster", "budget", "he_ratio", "plan_sent"]),
                          st.integers(0, 9) | st.floats(0, 1) | st.text(max_size=3), max_size=4)
ops = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(1, 6), records),
    st.tuples(st.just("late"), st.integers(1, 6), st.text(max_size=3)),  # a late failure written in
    st.tuples(st.just("settle"), st.integers(0, 7)),
    st.tuples(st.just("del"), st.integers(1, 6))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(script=ops)
def test_device_rounds_behave_as_a_dict_whatever_is_settled(script):
    rounds, model = DeviceRounds(), {}
    for op in script:
        if op[0] == "set":
            rounds[op[1]], model[op[1]] = dict(op[2]), dict(op[2])
        elif op[0] == "late" and op[1] in model:
            rounds[op[1]].setdefault("failed", {})["evaluation"] = op[2]
            model[op[1]].setdefault("failed", {})["evaluation"] = op[2]
        elif op[0] == "settle":
            rounds.settle(op[1])
            assert all(r >= op[1] for r in rounds.live)
        elif op[0] == "del" and op[1] in model:
            del rounds[op[1]], model[op[1]]
        assert dict(rounds.items()) == model and list(rounds) == sorted(model) and len(rounds) == len(model)
        assert all((r in rounds) == (r in model) for r in range(8))
        assert all(rounds.get(r, "none") == model.get(r, "none") for r in range(8))


shelf_keys = st.integers(0, 5) | st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3))
shelf_ops = st.lists(st.one_of(st.tuples(st.just("set"), shelf_keys, st.binary(max_size=8)),
                               st.tuples(st.just("del"), shelf_keys)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(script=shelf_ops)
def test_a_shelf_behaves_as_a_dict_of_bytes_and_forgets_its_records_when_it_goes(script):
    """Closed rounds go to disk (the process's temporary SQLite database): the same keys,
    values and insertion order as a dict, each shelf apart from the others."""
    shelf, other, model = Shelf(), Shelf(), {}
    other["x"] = b"other's"
    for op in script:
        if op[0] == "set":
            shelf[op[1]], model[op[1]] = op[2], op[2]
        elif op[1] in model:
            del shelf[op[1]], model[op[1]]
        else:
            try:
                del shelf[op[1]]
                raise AssertionError("deleted a key it does not hold")
            except KeyError:
                pass
        assert list(shelf) == list(model) and len(shelf) == len(model) and dict(shelf.items()) == model
        assert all((k in shelf) == (k in model) and shelf.get(k) == model.get(k) for k in [0, 5, ("a", 0)])
    assert dict(other.items()) == {"x": b"other's"}
    ns = shelf.ns
    del shelf
    assert Shelf._run("SELECT count(*) FROM shelf WHERE ns = ?", (ns,)) == [(0,)]


def test_a_settled_round_is_read_as_a_copy_and_promoted_to_be_changed():
    rounds = DeviceRounds({1: {"cluster": 0}, 2: {"cluster": 0}})
    rounds.settle(2)
    assert list(rounds.packed) == [1] and list(rounds.live) == [2]
    rounds.get(1)["x"] = 1  # a copy: reading never changes what is kept
    assert rounds.get(1) == {"cluster": 0}
    rounds[1]["failed"] = {"evaluation": "no data"}  # promoted: the change stays
    assert 1 in rounds.live and rounds.get(1) == {"cluster": 0, "failed": {"evaluation": "no data"}}


def test_metrics_are_packed_and_read_back_equal():
    book = MetricsBook()
    for r in (1, 2, 3):
        for a in ("a0", "a1"):
            book[(a, r)] = Metrics(cluster=0, metric=0.5 + r / 10, n_test=40, timings={"train": 0.1 * r},
                                   dp_history=[(1.1, 0.01, r)])
    before = dict(book.items())
    book.settle(3)
    assert len(book.packed) == 4 and len(book.live) == 2
    assert dict(book.items()) == before and ("a1", 2) in book and ("a1", 4) not in book
    assert [k for k in book] == [("a0", 1), ("a1", 1), ("a0", 2), ("a1", 2), ("a0", 3), ("a1", 3)]


def test_a_checkpoint_of_settled_rounds_is_the_json_of_unsettled_ones(tmp_path):
    state = full_state()
    state.agent_rounds["a0"][2] = {"cluster": 0, "budget": 0.5}
    text = json.dumps(state.to_json())
    state.settle(3)  # everything packed
    assert state.agent_rounds["a0"].packed and state.metrics.packed
    assert json.dumps(state.to_json()) == text
    assert "".join(json_pieces(state.to_json(lazy=True), depth=3)) == text
    store = SqliteStore.open(tmp_path, "f1")
    store.save_state(state)
    (raw,) = store.db.execute("SELECT state FROM state").fetchone()
    assert raw == text.encode()
    back = store.load_state("j-1")
    assert json.dumps(back.to_json()) == text
    store.close()


def test_the_report_reads_packed_rounds_without_unpacking_them():
    from coordinator.report import latest_training

    rounds = DeviceRounds({1: {"training": {"training_loss": 2.0}}, 2: {"cluster": 0}})
    rounds.settle(3)
    assert latest_training(rounds) == {"training_loss": 2.0} and latest_training(rounds, 1) == {"training_loss": 2.0}
    assert not rounds.live and len(rounds.packed) == 2  # still packed


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.sampled_from(["a0", "a1", "a2"]), unique=True),
                          st.floats(0, 10)), max_size=6))
def test_the_closed_rounds_records_read_back_as_they_were_appended_the_earlier_ones_from_disk(rounds):
    """JobState.records: each round's record (its tally holds every sampled device's planned
    work) goes to disk once the next round closes, and reads back equal, in order."""
    from senseshield.results import RoundTally

    book, model = RoundBook(), []
    for r, (k, updates, seconds) in enumerate(rounds, start=1):
        tally = RoundTally()
        for a in updates:
            tally.add_work(a, steps=r, full_steps=5, budget=0.5)
            tally.add_update(a, {"train": seconds}, 0.25, 100, {})
        record = {"round": r, "tally": tally, "seconds": seconds, "joined": [], "left": updates,
                  "clusters": {k: {"accepted": bool(updates), "updates": updates}}}
        book.append(record)
        model.append(record)
        assert len(book) == len(model) and len(book.packed) == len(model) - 1 and book[-1] is record
        assert book == model and list(book) == model and book[::2] == model[::2]
        assert all(book[i] == model[i] for i in range(-len(model), len(model)))
        assert all(book.accepted(rr) == ({k} if u else set()) for rr, (k, u, _) in enumerate(rounds[:r], start=1))
    assert book.accepted(len(rounds) + 1) == frozenset()
    assert bool(book) == bool(model)
