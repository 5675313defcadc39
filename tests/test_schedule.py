"""rl.schedule.ChunkQueue on its own (no Ray, no vLLM, no processes; a fake clock): chunks handed to idle
workers, deadlines and their restarts, re-send after a failure, a fallback for the item a lost worker
was on, first answer wins, a worker that never answers, the completeness error, and thread workers
taking and answering for themselves."""

import threading

import pytest

from rl.schedule import ChunkQueue, Incomplete


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(n=7, size=3, limit=10.0, **kw):
    clock = Clock()
    return ChunkQueue(n, size, limit, clock=clock, **kw), clock


def test_chunks_go_to_idle_workers_in_order():
    q, _ = make()
    assert list(q.pending) == [[0, 1, 2], [3, 4, 5], [6]]
    assert q.take("a") == [0, 1, 2] and q.busy("a")
    assert q.take("a") == []  # one lease per worker
    assert q.take("b") == [3, 4, 5] and q.busy_workers() == ["a", "b"]
    for i in (0, 1, 2):
        assert q.answer("a", i, i * 10)
    assert not q.busy("a") and q.take("a") == [6]  # an answered chunk frees its worker
    for w, items in (("b", (3, 4, 5)), ("a", (6,))):
        for i in items:
            q.answer(w, i, i * 10)
    assert q.finished and not q.pending and q.take("c") == []
    assert q.ordered() == [0, 10, 20, 30, 40, 50, 60]


def test_deadline_restarts_with_each_answer_and_take_can_grant_a_first_limit():
    q, clock = make(limit=10.0)
    q.take("a", limit_s=60.0)  # e.g. loading the reward
    clock.t += 30
    assert q.late() == [] and q.wait_s() == pytest.approx(30.0)
    q.touch("a")  # loaded: from now on the queue's own limit
    assert q.wait_s() == pytest.approx(10.0) and q.wait_s(cap=1.0) == 1.0
    clock.t += 9
    q.answer("a", 0, "x")  # each answered item gets a fresh limit
    clock.t += 9
    assert q.late() == []
    clock.t += 2
    assert q.late() == ["a"] and q.wait_s() == 0.0


def test_no_limit_means_never_late():
    q, clock = make(limit=None)
    q.take("a")
    clock.t += 1e9
    assert q.late() == [] and q.wait_s() is None and q.wait_s(cap=2.0) == 2.0


def test_a_lost_worker_has_its_unanswered_items_resent_first():
    q, _ = make()
    q.take("a"), q.take("b")
    q.answer("a", 0, "a0")
    loss = q.lose("a")  # died after answering item 0
    assert (loss.worker, loss.settled, loss.requeued) == ("a", None, [1, 2])
    assert list(q.pending) == [[1, 2], [6]] and not q.busy("a")
    assert q.take("c") == [1, 2]  # re-sent before anything else, as one chunk
    assert q.lose("a") is None  # nothing left to lose


def test_a_fallback_settles_the_item_the_worker_was_on_and_resends_the_rest():
    q, _ = make()
    q.take("a")
    q.answer("a", 0, (True, 1.0))
    loss = q.lose("a", (False, "timed out", True))
    assert (loss.settled, loss.requeued) == (1, [2])
    assert q.results == {0: (True, 1.0), 1: (False, "timed out", True)}
    assert q.take("b") == [2]


def test_first_answer_wins():
    q, _ = make(n=2, size=2)
    q.take("a")
    q.lose("a")  # hung: its chunk goes to b
    assert q.take("b") == [0, 1]
    assert q.answer("a", 0, "late but first")  # a late answer still counts if nobody answered yet
    assert not q.answer("b", 0, "second")  # ... and a second answer changes nothing
    assert q.busy("b")  # b still owes item 1
    assert q.answer("b", 1, "b1") and q.ordered() == ["late but first", "b1"]
    assert not q.busy("b")


def test_a_worker_that_never_answers_is_lost_and_its_chunk_finished_elsewhere():
    q, clock = make(n=4, size=2, limit=5.0)
    q.take("hangs"), q.take("ok")
    q.answer("ok", 2, 2), q.answer("ok", 3, 3)
    clock.t += 6
    assert q.late() == ["hangs"]
    assert q.lose("hangs").requeued == [0, 1]
    assert q.take("ok") == [0, 1]
    q.answer("ok", 0, 0), q.answer("ok", 1, 1)
    assert q.finished and q.ordered() == [0, 1, 2, 3]


def test_lose_if_late_spares_a_worker_that_answered_in_the_meantime():
    q, clock = make(limit=5.0)
    q.take("a")
    clock.t += 6
    assert q.late() == ["a"]
    for i in (0, 1, 2):  # answered between the supervisor's look and its decision
        q.answer("a", i, i)
    q.take("a")  # and started its next chunk with a fresh deadline
    assert q.lose("a", "fallback", if_late=True) is None and q.busy("a")
    clock.t += 6
    assert q.lose("a", "fallback", if_late=True).settled == 3


def test_incomplete_run_is_refused():
    q, _ = make(n=3, size=3)
    q.take("a")
    q.answer("a", 1, "one")
    with pytest.raises(Incomplete, match=r"items \[0, 2\] missing") as e:
        q.ordered()
    assert e.value.missing == q.missing() == [0, 2]


def test_run_deadline_and_close():
    q, clock = make(limit=50.0, deadline=110.0)
    q.take("a")
    assert not q.overdue() and q.wait_s() == pytest.approx(10.0)  # the run's deadline comes first
    clock.t = 110.0
    assert q.overdue()
    q.close()
    assert q.take("b") == [] and not q.answer("a", 0, "after close") and q.results == {}


def test_settled_items_are_skipped_when_a_chunk_comes_back():
    q, _ = make(n=3, size=3)
    q.take("a")
    q.lose("a")
    q.take("b")
    q.answer("b", 0, "b0")
    q.lose("b")  # [1, 2] queued again
    q.answer("a", 1, "a1")  # the first worker's late answer
    assert q.take("c") == [2]


def test_thread_workers_take_and_answer_for_themselves():
    q = ChunkQueue(500, 1, 5.0)
    seen = []

    def lane(name):
        while chunk := q.take(name):
            for i in chunk:
                seen.append(i)
                assert q.answer(name, i, i * i)

    lanes = [threading.Thread(target=lane, args=(f"lane{k}",)) for k in range(4)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(timeout=10)
    assert sorted(seen) == list(range(500))  # each item taken exactly once
    assert q.ordered() == [i * i for i in range(500)]
