"""The key server's state (keyserver.state.KeyServerState): what it saves survives a restart
field by field, a field added without being saved fails here, the ledger and the checkpoint
keep their files and their rules; no broker."""

from __future__ import annotations

import json
import stat
from dataclasses import fields

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from keyserver.state import JOB_ENTRY, KeyServerState, Ledger
from senseshield.errors import ConfigError, StorageError
from senseshield.job import Job
from senseshield.runtime.protocol.messages import AggregateResult, Challenge

FLEET, RUN = "f", "run-1"
JOB = Job(strategy="masked", model="linear", clients=2, rounds=3, input_shape=[1, 4, 6], num_classes=2)
INITIAL = np.zeros(24, np.float32)

# not saved, and why: where the state lives; the run's context, which the coordinator's
# fleet/config gives again at every start; what is in flight (lost with the process,
# nothing of it decrypted or answered)
UNSAVED = {"key_dir", "fleet", "job", "initial", "public", "secret",
           "pending", "reserved", "entries", "attempts", "failed", "staged"}


def _full(key_dir) -> KeyServerState:  # noqa: ANN001
    """A state whose every saved field holds something (none at its default)."""
    rng = np.random.default_rng(0)
    return KeyServerState(
        key_dir=key_dir, fleet=FLEET,
        ledger={"key1|a|" + "0" * 64: f"{RUN}/1/0", JOB_ENTRY + RUN: "first round opened at 2024-01-01 00:00:00"},
        run_id=RUN,
        models={0: (2, rng.normal(size=24).astype(np.float32)), 3: (1, rng.normal(size=24))},
        results={(1, 0): AggregateResult(run_id=RUN, cluster=0, accepted=True, timings={"decrypt": 0.5, "verify": 0.1},
                                         excluded={"c": "why"}),
                 (2, 3): AggregateResult(run_id=RUN, cluster=3, accepted=False, reason="refused: x", retry=True)},
        plans={1: {0: ["a", "b"], 3: ["c", "d"]}, 2: {0: ["a", "b"]}},
        seeds={1: bytes(range(32)), 2: bytes(32)},
        challenges={1: Challenge(run_id=RUN, box_key="Ym94", sealed={"a": "c2VhbGVk", "b": "c2VhbGVk"})},
        boxes={1: {"a": b"\x01" * 32, "b": b"\x02" * 32}},
        spent={1: {"a": 0, "b": 0}, 2: {"c": 3}},
        digests={0: {1: "d" * 64, 2: "e" * 64}},
        job=JOB, initial=INITIAL, pending={(3, 0): object()}, reserved={3: {"a": 0}},
        entries={(3, 0): {"a": "key1|a|x"}}, attempts={(2, 3): {"h"}}, failed={(2, 3): [{"c": "ff"}]},
    )


def _same(a, b) -> bool:  # noqa: ANN001
    """Equal, numpy arrays (in dicts and tuples too) compared by value, dtype and shape."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[x], b[x]) for x in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _reloaded(state: KeyServerState) -> KeyServerState:
    """What a restarted key server holds once the coordinator sends the same run again."""
    again = KeyServerState.open(state.key_dir, state.fleet)
    assert again.start_run(state.run_id, job=JOB, initial=INITIAL)
    return again


def test_every_saved_field_survives_save_and_load(tmp_path):
    state = _full(tmp_path)
    state.save()
    again = _reloaded(state)
    for f in fields(KeyServerState):
        if f.name not in UNSAVED:
            assert _same(getattr(again, f.name), getattr(state, f.name)), f.name


def test_a_field_added_without_being_saved_fails_here(tmp_path):
    """Every field is saved (it survives a restart, and _full sets it to something else than
    its default), or is listed in UNSAVED and marked so in keyserver.state (``metadata``)."""
    marked = {f.name for f in fields(KeyServerState) if f.metadata.get("kind")}
    assert marked == UNSAVED
    state = _full(tmp_path)
    state.save()
    again, fresh = _reloaded(state), KeyServerState(tmp_path, FLEET)
    for f in fields(KeyServerState):
        if f.name not in UNSAVED:
            assert not _same(getattr(fresh, f.name), getattr(state, f.name)), f"_full leaves {f.name} at its default"
            assert not _same(getattr(again, f.name), getattr(fresh, f.name)), f"{f.name} is not saved"


def test_the_files_are_the_key_servers_private_ledger_and_checkpoint(tmp_path):
    state = _full(tmp_path)
    state.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ledger-{FLEET}.json", f"models-{FLEET}.npz"]
    for p in tmp_path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert json.loads((tmp_path / f"ledger-{FLEET}.json").read_text()) == state.ledger
    with np.load(tmp_path / f"models-{FLEET}.npz") as data:
        assert sorted(data.files) == ["c0", "c3", "meta"]
        assert json.loads(bytes(data["meta"]).decode())["run_id"] == RUN
        # written piece by piece, the same bytes as one json.dumps of everything
        assert bytes(data["meta"]).decode() == json.dumps({
            "run_id": state.run_id, "rounds": {str(k): r for k, (r, _) in state.models.items()},
            "results": [[r, k, v.model_dump(mode="json")] for (r, k), v in state.results.items()],
            "plans": {str(r): {str(k): v for k, v in p.items()} for r, p in state.plans.items()},
            "seeds": {str(r): seed.hex() for r, seed in state.seeds.items()},
            "spent": {str(r): v for r, v in state.spent.items()},
            "challenges": {str(r): c.model_dump(mode="json") for r, c in state.challenges.items()},
            "boxes": {str(r): {a: b.hex() for a, b in v.items()} for r, v in state.boxes.items()},
            "digests": {str(k): {str(r): d for r, d in v.items()} for k, v in state.digests.items()}})
        for k, (_, w) in state.models.items():
            np.testing.assert_array_equal(data[f"c{k}"], w)
    assert (tmp_path / f"ledger-{FLEET}.json").read_text() == json.dumps(state.ledger, sort_keys=True)
    # an unchanged ledger is not written again; a changed one is
    inode = (tmp_path / f"ledger-{FLEET}.json").stat().st_ino
    state.results[(3, 0)] = AggregateResult(run_id=RUN, cluster=0, accepted=False, reason="refused: y")
    state.save()
    assert (tmp_path / f"ledger-{FLEET}.json").stat().st_ino == inode
    state.ledger["key1|b|" + "0" * 64] = f"{RUN}/3/0"
    state.save()
    assert (tmp_path / f"ledger-{FLEET}.json").stat().st_ino != inode


def test_another_run_starts_empty_and_keeps_the_ledger(tmp_path):
    state = _full(tmp_path)
    state.save()
    assert not state.start_run("run-2", job=JOB, initial=INITIAL)
    assert state.run_id == "run-2" and state.ledger == _full(tmp_path).ledger
    fresh = KeyServerState(tmp_path, FLEET)
    for name in ("models", "results", "plans", "seeds", "challenges", "boxes", "spent",
                 "pending", "reserved", "entries", "attempts", "failed"):
        assert _same(getattr(state, name), getattr(fresh, name)), name
    # a job runs once: run-1 was served, and is not the checkpoint's run once run-2 saved
    assert state.served(RUN) is None  # the checkpoint on disk is still run-1's: it resumes
    state.save()
    assert state.served(RUN) == "first round opened at 2024-01-01 00:00:00"
    assert state.served("run-3") is None


def test_spending_records_the_released_use_in_the_ledger(tmp_path):
    """An entry names the use that released its sum in this job, else its first use; a use in
    another job is never overwritten."""
    state = KeyServerState.open(tmp_path, FLEET)
    state.start_run(RUN, job=JOB, initial=INITIAL)
    state.ledger["key|c|d"] = "run-0/1/0"
    state.entries[(1, 0)] = {"a": "key|a|d", "c": "key|c|d"}
    state.spend(1, 0, ["a", "c"], released=False)
    assert state.spent == {1: {"a": 0, "c": 0}} and not state.entries
    assert state.ledger == {"key|a|d": f"{RUN}/1/0", "key|c|d": "run-0/1/0"}
    state.entries[(2, 0)] = {"a": "key|a|d", "c": "key|c|d"}
    state.spend(2, 0, ["a", "c"], released=True)
    assert state.ledger == {"key|a|d": f"{RUN}/2/0", "key|c|d": "run-0/1/0"}
    state.entries[(3, 1)] = {"a": "key|a|d"}
    state.spend(3, 1, ["a"], released=False)
    assert state.ledger["key|a|d"] == f"{RUN}/2/0"


def test_unreadable_files_are_one_sentence_and_a_file_it_cannot_write_is_a_storage_error(tmp_path):
    (tmp_path / f"ledger-{FLEET}.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"ledger .* cannot be read .* restore it from a backup\.$"):
        KeyServerState.open(tmp_path, FLEET)
    (tmp_path / f"ledger-{FLEET}.json").write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="is not a JSON object of strings"):
        KeyServerState.open(tmp_path, FLEET)
    (tmp_path / f"ledger-{FLEET}.json").unlink()
    (tmp_path / f"models-{FLEET}.npz").write_bytes(b"not an npz")
    state = KeyServerState.open(tmp_path, FLEET)
    with pytest.raises(ConfigError, match=r"checkpoint .* cannot be read .* move it away"):
        state.start_run(RUN, job=JOB, initial=INITIAL)
    assert state.run_id is None  # nothing changed
    (tmp_path / f"models-{FLEET}.npz").unlink()
    (tmp_path / f"models-{FLEET}.npz").mkdir()  # a directory where the checkpoint goes
    state = _full(tmp_path)
    with pytest.raises(StorageError, match=r"^Cannot write '.*models-f\.npz': ") as exc:
        state.save()
    assert "\n" not in str(exc.value)
    assert (tmp_path / f"ledger-{FLEET}.json").exists()  # the ledger first


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "setdefault", "update", "del", "pop", "read"]),
                          st.sampled_from(["k|a|d", "k|b|d", 'k|"c\u00e9|d']), st.text(max_size=4)), max_size=12))
def test_the_ledger_knows_when_it_changed_and_writes_as_json_dumps_does(ops):
    """An unchanged ledger is not written again: every way of changing it is noticed, and its
    piece-by-piece text is json.dumps(ledger, sort_keys=True)."""
    ledger, model = Ledger({"k|z|d": "run-0/1/0"}), {"k|z|d": "run-0/1/0"}
    for op, key, value in ops:
        ledger.changed, before = False, dict(model)
        if op == "set":
            ledger[key] = model[key] = value
        elif op == "setdefault":
            assert ledger.setdefault(key, value) == model.setdefault(key, value)
        elif op == "update":
            ledger.update({key: value}), model.update({key: value})
        elif op in ("del", "pop") and key in model:
            (ledger.pop(key), model.pop(key)) if op == "pop" else (ledger.__delitem__(key), model.pop(key))
        else:
            ledger.get(key), key in ledger, len(ledger)
        assert dict(ledger) == model
        assert ledger.changed or model == before  # (a set to the same value may count as a change)
        assert "".join(ledger.pieces()) == json.dumps(model, sort_keys=True)
