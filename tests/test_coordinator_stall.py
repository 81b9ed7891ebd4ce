"""A job that does not progress says why (coordinator.stall), without a broker: the sentence
for each kind of wait, and when it is said (after the stall time, again every stall time,
never while the job progresses)."""

from __future__ import annotations

from coordinator.stall import StallWatch, progress_mark, waiting_for
from tests.test_coordinator_accept import state


def test_the_sentence_names_what_the_job_waits_for():
    s = state()  # round 2, cluster 0 waiting for a0 and a1
    s.clusters[0].expected = {"a0", "a1"}
    s.clusters[0].deadline = 130.0
    assert waiting_for(s, key_ready=True, link_up=True, keyserver_online=True, now=100.0) == \
        "round 2 cluster 0: 0/2 updates (deadline in 30 s)"
    assert waiting_for(s, key_ready=True, link_up=False, keyserver_online=False, now=100.0).startswith(
        "the broker link is down (reconnecting); the key server is offline; round 2 cluster 0")
    s.clusters[0].phase, s.clusters[0].requested_at = "decrypting", 90.0
    assert waiting_for(s, key_ready=True, link_up=True, keyserver_online=True, now=100.0) == \
        "round 2 cluster 0: the key server's verdict (asked 10 s ago)"
    s.clusters[0].phase = "done"
    assert waiting_for(s, key_ready=True, link_up=True, keyserver_online=True) == "round 3 to open"
    s.plan = None
    assert waiting_for(s, key_ready=False, link_up=True, keyserver_online=None) == \
        "the key server's public key for this job"
    assert waiting_for(None, key_ready=True, link_up=True, keyserver_online=True) == "no job is running"


def test_a_stall_is_said_after_the_stall_time_and_again_every_stall_time():
    s = state()
    watch = StallWatch(after=60.0)
    mark = lambda: progress_mark(s, True)  # noqa: E731
    assert watch.check(mark, now=0.0) == 0.0  # first look: progress
    assert watch.check(mark, now=0.5) is None  # at most once a second
    assert watch.check(mark, now=59.0) is None
    assert watch.check(mark, now=61.0) == 61.0  # said
    assert watch.check(mark, now=100.0) is None
    assert watch.check(mark, now=122.0) == 122.0  # said again
    s.round = 3  # progress
    assert watch.check(mark, now=130.0) == 0.0
    assert watch.check(mark, now=150.0) is None
