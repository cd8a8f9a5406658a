"""The chunk cache goes back to its size limit once the chunks in use are let go.

It evicted only when a chunk was added, and skipped the chunks readers held (pinned) or
that were being fetched.  A sequential reader keeps up to 8 read-ahead fetches in
flight, so when they ended together the cache stayed over ``--cache-size`` by those
chunks until the next fetch -- on an idle node, for good (a loaded CI run: 32 MiB in a
16 MiB cache, ``test_read.py::test_cache_smaller_than_file``).  Now the last release of a
chunk in use evicts too."""

from __future__ import annotations

import hashlib

import pytest
import trio

from ckptfs.data.cache import ChunkCache
from ckptfs.format.remote import chunk_key
from ckptfs.store import LocalStore

pytestmark = pytest.mark.trio

MiB = 1 << 20


async def test_the_cache_is_back_at_its_limit_once_its_chunks_are_let_go(tmp_path):
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store")
    bodies = [bytes([i]) * MiB for i in range(3)]
    shas = [hashlib.sha256(b).hexdigest() for b in bodies]
    for sha, body in zip(shas, bodies):
        store.put(chunk_key(sha), body)
    cache = ChunkCache(tmp_path / "cache", store, MiB, trio.CapacityLimiter(4))
    for sha in shas:                        # three readers at once, each on its chunk
        cache.pin(sha)
    for sha in shas:
        await cache.ensure(sha, MiB)
    assert cache.total == 3 * MiB           # none could go: all in use
    for sha in shas:
        cache.unpin(sha)
    assert cache.total <= cache.limit, "the cache stayed over its limit, idle"
    await cache.collect()
    kept = [sha for sha in shas if cache.path(sha).exists()]
    assert len(kept) == 1 and kept[0] == shas[-1]     # the latest used stays
