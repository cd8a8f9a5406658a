"""Event-loop CPU a reader's requests spend finding their chunks (issue 22, item 5).

A 10 GiB published file (1280 chunks of 8 MiB) read sequentially in 128 KiB requests
(81 920 reads) through ``ReadPath._read_chunks`` with a node cache that has every chunk
and answers at once (no I/O, no threads): what is left is the read path's own CPU on
the event loop, dominated by locating the chunks.  Run it on two checkouts to compare:

    PYTHONPATH=. python tools/chunk_lookup_cost.py
"""

from __future__ import annotations

import time

import trio

from ckptfs.core.read import ReadPath

CHUNK = 8 << 20
CHUNKS = 1280
REQUEST = 128 << 10


class _Cache:
    """Every chunk is there; reading returns nothing (the bytes are not the point)."""

    def pin(self, sha: str) -> None: ...
    def unpin(self, sha: str) -> None: ...
    def ready(self, sha: str) -> bool: return True
    def fetching(self, sha: str) -> bool: return False
    async def ensure(self, sha: str, length: int) -> None: ...
    async def read(self, sha: str, length: int, lo: int, n: int) -> bytes: return b""


class _Reader(ReadPath):
    def __init__(self) -> None:
        self.cache = _Cache()


def chunk_list() -> object:
    chunks = [(f"{i:064x}", CHUNK) for i in range(CHUNKS)]
    try:
        from ckptfs.core.chunkmap import ChunkMap
    except ImportError:     # before issue 22: the snapshot held the plain list
        return chunks
    return ChunkMap(chunks)


async def main() -> None:
    reader = _Reader()
    started = time.process_time()
    chunks = chunk_list()         # once per snapshot (at open)
    opened = time.process_time() - started
    total = CHUNK * CHUNKS
    started = time.process_time()
    for offset in range(0, total, REQUEST):
        await reader._read_chunks(chunks, total, offset, REQUEST, window=8)
    spent = time.process_time() - started
    print(f"{total >> 30} GiB, {CHUNKS} chunks, {total // REQUEST} reads of "
          f"{REQUEST >> 10} KiB: {spent:.2f} s CPU on the event loop "
          f"({spent / (total // REQUEST) * 1e6:.1f} us a read); snapshot at open "
          f"{opened * 1e3:.2f} ms")


if __name__ == "__main__":
    trio.run(main)
