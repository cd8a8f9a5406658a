"""A PUT whose body reached the store different from what was sent (the server's check of
the transfer checksum failed: ``BadDigest``; a signed payload hash that did not match:
``XAmzContentSHA256Mismatch``) is a transient failure: the next attempt sends the same
verified buffer again.  As a permanent error it failed the upload at once."""

from __future__ import annotations

import pytest

from ckptfs.store import StoreError, TransientStoreError
from ckptfs.store.s3 import S3Store


@pytest.mark.parametrize("code", ["BadDigest", "XAmzContentSHA256Mismatch"])
def test_a_body_that_arrived_damaged_is_retried(code, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = S3Store("bucket1", "", endpoint_url="http://127.0.0.1:9")
    err = store.classify(code, 400, "The Content-Md5 you specified did not match", "chunks/k")
    assert isinstance(err, TransientStoreError) and code in str(err)


def test_a_malformed_checksum_header_stays_permanent(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = S3Store("bucket1", "", endpoint_url="http://127.0.0.1:9")
    err = store.classify("InvalidDigest", 400, "bad header", "chunks/k")
    assert isinstance(err, StoreError) and not isinstance(err, TransientStoreError)
