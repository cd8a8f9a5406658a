"""MemoryStore: the in-memory ObjectStore for core unit tests.  It keeps the protocol's
promises (ETags, conditional writes and deletes, key order) and lets a test see and
steer every call: hooks before and after each call, and gates a test can wait on and
release to hold a call inside its window."""

from __future__ import annotations

import threading

import pytest
import trio

from ckptfs.store import (Call, MemoryStore, NotFound, PreconditionFailed, RetryingStore,
                          RetryPolicy, StoreError, TransientStoreError)


# ---------------------------------------------------------------- the protocol


def test_put_get_and_etags():
    s = MemoryStore()
    e1 = s.put("dirs/root/a", b"one")
    assert s.get("dirs/root/a") == (b"one", e1)
    e2 = s.put("dirs/root/a", b"two")
    assert e2 != e1 and e1 and e2
    assert s.get("dirs/root/a") == (b"two", e2)
    assert s.exists("dirs/root/a") and not s.exists("dirs/root/b")
    with pytest.raises(NotFound):
        s.get("dirs/root/b")


def test_conditional_writes_and_deletes():
    s = MemoryStore()
    etag = s.put_if_absent("k", b"1")
    assert etag
    assert s.put_if_absent("k", b"2") is None
    assert s.get("k")[0] == b"1"
    with pytest.raises(PreconditionFailed):
        s.put("k", b"3", if_match='"stale"')
    new = s.put("k", b"3", if_match=etag)
    with pytest.raises(PreconditionFailed):
        s.delete("k", if_match=etag)
    assert s.exists("k")
    s.delete("k", if_match=new)
    assert not s.exists("k")
    s.delete("k")                                   # a missing key: not an error
    with pytest.raises(PreconditionFailed):
        s.delete("k", if_match=new)                 # ... unless a version was asked for
    with pytest.raises(PreconditionFailed):
        s.put("k", b"4", if_match=new)


def test_list_in_key_order_with_sizes():
    s = MemoryStore()
    for key in ("dirs/b/x", "dirs/a/z", "dirs/a/y", "chunks/aa/1"):
        s.put(key, key.encode())
    listed = list(s.list("dirs/a"))
    assert [o.key for o in listed] == ["dirs/a/y", "dirs/a/z"]
    assert [o.size for o in listed] == [8, 8]
    assert [o.etag for o in listed] == [s.get("dirs/a/y")[1], s.get("dirs/a/z")[1]]
    assert [o.key for o in s.list("")] == sorted(["dirs/b/x", "dirs/a/z", "dirs/a/y",
                                                   "chunks/aa/1"])


def test_calls_are_recorded_in_order():
    s = MemoryStore()
    s.put("a", b"1")
    with pytest.raises(NotFound):
        s.get("b")
    list(s.list("a"))
    assert [(c.op, c.key) for c in s.calls] == [("put", "a"), ("get", "b"), ("list", "a")]
    assert isinstance(s.calls[1].error, NotFound) and s.calls[0].error is None


# ---------------------------------------------------------------- hooks


def test_a_before_hook_can_fail_a_call_which_then_changes_nothing():
    s = MemoryStore()
    s.put("dirs/root/a", b"old")

    def refuse(call: Call) -> None:
        raise TransientStoreError(f"503 on {call.key}")

    hook = s.before(refuse, op="put", prefix="dirs/")
    with pytest.raises(TransientStoreError, match="503 on dirs/root/a"):
        s.put("dirs/root/a", b"new")
    assert s.get("dirs/root/a")[0] == b"old"
    s.put("chunks/aa/x", b"c")                      # another prefix: not hooked
    hook.remove()
    s.put("dirs/root/a", b"new")
    assert s.get("dirs/root/a")[0] == b"new"


def test_after_hooks_see_the_result_and_the_error():
    s = MemoryStore()
    seen: list[tuple[str, object, object]] = []
    s.after(lambda c: seen.append((c.op, c.result, type(c.error).__name__ if c.error else None)))
    etag = s.put("k", b"1")
    assert s.put_if_absent("k", b"2") is None
    with pytest.raises(NotFound):
        s.get("nope")
    assert seen == [("put", etag, None), ("put_if_absent", None, None),
                    ("get", None, "NotFound")]


def test_fail_injects_a_number_of_failures_that_retries_get_through():
    s = MemoryStore()
    s.fail("put", TransientStoreError("injected"), times=2)
    retrying = RetryingStore(s, RetryPolicy(attempts=5, base_delay=0.001, max_delay=0.01,
                                            deadline=30))
    etag = retrying.put("k", b"x")
    assert s.get("k") == (b"x", etag)
    assert [c.op for c in s.calls].count("put") == 3
    s.fail("get", StoreError("permanent"), times=1)
    with pytest.raises(StoreError, match="permanent"):
        retrying.get("k")
    assert retrying.get("k")[0] == b"x"             # the failure was used up


# ---------------------------------------------------------------- gates


def test_a_gate_before_holds_the_call_until_released():
    s = MemoryStore()
    gate = s.gate("put", prefix="dirs/")
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.put("dirs/root/a", b"x"), done.set()))
    t.start()
    try:
        assert gate.wait_reached(timeout=30)
        assert gate.calls[0].key == "dirs/root/a"
        assert not s.exists("dirs/root/a") and not done.is_set()   # inside the window
    finally:
        gate.release()
    t.join(30)
    assert done.is_set() and s.get("dirs/root/a")[0] == b"x"
    s.put("dirs/root/b", b"y")                      # a used-up gate holds nothing


def test_a_gate_after_holds_the_caller_once_the_store_changed():
    s = MemoryStore()
    gate = s.gate("delete", when="after")
    s.put("k", b"x")
    t = threading.Thread(target=s.delete, args=("k",))
    t.start()
    try:
        assert gate.wait_reached(timeout=30)
        assert not s.exists("k")                    # done in the store, not yet returned
        assert t.is_alive()
    finally:
        gate.release()
    t.join(30)
    assert not t.is_alive()


def test_a_gate_holds_a_trio_task_in_a_worker_thread():
    s = MemoryStore()
    gate = s.gate("put")
    order: list[str] = []

    async def main() -> None:
        async def writer() -> None:
            await trio.to_thread.run_sync(s.put, "k", b"x")
            order.append("written")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            assert await trio.to_thread.run_sync(gate.wait_reached, 30)
            order.append("in window")
            gate.release()
        assert order == ["in window", "written"]

    trio.run(main)
    assert s.get("k")[0] == b"x"


def test_a_gate_never_released_fails_the_call_instead_of_hanging():
    s = MemoryStore(gate_limit=0.2)
    s.gate("get")
    s.put("k", b"x")
    with pytest.raises(StoreError, match="gate on get k was never released"):
        s.get("k")
