"""A reader that reads a published file to its end gets the next files of the directory
fetched ahead, in the order loaders read shards (natural order: ``__10_0`` after
``__9_0``), one read-ahead window's worth of bytes across as many files as that covers:
checkpoint loaders read a directory's shards one after another, and each shard's first
fetch was a wait with the CPU idle (25-90 ms per file in the bench's cold read, decision
0015).  A reader that jumps around gets nothing extra."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import chunk_key

pytestmark = pytest.mark.trio
CS = 64 << 10
WINDOW = 8          # read-ahead window, chunks: the bytes fetched past a file's end


@pytest.fixture
def core_config() -> dict:
    return {"chunk_size": CS, "readahead_chunks": WINDOW}


async def remote_files(core, sizes: dict[bytes, int]) -> dict[bytes, int]:
    """Saved, published, and their local copies dropped: reads fetch from the store."""
    inos = {name: await core.save(ROOT_INO, name, os.urandom(size))
            for name, size in sizes.items()}
    for ino in inos.values():
        assert core.fs._evict_local_copy(ino)
    return inos


def fetched(core, ino: int) -> set[int]:
    """Indexes of the file's chunks in the node cache."""
    chunks = core.fs.ns.get(ino).chunks
    return {i for i, (sha, _) in enumerate(chunks) if core.fs.cache.has(sha)}


async def read_range(core, ino: int, start: int, end: int, step: int = 128 << 10) -> None:
    handle = await core.fs.open(ino, os.O_RDONLY, core.me())
    try:
        for offset in range(start, end, step):
            await core.fs.read(handle.fh, offset, step)
    finally:
        await core.fs.release(handle.fh)


async def settle(core, inos: dict[bytes, int]) -> None:
    """Until no fetch of these files' chunks is in flight."""
    shas = [sha for ino in inos.values() for sha, _ in core.fs.ns.get(ino).chunks]
    with trio.fail_after(10):
        await trio.sleep(0.05)
        while core.fs.stats()["fetches_in_flight"]:     # what `status` shows
            await trio.sleep(0.01)
    assert not any(core.fs.cache.fetching(sha) for sha in shas)


async def test_reading_a_file_to_its_end_fetches_a_window_of_the_next_file(core):
    inos = await remote_files(core, {b"a.bin": 12 * CS, b"b.bin": 12 * CS, b"c.bin": 4 * CS})
    await read_range(core, inos[b"a.bin"], 0, 12 * CS)
    await settle(core, inos)
    assert fetched(core, inos[b"b.bin"]) == set(range(WINDOW))
    assert fetched(core, inos[b"c.bin"]) == set()      # the window ended in b.bin
    calls_before = len(core.store.calls)
    await read_range(core, inos[b"b.bin"], 0, WINDOW * CS)   # served from the cache
    ahead = {chunk_key(sha) for sha, _ in core.fs.ns.get(inos[b"b.bin"]).chunks[:WINDOW]}
    assert not [c for c in core.store.calls[calls_before:] if c.key in ahead]


async def test_the_window_spans_the_next_files_in_shard_order(core):
    # Name order would put __10_0 and __11_0 before __2_0; loaders read __2_0 first.
    inos = await remote_files(core, {b"__2_0.distcp": 4 * CS, b"__10_0.distcp": 4 * CS,
                                     b"__11_0.distcp": 4 * CS, b"__12_0.distcp": 4 * CS})
    await read_range(core, inos[b"__2_0.distcp"], 0, 4 * CS)
    await settle(core, inos)
    assert fetched(core, inos[b"__10_0.distcp"]) == set(range(4))
    assert fetched(core, inos[b"__11_0.distcp"]) == set(range(4))
    assert fetched(core, inos[b"__12_0.distcp"]) == set()     # past the window


async def test_small_files_after_a_shard_are_fetched_ahead_together(core):
    sizes = {b"model-1.bin": 4 * CS} | {f"tok-{i}.json".encode(): CS // 4 for i in range(6)}
    inos = await remote_files(core, sizes)
    await read_range(core, inos[b"model-1.bin"], 0, 4 * CS)
    await settle(core, inos)
    assert all(fetched(core, inos[f"tok-{i}.json".encode()]) == {0} for i in range(6))


async def test_a_reader_that_jumps_around_fetches_nothing_of_other_files(core):
    inos = await remote_files(core, {b"a.bin": 12 * CS, b"b.bin": 12 * CS})
    handle = await core.fs.open(inos[b"a.bin"], os.O_RDONLY, core.me())
    for offset in (11 * CS, 0, 6 * CS, 11 * CS + 4096):   # a zip reader: end, start, middle
        await core.fs.read(handle.fh, offset, 4096)
    await core.fs.release(handle.fh)
    await settle(core, inos)
    assert fetched(core, inos[b"b.bin"]) == set()


async def test_the_last_file_of_a_directory_and_a_staged_next_file_are_fine(core):
    inos = await remote_files(core, {b"a.bin": 4 * CS, b"z.bin": 4 * CS})
    await core.save(ROOT_INO, b"m.bin", os.urandom(3 * CS))   # local: nothing to fetch
    await read_range(core, inos[b"a.bin"], 0, 4 * CS)
    await read_range(core, inos[b"z.bin"], 0, 4 * CS)          # last name: no next file
    await settle(core, inos)
    assert fetched(core, inos[b"a.bin"]) == set(range(4))
