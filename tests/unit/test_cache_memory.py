"""The chunk cache's cold-read path (decision 0011): a freshly fetched chunk is served
from the buffer its GET filled, not re-read from the cache file; the memory copy is
bounded and goes once every byte was served; the cache file still holds the verified
chunk (written with O_DIRECT where the length allows), for later reads and restarts."""

from __future__ import annotations

import hashlib
import os

import trio

from ckptfs.format.remote import chunk_key
import mmap
import threading
import time

from ckptfs.data.buffers import BufferPool
from ckptfs.data.cache import ChunkCache, write_file_direct
from ckptfs.errors import FsError
from ckptfs.store import CountingStore, LocalStore, RetryingStore, StoreStats, store_policy

MiB = 1 << 20


def make_cache(tmp_path, bodies: list[bytes], hot_limit: int = 128 * MiB):
    root = tmp_path / "store"
    root.mkdir()
    raw = LocalStore(root)
    for body in bodies:
        raw.put(chunk_key(hashlib.sha256(body).hexdigest()), body)
    stats = StoreStats()
    cache = ChunkCache(tmp_path / "cache", CountingStore(raw, stats), 1 << 30,
                       trio.CapacityLimiter(4), hot_limit=hot_limit)
    return cache, stats


def test_cold_read_served_from_fetched_buffer_then_released(tmp_path):
    body = os.urandom(4 * MiB)
    sha = hashlib.sha256(body).hexdigest()
    cache, stats = make_cache(tmp_path, [body])

    async def main():
        path = await cache.ensure(sha, len(body))
        assert path.read_bytes() == body          # the cache file has the verified chunk
        # Behind the cache's back the file changes: what a read returns now can only
        # come from the buffer the fetch verified.
        os.truncate(path, 0)
        pieces = [cache.pread(sha, MiB, off) for off in range(0, len(body), MiB)]
        assert b"".join(pieces) == body
        assert cache.served_from_memory == len(body)
        # Every byte served once: the memory copy is gone, reads use the file again.
        assert cache.hot_bytes == 0
        assert cache.pread(sha, MiB, 0) == b""

    trio.run(main)
    assert stats.gets == 1


def test_fetched_chunks_in_memory_are_bounded(tmp_path):
    bodies = [os.urandom(MiB) for _ in range(6)]
    shas = [hashlib.sha256(b).hexdigest() for b in bodies]
    cache, _ = make_cache(tmp_path, bodies, hot_limit=3 * MiB)

    async def main():
        for sha, body in zip(shas, bodies):
            await cache.ensure(sha, len(body))
            assert cache.hot_bytes <= 3 * MiB
        # The oldest were dropped from memory; every chunk reads right from its file.
        for sha, body in zip(shas, bodies):
            assert cache.pread(sha, len(body), 0) == body
        assert cache.served_from_memory == 3 * MiB

    trio.run(main)


def test_unaligned_and_aligned_chunk_files_are_whole(tmp_path):
    aligned = os.urandom(2 * MiB)
    buf = mmap.mmap(-1, 2 * MiB)
    buf[:] = aligned
    with memoryview(buf) as view:
        if write_file_direct(tmp_path / "a", view):
            assert (tmp_path / "a").read_bytes() == aligned
        # A length O_DIRECT cannot write is left to the caller, untouched.
        assert write_file_direct(tmp_path / "b", view[:5000]) is False
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    bodies = [os.urandom(2 * MiB), os.urandom(5000)]
    cache, _ = make_cache(tmp_path / "c", bodies)

    async def main():
        for body in bodies:
            sha = hashlib.sha256(body).hexdigest()
            assert (await cache.ensure(sha, len(body))).read_bytes() == body

    trio.run(main)


def test_fetch_buffers_are_reused_once_served(tmp_path):
    bodies = [os.urandom(MiB) for _ in range(12)]
    cache, _ = make_cache(tmp_path, bodies)
    cache.buffers = BufferPool(MiB, keep=2)

    async def main():
        for body in bodies:
            sha = hashlib.sha256(body).hexdigest()
            await cache.ensure(sha, len(body))
            assert b"".join(cache.pread(sha, MiB // 4, off)
                            for off in range(0, MiB, MiB // 4)) == body
        assert cache.served_from_memory == 12 * MiB

    trio.run(main)
    assert cache.buffers.created == 1      # one buffer received all twelve chunks


class LateStore:
    """A store whose first GET of ``slow_key`` answers after the caller gave up, and
    then scribbles into the buffer it was handed (what a late attempt of a timed-out
    GET does when its bytes finally arrive)."""

    def __init__(self, inner, slow_key: str) -> None:
        self.inner, self.slow_key, self.url = inner, slow_key, inner.url
        self.late_done = threading.Event()

    def get_into(self, key, buffer):
        if key == self.slow_key and not self.late_done.is_set():
            time.sleep(0.6)
            with memoryview(buffer) as view:
                view[:MiB] = b"\xee" * MiB
            self.late_done.set()
            return MiB, '"late"'
        return self.inner.get_into(key, buffer)


def test_a_buffer_a_timed_out_fetch_may_still_fill_is_never_reused(tmp_path):
    slow, good = os.urandom(MiB), os.urandom(MiB)
    slow_sha, good_sha = (hashlib.sha256(b).hexdigest() for b in (slow, good))
    root = tmp_path / "store"
    root.mkdir()
    raw = LocalStore(root)
    for body in (slow, good):
        raw.put(chunk_key(hashlib.sha256(body).hexdigest()), body)
    late = LateStore(raw, chunk_key(slow_sha))
    cache = ChunkCache(tmp_path / "cache", RetryingStore(late, store_policy(0.2)), 1 << 30,
                       trio.CapacityLimiter(4), buffers=BufferPool(MiB, keep=4))

    async def main():
        try:
            await cache.ensure(slow_sha, MiB)
            raise AssertionError("the slow fetch should have timed out")
        except FsError:
            pass
        await cache.ensure(good_sha, MiB)
        first = cache.pread(good_sha, MiB // 2, 0)
        await trio.to_thread.run_sync(late.late_done.wait, 5)
        assert late.late_done.is_set()
        # The late attempt wrote into its own buffer, not the one serving ``good``.
        assert first + cache.pread(good_sha, MiB // 2, MiB // 2) == good

    trio.run(main)
