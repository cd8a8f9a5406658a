"""Conditional writes and deletes on both real stores: the primitive the rename and
directory-entry protocols stand on (decision 0003)."""

from __future__ import annotations

import pytest

from ckptfs.store import LocalStore, PreconditionFailed, S3Store, NotFound


@pytest.fixture(params=["local", "s3"])
def raw_store(request, tmp_path):
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return LocalStore(root)
    server = request.getfixturevalue("seaweed")
    import os
    import uuid
    os.environ.update(server.env())
    from support.mounts import BUCKET
    return S3Store(BUCKET, uuid.uuid4().hex[:12], server.endpoint_url)


def test_put_if_match_swaps_only_the_expected_version(raw_store):
    first = raw_store.put("dirs/root/a", b"one")
    second = raw_store.put("dirs/root/a", b"two", if_match=first)
    assert raw_store.get("dirs/root/a") == (b"two", second)
    with pytest.raises(PreconditionFailed):
        raw_store.put("dirs/root/a", b"three", if_match=first)
    assert raw_store.get("dirs/root/a")[0] == b"two"
    with pytest.raises(PreconditionFailed):
        raw_store.put("dirs/root/missing", b"x", if_match=first)
    with pytest.raises(NotFound):
        raw_store.get("dirs/root/missing")


def test_delete_if_match_removes_only_the_expected_version(raw_store):
    first = raw_store.put("dirs/root/b", b"one")
    second = raw_store.put("dirs/root/b", b"two")
    with pytest.raises(PreconditionFailed):
        raw_store.delete("dirs/root/b", if_match=first)
    assert raw_store.get("dirs/root/b")[0] == b"two"
    raw_store.delete("dirs/root/b", if_match=second)
    with pytest.raises(NotFound):
        raw_store.get("dirs/root/b")
    with pytest.raises(PreconditionFailed):
        raw_store.delete("dirs/root/b", if_match=second)
    raw_store.delete("dirs/root/b")  # unconditional delete of a missing key is fine


@pytest.mark.parametrize("direct", [True, False])
def test_a_put_whose_writer_dies_after_its_head_writes_nothing(seaweed, direct):
    """A daemon SIGKILLed between a PUT's head and its body: the store must not take the
    missing body for an empty object (SeaweedFS did, for a PUT without a checksum
    header: an empty directory entry, and an unconditional PUT emptied a good one).
    Every write ckptfs sends carries a checksum of its body, so a torn one is refused."""
    import os
    import uuid
    from support.mounts import BUCKET
    from support.proxy import FaultProxy
    from ckptfs.store import StoreError
    os.environ.update(seaweed.env())
    prefix = uuid.uuid4().hex[:12]
    healthy = S3Store(BUCKET, prefix, seaweed.endpoint_url)
    good = healthy.put("dirs/root/kept", b'{"type": "file"}')
    proxy = FaultProxy(seaweed.s3_port, mode="torn")
    try:
        torn = S3Store(BUCKET, prefix, proxy.endpoint_url, direct=direct, timeout=5)
        with pytest.raises(StoreError):
            torn.put_if_absent("dirs/root/new", b'{"type": "dir"}')
        with pytest.raises(StoreError):
            torn.put("dirs/root/kept", b'{"type": "file", "v": 2}')
        with pytest.raises(StoreError):
            torn.put("dirs/root/kept", b'{"type": "file", "v": 3}', if_match=good)
        assert proxy.accepted["torn"] >= 3
    finally:
        proxy.close()
    with pytest.raises(NotFound):
        healthy.get("dirs/root/new")
    assert healthy.get("dirs/root/kept") == (b'{"type": "file"}', good)
