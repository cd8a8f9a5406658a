"""The direct S3 client (``store/s3_http.py``) against a real SeaweedFS, the way a hostile
server or network meets it: large bodies the server refuses before reading them, names
that need quoting, empty objects, connections left in odd states.  Every failure must
come back as what it is (permanent or transient), never as a hang or the wrong kind."""

from __future__ import annotations

import os

import pytest

from support.mounts import BUCKET
from support.proxy import FaultProxy
from support.s3_direct import Frozen, direct_store, proxied_store, sha
from ckptfs.store import NotFound, S3Store, StoreError, is_permanent


def test_a_large_put_with_wrong_credentials_says_why(seaweed):
    data = os.urandom(16 << 20)
    store = direct_store(seaweed)
    store.direct.credentials = lambda: Frozen("AKIDWRONG", "not-the-secret")
    with pytest.raises(StoreError) as info:
        store.put("chunks/aa/big", memoryview(data), sha256=sha(data))
    assert is_permanent(info.value) and "access denied" in str(info.value), info.value


def test_empty_and_tiny_objects_round_trip_and_keep_the_connection_usable(seaweed):
    store = direct_store(seaweed)
    for n in (0, 1, 2):
        body = os.urandom(n)
        etag = store.put(f"chunks/00/{n}", body, sha256=sha(body))
        assert store.get(f"chunks/00/{n}") == (body, etag)
        buf = bytearray(8)
        assert store.get_into(f"chunks/00/{n}", buf) == (n, etag)
        assert bytes(buf[:n]) == body
    with pytest.raises(NotFound):
        store.get_into("chunks/00/missing", bytearray(8))
    assert store.get("chunks/00/1")[0] == store.get("chunks/00/1")[0]


@pytest.mark.parametrize("key", ["dirs/root/%41", "dirs/root/a=b&c;d", "dirs/root/~x!'()*",
                                 "dirs/root/tab\there", "dirs/root/日本語 ✓"])
def test_names_that_need_quoting_are_stored_under_the_same_key(seaweed, key):
    direct = direct_store(seaweed)
    boto = S3Store(BUCKET, direct.prefix, seaweed.endpoint_url, direct=False)
    direct.put(key, b"entry")
    assert boto.get(key)[0] == b"entry"
    assert direct.get(key)[0] == b"entry"
    assert [o.key for o in boto.list("dirs/root/")] == [key]


def test_a_get_into_a_short_buffer_then_an_error_body_keep_the_pool_sane(seaweed):
    with proxied_store(seaweed) as (store, proxy):
        data = os.urandom(3 << 20)
        etag = store.put("chunks/77/x", data, sha256=sha(data))
        for _ in range(3):
            assert store.get_into("chunks/77/x", bytearray(1 << 20))[0] == len(data)
            with pytest.raises(NotFound):
                store.get("chunks/77/missing")
            with pytest.raises(StoreError):
                store.put("chunks/77/bad", data, sha256=sha(b"other"))
            buf = bytearray(len(data))
            assert store.get_into("chunks/77/x", buf) == (len(data), etag)
            assert buf == data


def test_after_bodies_cut_mid_way_the_next_requests_are_answered_right(seaweed):
    from ckptfs.store import TransientStoreError
    with proxied_store(seaweed) as (store, proxy):
        data = os.urandom(4 << 20)
        etag = store.put("chunks/88/x", data, sha256=sha(data))
        for _ in range(3):
            proxy.mode = "reset"
            with pytest.raises(TransientStoreError):
                store.get_into("chunks/88/x", bytearray(len(data)))
            with pytest.raises(TransientStoreError):
                store.put("chunks/88/y", data, sha256=sha(data))
            proxy.mode = "pass"
            buf = bytearray(len(data))
            assert store.get_into("chunks/88/x", buf) == (len(data), etag)
            assert buf == data
            assert store.get("chunks/88/x") == (data, etag)


def test_a_conditional_put_after_the_server_dropped_every_idle_connection(seaweed):
    """Parallel chunk transfers leave several keep-alive connections idle; the server
    drops them all (its idle timeout).  A conditional PUT (an entry write: never resent
    on a fresh connection after a failure) must not meet the dead ones one by one until
    its retries run out."""
    import threading

    from ckptfs.store import RetryingStore, StoreStats, store_policy
    proxy = FaultProxy(seaweed.s3_port)
    try:
        raw = direct_store(seaweed, endpoint=proxy.endpoint_url)
        data = os.urandom(1 << 20)
        raw.put("chunks/99/x", data, sha256=sha(data))
        barrier = threading.Barrier(10)

        def fetch():
            barrier.wait()
            raw.get("chunks/99/x")
        threads = [threading.Thread(target=fetch) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = raw.put("dirs/root/entry", b"one")
        proxy.reset_all_and_next(0)               # every idle connection dies
        stats = StoreStats()
        store = RetryingStore(raw, store_policy(20.0), stats=stats)
        store.put("dirs/root/entry", b"two", if_match=first)
        assert raw.get("dirs/root/entry")[0] == b"two"
        # Ten dead connections met one by one would be ten retries.  At most one: on a
        # loaded machine a loopback RST may still be queued (softirq) when the pool
        # checks the connection it takes, and that one request fails once (CI, once).
        assert stats.retries <= 1, stats
    finally:
        proxy.close()
