"""Reused chunk buffers (``buffers.py``) against store attempts that outlive their call:
a late attempt may still be sending from, or receiving into, the buffer it was handed
when the retry layer gives up.  The caller must see the store's own error, and no buffer
a late attempt holds may go back to the pool."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import trio

from ckptfs.data.buffers import BufferPool
from ckptfs.data.liveness import ChunkLiveness
from ckptfs.store import LocalStore, RetryingStore, StoreTimeout, store_policy
from ckptfs.data.upload import ChunkUploader

MiB = 1 << 20


class StalledSendStore:
    """A store whose PUT sends the body on a socket nobody reads (a network that stopped
    taking bytes), as ``ChunkHTTP`` does with ``sendall``: the send holds the caller's
    buffer until the socket is drained or closed."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url
        self.ours, self.theirs = socket.socketpair()
        self.sending = threading.Event()

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def put(self, key, data, sha256=None, *, if_match=None):
        self.sending.set()
        try:
            self.ours.sendall(data)           # blocks: nobody reads the other end
        except OSError:
            pass
        return self.inner.put(key, bytes(data), sha256, if_match=if_match)

    def release(self) -> None:
        self.theirs.close()                   # the late send fails and lets go
        self.ours.close()


def test_a_put_still_sending_when_the_deadline_passes_reports_a_store_timeout(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    raw = LocalStore(root)
    stalled = StalledSendStore(raw)
    store = RetryingStore(stalled, store_policy(0.5))
    pool = BufferPool(4 * MiB, keep=4)
    uploader = ChunkUploader(store, ChunkLiveness(raw, 0.3), trio.CapacityLimiter(2),
                             lambda sha, gen: None, buffers=pool)
    staged = tmp_path / "staged"
    staged.write_bytes(os.urandom(4 * MiB))
    try:
        with pytest.raises(StoreTimeout):
            trio.run(uploader.upload, staged, 0, 4 * MiB)
        assert stalled.sending.is_set()
        # The buffer the late send still reads is not offered to the next chunk.
        assert not pool._free
    finally:
        stalled.release()
