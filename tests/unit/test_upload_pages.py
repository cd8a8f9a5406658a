"""A chunk sent ahead of its close and hashed again at publish (read behind a writer the
daemon does not see, decision 0019) keeps its staging pages until that last read: they
were dropped after the early upload, and every re-verification then read the chunk back
from the disk (a sync-mode passthrough profile: ``_read_chunk`` 4.7 of 14.6 sampled
s/GiB).  A chunk read for the last time drops them, as before (decision 0014)."""

from __future__ import annotations

import trio

from ckptfs.data import upload as upload_module
from ckptfs.data.liveness import ChunkLiveness
from ckptfs.data.upload import ChunkTracker, ChunkUploader, chunk_list
from ckptfs.store import MemoryStore

CHUNK = 1 << 16


def _uploader(monkeypatch) -> tuple[ChunkUploader, list[tuple[int, int]]]:
    dropped: list[tuple[int, int]] = []
    monkeypatch.setattr(upload_module, "drop_staged_pages",
                        lambda path, offset=0, length=0: dropped.append((offset, length)))
    store = MemoryStore()
    uploader = ChunkUploader(store, ChunkLiveness(store, 0.0), trio.CapacityLimiter(4),
                             lambda sha, gen: None)
    return uploader, dropped


def test_a_chunk_to_be_hashed_again_keeps_its_pages_until_its_last_read(tmp_path, monkeypatch):
    uploader, dropped = _uploader(monkeypatch)
    staging = tmp_path / "staging"
    staging.write_bytes(b"a" * CHUNK + b"b" * CHUNK + b"c" * 100)
    tracker = ChunkTracker(CHUNK)
    tracker.verify = True

    async def main() -> list[tuple[str, int]]:
        for index in (0, 1):
            pending = tracker.start(index)

            def reading(pending=pending) -> bool:
                pending.read_open = not tracker.closed
                return tracker.verify and pending.read_open

            pending.result = await uploader.upload(staging, index * CHUNK, CHUNK, reading)
            pending.done.set()
        assert dropped == [], "pages of chunks to be hashed again were dropped"
        # An fsync of the open version verifies them: not their last read either.
        await chunk_list(uploader, tracker, staging, 2 * CHUNK + 100, CHUNK)
        assert (0, CHUNK) not in dropped and (CHUNK, CHUNK) not in dropped
        tracker.closed = True       # the close: this read of them is the last
        return await chunk_list(uploader, tracker, staging, 2 * CHUNK + 100, CHUNK)

    chunks = trio.run(main)
    assert [n for _, n in chunks] == [CHUNK, CHUNK, 100]
    assert {(0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, 100)} <= set(dropped)
    assert uploader.stats.chunks_reverified == 4


def test_a_chunk_read_for_the_last_time_drops_its_pages(tmp_path, monkeypatch):
    uploader, dropped = _uploader(monkeypatch)
    staging = tmp_path / "staging"
    staging.write_bytes(b"x" * CHUNK)
    trio.run(uploader.upload, staging, 0, CHUNK)
    assert dropped == [(0, CHUNK)]
