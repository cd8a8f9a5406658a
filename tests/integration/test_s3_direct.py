"""The direct S3 client (``store/s3_http.py``, decision 0014) against a real SeaweedFS:
the bytes it moves are the bytes boto3 sees, and every failure comes back in the store
protocol's terms (not found, access denied, missing bucket, transient) exactly as the
boto3 path reports it — the retry layer above must not see a difference."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from support.s3_direct import Frozen, direct_store, proxied_store, sha
from ckptfs.store import (NotFound, PreconditionFailed, StoreError,
                          TransientStoreError, is_permanent)


def test_direct_and_boto3_read_each_other_s_objects(seaweed):
    direct = direct_store(seaweed)
    boto = direct_store(seaweed, prefix=direct.prefix, direct=False)
    data = os.urandom((8 << 20) + 5)
    etag = direct.put("chunks/ab/one", memoryview(data), sha256=sha(data))
    assert boto.get("chunks/ab/one") == (data, etag)
    other = os.urandom(3 << 20)
    etag2 = boto.put("chunks/ab/two", other, sha256=sha(other))
    assert direct.get("chunks/ab/two") == (other, etag2)
    # Names that need quoting in a URL reach the same key either way.
    odd = "dirs/root/a b%2F+é?#x"
    direct.put(odd, b"entry")
    assert boto.get(odd)[0] == b"entry"
    assert [o.key for o in boto.list("dirs/root/")] == [odd]


def test_get_into_fills_the_buffer_and_reports_a_longer_object(seaweed):
    store = direct_store(seaweed)
    data = os.urandom(1 << 20)
    etag = store.put("chunks/cd/x", data, sha256=sha(data))
    exact = bytearray(len(data))
    assert store.get_into("chunks/cd/x", exact) == (len(data), etag)
    assert exact == data
    bigger = bytearray(len(data) + 4096)
    assert store.get_into("chunks/cd/x", bigger)[0] == len(data)
    assert bigger[:len(data)] == data
    smaller = bytearray(len(data) // 2)
    assert store.get_into("chunks/cd/x", smaller)[0] == len(data)
    # The connection left unread was not reused: the next request is answered right.
    assert store.get("chunks/cd/x") == (data, etag)
    with pytest.raises(NotFound):
        store.get_into("chunks/cd/missing", exact)


def test_conditional_put_and_missing_keys(seaweed):
    store = direct_store(seaweed)
    first = store.put("dirs/root/a", b"one")
    with pytest.raises(PreconditionFailed):
        store.put("dirs/root/a", b"two", if_match='"0000"')
    with pytest.raises(PreconditionFailed):
        store.put("dirs/root/nothing", b"two", if_match=first)
    with pytest.raises(NotFound):
        store.get("dirs/root/nothing")
    assert store.get("dirs/root/a")[0] == b"one"


def test_a_body_that_does_not_match_its_digest_is_refused(seaweed):
    store = direct_store(seaweed)
    data = os.urandom(1 << 16)
    with pytest.raises(StoreError) as info:
        store.put("chunks/ef/bad", data, sha256=sha(b"something else"))
    # BadDigest: the server checked the body, and refused it; a body damaged on its way
    # is worth sending again from the same buffer (decision 0025): transient, not final
    assert "BadDigest" in str(info.value) and not is_permanent(info.value)
    with pytest.raises(NotFound):
        store.get("chunks/ef/bad")


def test_wrong_credentials_and_missing_bucket_are_permanent_and_say_why(seaweed):
    store = direct_store(seaweed)
    store.direct.credentials = lambda: Frozen("AKIDWRONG", "not-the-secret")
    with pytest.raises(StoreError) as info:
        store.put("chunks/aa/x", b"x" * 10, sha256=sha(b"x" * 10))
    assert is_permanent(info.value) and "access denied" in str(info.value)
    with pytest.raises(StoreError) as info:
        store.get("chunks/aa/x")
    assert is_permanent(info.value) and "access denied" in str(info.value)
    missing = direct_store(seaweed, bucket="no-such-bucket-" + uuid.uuid4().hex[:8])
    with pytest.raises(StoreError) as info:
        missing.get("chunks/aa/x")
    assert is_permanent(info.value) and "does not exist" in str(info.value)


@pytest.mark.parametrize("mode", ["503", "refuse", "reset"])
def test_network_faults_are_transient(seaweed, mode):
    with proxied_store(seaweed, mode=mode) as (store, proxy):
        data = os.urandom(1 << 20)
        with pytest.raises(TransientStoreError):
            store.put("chunks/12/x", data, sha256=sha(data))
        with pytest.raises(TransientStoreError):
            store.get_into("chunks/12/x", bytearray(len(data)))


def test_a_hung_server_times_out_within_the_socket_timeout(seaweed):
    with proxied_store(seaweed, mode="hang", timeout=2.0) as (store, proxy):
        started = time.monotonic()
        with pytest.raises(TransientStoreError) as info:
            store.get("chunks/12/x")
        assert time.monotonic() - started < 10
        assert "timeout" in str(info.value)


def test_a_kept_connection_the_server_dropped_is_replaced_without_an_error(seaweed):
    with proxied_store(seaweed) as (store, proxy):
        data = os.urandom(1 << 20)
        store.put("chunks/34/x", data, sha256=sha(data))
        kept = proxy.accepted["pass"]
        proxy.reset_all_and_next(0)       # idle keep-alive connections die
        assert store.get("chunks/34/x")[0] == data
        store.put("chunks/34/y", data, sha256=sha(data))
        assert proxy.accepted["pass"] == kept + 1     # one fresh connection, no error


def test_boto3_setting_keeps_every_call_on_boto3(seaweed):
    store = direct_store(seaweed, direct=False)
    data = os.urandom(1000)
    store.put("chunks/56/x", memoryview(data), sha256=sha(data))
    assert store.get_into("chunks/56/x", bytearray(2000))[0] == 1000


def test_head_goes_direct_answers_both_ways_and_keeps_its_connection(seaweed):
    """A chunk's existence check (a HEAD per new chunk) is the direct client's: through
    botocore it cost ~3 ms of CPU each, and a small-file copy makes one per file."""
    with proxied_store(seaweed) as (store, proxy):
        def no_boto3(**_kw):
            raise AssertionError("HEAD went through boto3")
        store.client.head_object = no_boto3
        store.put("chunks/78/x", b"here")
        assert store.exists("chunks/78/x")
        assert not store.exists("chunks/78/missing")
        connections = proxy.accepted["pass"]
        for _ in range(5):
            assert store.exists("chunks/78/x") and not store.exists("chunks/78/missing")
        assert proxy.accepted["pass"] == connections, "each HEAD opened a new connection"
        assert store.get("chunks/78/x")[0] == b"here"
    wrong = direct_store(seaweed)
    wrong.direct.credentials = lambda: Frozen("AKIDWRONG", "not-the-secret")
    with pytest.raises(StoreError) as info:
        wrong.exists("chunks/78/x")
    assert is_permanent(info.value) and "access denied" in str(info.value)
