"""One retry policy (attempts, backoff, deadline) for every retry loop: the store's
retries, the background publish queue, lease renewals and pending-seal polls, and the
cache's refetch of a corrupt chunk."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from ckptfs.data.publish_queue import PublishQueue
from ckptfs.store.retrypolicy import RetryPolicy
from ckptfs.store.retry import StoreStats
from ckptfs.store import (MemoryStore, RetryingStore, StoreError, StoreTimeout, TransientStoreError,
                          store_policy)


def test_backoff_doubles_up_to_its_cap():
    p = RetryPolicy(attempts=None, base_delay=0.5, max_delay=3.0)
    assert [p.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    slow = RetryPolicy(attempts=None, base_delay=0.2, factor=1.5, max_delay=2.0)
    assert [round(slow.delay(n), 4) for n in (1, 2, 3)] == [0.2, 0.3, 0.45]


def test_full_jitter_stays_within_the_backoff():
    p = RetryPolicy(base_delay=1.0, max_delay=4.0, jitter=True)
    assert p.delay(3, rand=lambda: 0.0) == 0.0
    assert p.delay(3, rand=lambda: 0.5) == 2.0
    assert all(0.0 <= p.delay(n) <= min(4.0, 2.0 ** (n - 1)) for n in range(1, 20))


def test_attempts_bound_the_tries_and_none_never_gives_up():
    p = RetryPolicy(attempts=3)
    assert [p.gives_up(n) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert not RetryPolicy(attempts=None).gives_up(10 ** 6)


def test_the_store_policy_keeps_its_numbers():
    p = store_policy(42.0)
    assert (p.attempts, p.deadline, p.jitter) == (6, 42.0, True)
    assert p.delay(1, rand=lambda: 1.0) == 0.2 and p.delay(9, rand=lambda: 1.0) == 5.0


def test_the_retrying_store_stops_after_the_policy_s_attempts():
    inner = MemoryStore()
    inner.fail("put", TransientStoreError("503"), times=100)
    store = RetryingStore(inner, RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.001,
                                             deadline=30))
    with pytest.raises(TransientStoreError):
        store.put("k", b"x")
    assert [c.op for c in inner.calls] == ["put"] * 3


def test_the_cpu_of_a_store_request_is_counted_by_its_kind():
    """The request runs in the store's own thread: its CPU is counted there, by kind
    (the bench splits the daemon's CPU with it; the caller's thread only waits)."""
    class Spinning(MemoryStore):
        def put(self, key, data, sha256=None, *, if_match=None):
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
            return super().put(key, data, sha256, if_match=if_match)

    stats = StoreStats()
    store = RetryingStore(Spinning(), RetryPolicy(deadline=30), stats=stats)
    waited = time.thread_time()
    store.put("k", b"x")
    waited = time.thread_time() - waited
    store.get("k")
    cpu = stats.snapshot()["cpu_s"]
    assert cpu["put"] >= 0.05 > waited
    assert set(cpu) == {"put", "get"} and cpu["get"] < 0.05


def test_the_retrying_store_needs_a_deadline():
    with pytest.raises(ValueError, match="deadline"):
        RetryingStore(MemoryStore(), RetryPolicy(deadline=None))
    inner = MemoryStore(gate_limit=30)
    gate = inner.gate("get")
    store = RetryingStore(inner, RetryPolicy(deadline=1.0))
    try:
        with pytest.raises(StoreTimeout, match="get k after 1 s"):
            store.get("k")
    finally:
        gate.release()


def _run_queue(policy: RetryPolicy, failures: int,
               error: Exception) -> tuple[list[float], PublishQueue]:
    """Publish one inode through a queue whose publish fails ``failures`` times; return
    the (virtual) times of every attempt."""
    times: list[float] = []

    async def publish(ino: int) -> bool:
        times.append(trio.current_time())
        if len(times) <= failures:
            raise error
        return True

    queue = PublishQueue(publish, workers=1, policy=policy)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            queue.submit(7)
            with trio.move_on_after(1000):
                await queue.wait_idle()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return times, queue


def test_the_publish_queue_backs_off_by_its_policy():
    policy = RetryPolicy(attempts=None, base_delay=2.0, max_delay=5.0)
    times, queue = _run_queue(policy, 4, TransientStoreError("503"))
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    assert gaps == [2.0, 4.0, 5.0, 5.0]
    assert not queue.queued and not queue.failing


def test_an_outage_is_retried_past_the_policy_s_attempts():
    """A store that is away (here 503s) is an outage: retried until it answers, however
    many attempts the policy names (decision 0016)."""
    times, queue = _run_queue(RetryPolicy(attempts=3, base_delay=1.0, max_delay=5.0), 10,
                              TransientStoreError("503"))
    assert len(times) == 11
    assert not queue.queued and not queue.failed and queue.health.cause is None


def test_a_refused_publish_needs_an_operator_and_is_still_retried():
    """A request the store refuses is never given up: it waits for an operator (in
    ``failed``, said once) and is tried again every ``refused_retry`` seconds."""
    times: list[float] = []

    async def publish(ino: int) -> bool:
        times.append(trio.current_time())
        raise StoreError("InvalidArgument: bad key")

    queue = PublishQueue(publish, workers=1, refused_retry=300.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(queue.run)
            queue.submit(7)
            await queue.wait_idle()          # returns: nothing left but what waits
            assert 7 in queue.failed and "needs an operator" in queue.failing[7]
            await trio.sleep(700)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert times == [0.0, 300.0, 600.0]
    assert queue.queued == {7} and not queue.active()     # kept journaled


def test_a_corrupt_chunk_is_fetched_as_often_as_the_cache_policy_says(tmp_path):
    import hashlib

    from ckptfs.errors import FsError
    from ckptfs.format.remote import chunk_key
    from ckptfs.data.cache import ChunkCache

    body = b"chunk body"
    sha = hashlib.sha256(body).hexdigest()
    store = MemoryStore()
    store.put(chunk_key(sha), b"corrupt!!!")
    cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(1),
                       verify=RetryPolicy(attempts=4, base_delay=0.0))

    async def main() -> None:
        with pytest.raises(FsError, match="corrupt in the store"):
            await cache.ensure(sha, len(body))

    trio.run(main)
    assert [c.op for c in store.calls if c.op == "get"] == ["get"] * 4
    assert cache.corrupt_events == 4


def test_lease_renewals_and_pending_polls_back_off_by_their_policies(tmp_path):
    from ckptfs.cluster.leases import MAX_POLL, LeaseManager
    from ckptfs.meta.namespace import Namespace

    async def seal(ino: int) -> bool:
        return True

    ns = Namespace(tmp_path / "meta")
    try:
        leases = LeaseManager(ns, MemoryStore(), 30.0, lambda ino: 0, lambda ino: False,
                              lambda ino: False, seal)
        assert [leases.renew_retry.delay(n) for n in (1, 2, 3, 4)] == [2.5, 5.0, 10.0, 10.0]
        assert not leases.renew_retry.gives_up(10 ** 6)
        polls = [round(leases.pending_poll.delay(n), 4) for n in (1, 2, 3, 10)]
        assert polls == [0.2, 0.3, 0.45, MAX_POLL]
    finally:
        ns.close()


def test_the_metadata_log_retries_a_record_by_its_policy(tmp_path):
    from ckptfs.meta.namespace import Namespace
    from ckptfs.meta.oplog import MetaLog

    ns = Namespace(tmp_path / "meta")
    times: list[float] = []
    log = MetaLog(ns, policy=RetryPolicy(attempts=None, base_delay=1.0, max_delay=3.0))
    log.add({"kind": "mkdir", "ino": 5}, [1])

    async def execute(seq: int, record: dict) -> None:
        times.append(trio.current_time())
        if len(times) <= 4:
            raise TransientStoreError("503")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run, execute)
            with trio.move_on_after(1000):
                await log.wait_idle()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        ns.close()
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    assert gaps == [1.0, 2.0, 3.0, 3.0] and not log.pending
