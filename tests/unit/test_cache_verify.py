"""The chunk cache checks its own files: a cache file this daemon has not read back yet
is hashed once (single flight) before it is served, a copy into a new version is hashed
every time, and a rotten file is removed and fetched again, or EIO (never its bytes)."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import trio

from ckptfs.data.cache import ChunkCache
from ckptfs.errors import FsError
from ckptfs.format.remote import chunk_key
from ckptfs.store import CountingStore, LocalStore, StoreStats

MiB = 1 << 20


def _store(tmp_path, body: bytes) -> tuple[LocalStore, str]:
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    raw = LocalStore(root)
    sha = hashlib.sha256(body).hexdigest()
    raw.put(chunk_key(sha), body)
    return raw, sha


def _cache(tmp_path, raw: LocalStore) -> tuple[ChunkCache, StoreStats]:
    """A cache over ``tmp_path/cache`` as a daemon starting now would open it."""
    stats = StoreStats()
    return ChunkCache(tmp_path / "cache", CountingStore(raw, stats), 1 << 30,
                      trio.CapacityLimiter(4)), stats


def _filled(tmp_path, body: bytes) -> tuple[LocalStore, str]:
    """The store holding ``body`` and a cache dir holding it, fetched by an earlier run."""
    raw, sha = _store(tmp_path, body)
    cache, _ = _cache(tmp_path, raw)
    trio.run(cache.ensure, sha, len(body))
    return raw, sha


def _rot(cache: ChunkCache, sha: str) -> None:
    with open(cache.path(sha), "r+b") as f:
        f.seek(1000)
        byte = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([byte ^ 0xFF]))


def test_eight_readers_of_an_unchecked_cache_file_hash_it_once(tmp_path):
    body = os.urandom(4 * MiB)
    raw, sha = _filled(tmp_path, body)
    cache, stats = _cache(tmp_path, raw)        # restarted: nothing checked yet
    got: list[bytes] = []

    async def reader(offset: int) -> None:
        got.append(await cache.read(sha, len(body), offset, MiB))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(reader, (i % 4) * MiB)
        # Checked once: later reads in this lifetime use the file without a hash.
        assert await cache.read(sha, len(body), 0, MiB) == body[:MiB]

    trio.run(main)
    assert sorted(got) == sorted(body[(i % 4) * MiB:(i % 4 + 1) * MiB] for i in range(8))
    assert cache.read_backs == 1
    assert stats.gets == 0


def test_a_rotten_cache_file_is_refetched_once(tmp_path, caplog):
    body = os.urandom(4 * MiB)
    raw, sha = _filled(tmp_path, body)
    cache, stats = _cache(tmp_path, raw)
    _rot(cache, sha)

    async def main() -> bytes:
        return await cache.read(sha, len(body), 0, len(body))

    assert trio.run(main) == body
    assert stats.gets == 1
    assert cache.rotten == 1
    assert [r.levelname for r in caplog.records if sha in r.getMessage()] == ["WARNING"]
    assert hashlib.sha256(cache.path(sha).read_bytes()).hexdigest() == sha


def test_a_rotten_cache_file_whose_refetch_fails_gives_eio(tmp_path):
    body = os.urandom(4 * MiB)
    raw, sha = _filled(tmp_path, body)
    raw.delete(chunk_key(sha))                  # the store cannot give it again
    cache, _ = _cache(tmp_path, raw)
    _rot(cache, sha)

    async def main() -> None:
        with pytest.raises(FsError) as info:
            await cache.read(sha, len(body), 0, len(body))
        assert info.value.errno == errno.EIO
        # A second reader gets EIO too, not the bad bytes.
        with pytest.raises(FsError):
            await cache.copy_out(sha, len(body))

    trio.run(main)
    assert not cache.path(sha).exists()
    assert not cache.has(sha)


def test_a_copy_into_a_new_version_is_checked_every_time(tmp_path):
    body = os.urandom(4 * MiB)
    raw, sha = _filled(tmp_path, body)
    cache, stats = _cache(tmp_path, raw)

    async def main() -> None:
        assert await cache.copy_out(sha, len(body)) == body       # checked on read-back
        assert await cache.read(sha, len(body), 0, len(body)) == body
        _rot(cache, sha)                # after this daemon checked it
        assert await cache.copy_out(sha, len(body)) == body

    trio.run(main)
    assert cache.rotten == 1
    assert stats.gets == 1
