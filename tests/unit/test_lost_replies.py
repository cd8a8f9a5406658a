"""A conditional write whose reply was lost (the request acted; a reset or a timeout
hid its answer) is retried by ``RetryingStore``, and the retry meets the write's own
work: a 412, "exists", or a conditional delete's 412 on a key now gone.  Taken at its
word, the caller thought another node had got there first.

Found by the core model once it lost store messages (``lose_messages``): an rmdir's
claim whose reply was lost found its own claim on the retry, took it for another
rmdir's and waited out the claim's 60 s TTL, holding async mode's metadata log.  Now
``RetryingStore`` checks such an answer against the store (entry bodies are unique)."""

from __future__ import annotations

import pytest

from ckptfs.store import MemoryStore, PreconditionFailed, RetryingStore, TransientStoreError
from ckptfs.store.memory import Call
from ckptfs.store.retrypolicy import RetryPolicy

FAST = RetryPolicy(attempts=5, base_delay=0.001, max_delay=0.001, deadline=10.0)


def _lose_next_reply(store: MemoryStore, op: str) -> None:
    def lose(call: Call) -> None:
        if call.error is None:
            raise TransientStoreError(f"injected: the {op} reply was lost")
    store.after(lose, op, times=1)


def _lose_next_request(store: MemoryStore, op: str) -> None:
    def lose(call: Call) -> None:
        raise TransientStoreError(f"injected: the {op} request was lost")
    store.before(lose, op, times=1)


def test_a_compare_and_swap_whose_reply_was_lost_succeeds():
    inner = MemoryStore()
    store = RetryingStore(inner, FAST)
    etag = store.put("k", b"one")
    _lose_next_reply(inner, "put")
    new = store.put("k", b"two", if_match=etag)
    assert inner.get("k") == (b"two", new)


def test_a_put_if_absent_whose_reply_was_lost_succeeds():
    inner = MemoryStore()
    store = RetryingStore(inner, FAST)
    _lose_next_reply(inner, "put_if_absent")
    etag = store.put_if_absent("k", b"mine")
    assert etag and inner.get("k") == (b"mine", etag)


def test_a_conditional_delete_whose_reply_was_lost_succeeds():
    inner = MemoryStore()
    store = RetryingStore(inner, FAST)
    etag = store.put("k", b"one")
    _lose_next_reply(inner, "delete")
    store.delete("k", if_match=etag)
    assert not inner.exists("k")


def test_another_writer_s_change_still_fails_a_retried_compare_and_swap():
    """A lost *request* (nothing acted) retried into another writer's change: that
    412 is real."""
    inner = MemoryStore()
    store = RetryingStore(inner, FAST)
    etag = store.put("k", b"one")

    def theirs(call: Call) -> None:
        inner.put("k", b"theirs")
        raise TransientStoreError("injected: the put request was lost")
    inner.before(theirs, "put", times=1)
    with pytest.raises(PreconditionFailed):
        store.put("k", b"mine", if_match=etag)
    assert inner.get("k")[0] == b"theirs"
    _lose_next_request(inner, "put_if_absent")
    assert store.put_if_absent("k", b"mine") is None
    _lose_next_request(inner, "delete")
    with pytest.raises(PreconditionFailed):
        store.delete("k", if_match=etag)
    assert inner.get("k")[0] == b"theirs"
