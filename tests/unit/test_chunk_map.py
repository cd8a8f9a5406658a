"""A read finds the chunks covering its range by offset (``ChunkMap``), not by scanning
the chunk list from the start: the lookup must give exactly the chunks the scan gave,
for any chunk list and range (boundaries, a final short chunk, past the end)."""

from __future__ import annotations

import random

from ckptfs.core.chunkmap import ChunkMap


def scan(chunks: list[tuple[str, int]], offset: int, end: int) -> list[tuple[int, str, int, int]]:
    """The read path's former linear scan (core/read.py before issue 22), verbatim."""
    wanted = []
    pos = 0
    for index, (sha, length) in enumerate(chunks):
        if pos + length > offset and pos < end:
            wanted.append((pos, sha, length, index))
        pos += length
        if pos >= end:
            break
    return wanted


def chunk_list(rng: random.Random, chunk: int) -> list[tuple[str, int]]:
    n = rng.randrange(0, 12)
    lengths = [chunk] * n
    if rng.random() < 0.6:
        lengths.append(rng.randrange(1, chunk + 1))     # a final short chunk
    return [(f"sha{i}", length) for i, length in enumerate(lengths)]


def interesting_offsets(chunks: list[tuple[str, int]], rng: random.Random) -> list[int]:
    total = sum(length for _, length in chunks)
    bounds = [0]
    for _, length in chunks:
        bounds.append(bounds[-1] + length)
    points = {0, total, total + 1, total + 100}
    for b in bounds:
        points.update({b - 1, b, b + 1})
    points.update(rng.randrange(0, total + 2) for _ in range(8))
    return sorted(p for p in points if p >= 0)


def test_the_offset_lookup_gives_the_chunks_the_scan_gave():
    rng = random.Random(22)
    checked = 0
    for _ in range(400):
        chunk = rng.choice([1, 3, 8, 4096])
        chunks = chunk_list(rng, chunk)
        cmap = ChunkMap(chunks)
        total = sum(length for _, length in chunks)
        assert cmap.total == total
        points = interesting_offsets(chunks, rng)
        for offset in points:
            for end in points:
                if end <= offset:
                    continue    # the read path returns b"" before looking
                assert cmap.covering(offset, end) == scan(chunks, offset, end), \
                    (chunks, offset, end)
                checked += 1
    assert checked > 10000


def test_a_10_gib_file_at_128_kib_requests():
    """1280 chunks of 8 MiB read in 128 KiB requests: every request gets its one chunk
    (or two, across a boundary), the last one included."""
    chunks = [(f"sha{i}", 8 << 20) for i in range(1280)]
    cmap = ChunkMap(chunks)
    step = 128 << 10
    for offset in [0, step, (8 << 20) - step, 8 << 20, (10 << 30) - step]:
        assert cmap.covering(offset, offset + step) == scan(chunks, offset, offset + step)
    assert cmap.covering((8 << 20) - 10, (8 << 20) + 10) == scan(chunks, (8 << 20) - 10,
                                                                  (8 << 20) + 10)
    assert cmap.following(1279, 8) == []
    assert cmap.following(5, 2) == chunks[6:8]


def test_it_is_still_the_chunk_list():
    chunks = [("a", 4), ("b", 4), ("c", 1)]
    cmap = ChunkMap(chunks)
    assert list(cmap) == chunks and len(cmap) == 3 and cmap[1] == ("b", 4)
    assert cmap.shas == ("a", "b", "c")
    assert cmap.covering(0, 9) == [(0, "a", 4, 0), (4, "b", 4, 1), (8, "c", 1, 2)]
    assert ChunkMap([]).covering(0, 1) == []
