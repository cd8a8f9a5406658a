"""RetryingStore: one overall deadline per call, all attempts together; permanent errors
never retried; close() gives up the calls in flight.  An in-memory store that hangs or
fails on demand stands in for the network (unit level)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ckptfs.store import (RetryingStore, RetryPolicy, StoreClosed, StoreError, StoreTimeout,
                          TransientStoreError, is_permanent, NotFound, PreconditionFailed)


class FlakyStore:
    url = "mem://"

    def __init__(self) -> None:
        self.calls = 0
        self.behaviour = "ok"          # ok | hang | transient | permanent
        self.release = threading.Event()

    def put(self, key, data, sha256=None, *, if_match=None):
        self.calls += 1
        if self.behaviour == "hang":
            self.release.wait(30)
        if self.behaviour == "transient":
            raise TransientStoreError("503 on " + key)
        if self.behaviour == "permanent":
            raise StoreError("InvalidArgument: bad (" + key + ")")
        return '"etag"'


def test_a_hanging_call_ends_at_the_deadline_with_op_and_key(caplog):
    inner = FlakyStore()
    inner.behaviour = "hang"
    store = RetryingStore(inner, RetryPolicy(deadline=1.0))
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="ckptfs.store"):
        with pytest.raises(StoreTimeout) as info:
            store.put("dirs/root/model.bin", b"x")
    elapsed = time.monotonic() - started
    inner.release.set()
    assert "store timeout: put dirs/root/model.bin after 1 s" in str(info.value)
    assert elapsed < 10          # bounded (generous: never a timing assertion on 1 s)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "dirs/root/model.bin" in errors[0].getMessage()


def test_transient_errors_are_retried_but_not_past_the_deadline():
    inner = FlakyStore()
    inner.behaviour = "transient"
    store = RetryingStore(inner, RetryPolicy(attempts=10_000, base_delay=0.05, max_delay=0.2,
                                             deadline=1.0))
    with pytest.raises(StoreTimeout, match="put k after 1 s"):
        store.put("k", b"x")
    assert inner.calls > 1


def test_permanent_errors_are_never_retried():
    inner = FlakyStore()
    inner.behaviour = "permanent"
    store = RetryingStore(inner, RetryPolicy(deadline=30))
    with pytest.raises(StoreError) as info:
        store.put("k", b"x")
    assert inner.calls == 1 and is_permanent(info.value)
    assert not is_permanent(TransientStoreError("x")) and not is_permanent(NotFound("k"))
    assert not is_permanent(PreconditionFailed("k")) and not is_permanent(StoreTimeout("t"))


def test_close_gives_up_calls_in_flight_at_once():
    inner = FlakyStore()
    inner.behaviour = "hang"
    store = RetryingStore(inner, RetryPolicy(deadline=60))
    errors = []

    def call():
        try:
            store.put("k", b"x")
        except StoreError as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.2)
    store.close()
    t.join(10)
    inner.release.set()
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreClosed)
    with pytest.raises(StoreClosed):
        store.put("k2", b"x")


def test_results_come_back_and_threads_are_reused():
    inner = FlakyStore()
    store = RetryingStore(inner, RetryPolicy(deadline=5))
    before = threading.active_count()
    for i in range(200):
        assert store.put(f"k{i}", b"x") == '"etag"'
    assert threading.active_count() <= before + 2
