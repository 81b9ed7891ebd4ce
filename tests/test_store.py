"""The coordinator's store (coordinator.store): one contract, run over the in-memory store and
the SQLite one; then what only the durable store does (it survives a reopen, its file is
private, a write it cannot make is a StorageError naming the file, a state it cannot read is
one sentence, a JSON state directory of earlier versions is imported). No broker."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import numpy as np
import pytest

from coordinator.jobs import JobBook, JobRecord
from coordinator.store import MemoryStore, SqliteStore, Store
from senseshield.errors import ConfigError, StorageError
from senseshield.job import Job, job_shape
from tests.test_checkpoint import KEPT, full_state, same


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path) -> Store:
    made = MemoryStore() if request.param == "memory" else SqliteStore.open(tmp_path, "f1")
    yield made
    made.close()


def _record(job_id: str, **fields) -> JobRecord:  # noqa: ANN003
    return JobRecord(job_id, Job(strategy="plaintext", model="linear").model_dump(mode="json"), "plain", **fields)


# ---- the contract (every store) ---------------------------------------------------------
def test_job_records_are_kept_in_the_order_first_saved_and_replaced_by_id(store):
    assert store.load_jobs() == []
    store.save_job(_record("j-b", submitted_at=2.0))
    store.save_job(_record("j-a", submitted_at=1.0))
    store.save_job(_record("j-b", submitted_at=2.0, state="running", events=["12:00:00 started"]))
    assert [(r.id, r.state, r.events) for r in store.load_jobs()] == [
        ("j-b", "running", ["12:00:00 started"]), ("j-a", "queued", [])]


def test_a_job_book_reads_its_store_back(store):
    book = JobBook(store)
    record = book.add(Job(strategy="plaintext", model="linear", rounds=2))
    book.set(record, state="running", round=1)
    again = JobBook(store)
    assert list(again.records) == [record.id] and again.get(record.id) == record


def test_the_state_is_saved_whole_and_loaded_as_a_copy(store):
    assert store.load_state("j-1") is None
    state = full_state()
    store.save_state(state)
    state.completed, state.refused["late"] = 2, "changed after the save"  # the store keeps what was saved
    back = store.load_state("j-1")
    assert back is not None and back is not state
    saved = full_state()
    for name in KEPT:
        assert same(getattr(back, name), getattr(saved, name)), name
    assert store.load_state("j-2") is None  # another job's state
    store.save_state(state)  # replaced
    assert store.load_state("j-1").completed == 2
    store.clear_state()
    assert store.load_state("j-1") is None
    store.clear_state()  # nothing to clear: no error
    assert store.load_jobs() == []  # the jobs are apart from the state


def test_a_state_that_cannot_be_read_is_one_sentence(store):
    raw = full_state().to_json()
    del raw["plan"]
    if isinstance(store, MemoryStore):
        store.state = json.dumps(raw)
    else:
        store.save_state(full_state())
        store.db.execute("UPDATE state SET state = ?", (json.dumps(raw),))
    with pytest.raises(ConfigError) as err:
        store.load_state("j-1")
    message = str(err.value)
    assert message.startswith(f"The coordinator's checkpoint {store.where!r} cannot be read (KeyError: 'plan')")
    assert message.endswith("move it away to start job j-1 anew.") and "\n" not in message


# ---- the durable store --------------------------------------------------------------------
def test_the_sqlite_store_survives_a_reopen_and_is_private(tmp_path):
    store = SqliteStore.open(tmp_path, "f1")
    store.save_job(_record("j-1"))
    store.save_state(full_state())
    store.close()
    path = tmp_path / "coordinator-f1.sqlite"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = SqliteStore.open(tmp_path, "f1")
    assert [r.id for r in again.load_jobs()] == ["j-1"] and again.load_state("j-1").completed == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coordinator-f1.sqlite"]  # one file between saves


def test_the_sqlite_checkpoint_is_the_state_as_json_written_piece_by_piece(tmp_path):
    store = SqliteStore.open(tmp_path, "f1")
    state = full_state()
    store.save_state(state)
    (raw,) = store.db.execute("SELECT state FROM state").fetchone()
    assert raw == json.dumps(state.to_json()).encode()  # the same bytes as one string would be
    assert os.listdir(tmp_path) == ["coordinator-f1.sqlite"]  # its spool file is gone
    store.close()


def test_a_full_database_is_a_storage_error_naming_the_file_and_the_old_state_stays(tmp_path):
    store = SqliteStore.open(tmp_path, "f1")
    store.save_state(full_state())
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
    big = full_state()
    big.straggling = [{"round": r, "agent": "a" * 100, "missing": "update"} for r in range(2000)]
    with pytest.raises(StorageError) as err:
        store.save_state(big)
    assert str(err.value) == f"Cannot write {store.where!r}: database or disk is full (SQLITE_FULL)"
    assert err.value.path == store.where
    assert len(store.load_state("j-1").straggling) == 1  # the previous save, whole


def test_a_read_only_database_is_a_storage_error(tmp_path):
    store = SqliteStore.open(tmp_path, "f1")
    store.close()
    readonly = sqlite3.connect(f"file:{tmp_path / 'coordinator-f1.sqlite'}?mode=ro", uri=True, isolation_level=None)
    store = SqliteStore.open(tmp_path, "f1")
    store.db.close()
    store.db = readonly
    with pytest.raises(StorageError, match=r"^Cannot write '.*coordinator-f1.sqlite': attempt to write a readonly "
                                           r"database \(SQLITE_READONLY\)$"):
        store.save_job(_record("j-1"))


def test_a_file_that_is_not_a_database_is_one_sentence(tmp_path):
    (tmp_path / "coordinator-f1.sqlite").write_bytes(b"not a database at all, but long enough to look like one" * 4)
    with pytest.raises(StorageError, match="file is not a database"):
        SqliteStore.open(tmp_path, "f1")


def test_a_json_state_directory_of_earlier_versions_is_imported(tmp_path):
    """jobs-<fleet>.json and coordinator-<fleet>.json (the checkpoint's format of earlier
    versions: the plan's fields at the top level, agents as hellos) become the new store's;
    the files are renamed *.imported."""
    state = full_state()
    new = state.to_json()
    plan = new.pop("plan")
    legacy = {k: v for k, v in new.items() if k not in ("size", "input_shape", "num_classes", "agents",
                                                           "user_accountant")}
    legacy |= plan | {"hellos": {a: i["hello"] for a, i in new["agents"].items()}, "accountant": new["user_accountant"]}
    (tmp_path / "coordinator-f1.json").write_text(json.dumps(legacy))
    record = _record("j-1", state="running")
    from dataclasses import asdict

    (tmp_path / "jobs-f1.json").write_text(json.dumps([asdict(record)]))
    store = SqliteStore.open(tmp_path, "f1")
    assert store.load_jobs() == [record]
    back = store.load_state("j-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "coordinator-f1.json.imported", "coordinator-f1.sqlite", "jobs-f1.json.imported"]
    shape, classes = job_shape(state.config)  # rebuilt from the job
    assert (back.size, back.input_shape, back.num_classes) == ((int(np.prod(shape)) + 1) * classes, list(shape), classes)
    assert np.flatnonzero(back.plan.fixed_masks[0]).tolist() == [1, 4, 7] and back.plan.fixed_masks[0].size == back.size
    assert (back.plan.cluster_of, back.plan.budget_of) == (state.plan.cluster_of, state.plan.budget_of)
    assert all(info.online for info in back.agents.values())
    for name in set(KEPT) - {"size", "input_shape", "num_classes", "plan", "agents"}:
        assert same(getattr(back, name), getattr(state, name)), name
    assert {a: i.hello for a, i in back.agents.items()} == {a: i.hello for a, i in state.agents.items()}
    store.close()
    assert SqliteStore.open(tmp_path, "f1").load_state("j-1").completed == 1  # not imported twice


@pytest.mark.parametrize("content", ["{\"run_id\": \"j-1\", \"config\"", "[1, 2]", "\xff\xfe"])
def test_an_unreadable_checkpoint_of_an_earlier_version_is_one_sentence(tmp_path, content):
    path = tmp_path / "coordinator-f1.json"
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        SqliteStore.open(tmp_path, "f1")
    message = str(err.value)
    assert message.startswith(f"The coordinator's checkpoint '{path}' cannot be read (")
    assert message.endswith("move it away to start its job anew.") and "\n" not in message
