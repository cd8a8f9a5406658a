"""A write session's mtime stays on this node until its close: what any entry this
node sends to the store meanwhile carries is the closed version's mtime.

Soak seed 1215482: B held ``f1`` open for writing (``O_TRUNC``, some bytes written)
and renamed it to ``f2``.  The entry the rename wrote had the closed version's
content and size but the mtime of B's unclosed writes: every other node showed the
closed bytes with a time nobody gave them (a ``utime`` another node had made to that
version was lost).  The same entry is built by an attribute change's rewrite and by
the publish of a closed version while a newer session is open.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import two_cores

MTIME = 1_700_000_000_000_000_001


def run(tmp_path, durability: str, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        config = Config(metadata_ttl=0.0, durability=durability)
        async with two_cores(tmp_path, store, config) as (a, b):
            await body(a, b, store)
    trio.run(main)


def stored(store, name: str) -> dict:
    return json.loads(store.get(f"dirs/root/{name}")[0])


async def open_and_write(node, ino: int, data: bytes) -> int:
    """A writer that truncates and writes, and stays open: its handle."""
    handle = await node.fs.open(ino, os.O_WRONLY | os.O_TRUNC, node.me())
    await trio.sleep(0.01)          # (its writes' time is not the closed version's)
    await node.fs.write(handle.fh, 0, data)
    return handle.fh


async def saved_with_mtime_then_opened(node) -> tuple[int, int]:
    """``f1`` saved, its mtime set to MTIME, then opened O_TRUNC and written: (ino, fh)."""
    ino = await node.save(ROOT_INO, b"f1", b"closed version")
    await node.fs.setattr(ino, mtime_ns=MTIME)
    await node.fs.wait_idle()
    return ino, await open_and_write(node, ino, b"unclosed")


async def close(node, fh: int) -> None:
    await node.fs.flush(fh)
    await node.fs.release(fh)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_rename_of_a_file_open_for_writing_moves_the_closed_versions_mtime(
        tmp_path, durability):
    async def body(a, b, store) -> None:
        ino, fh = await saved_with_mtime_then_opened(b)
        await b.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"f2", 0)
        await b.fs.wait_idle()
        entry = stored(store, "f2")
        assert entry["size"] == len(b"closed version")
        assert entry["mtime_ns"] == MTIME, "the rename sent the unclosed writes' mtime"
        seen = a.fs.getattr(await a.resolve("f2"))
        assert (seen.size, seen.mtime_ns) == (len(b"closed version"), MTIME)
        await close(b, fh)
        await b.fs.wait_idle()
        assert stored(store, "f2")["mtime_ns"] != MTIME     # the close's own time
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_chmod_of_a_file_open_for_writing_keeps_the_closed_versions_mtime(
        tmp_path, durability):
    async def body(a, b, store) -> None:
        ino, fh = await saved_with_mtime_then_opened(b)
        await b.fs.setattr(ino, mode=0o600)
        await b.fs.wait_idle()
        entry = stored(store, "f1")
        assert entry["mode"] & 0o777 == 0o600
        assert entry["mtime_ns"] == MTIME, "the chmod sent the unclosed writes' mtime"
        assert a.fs.getattr(await a.resolve("f1")).mtime_ns == MTIME
        await close(b, fh)
    run(tmp_path, durability, body)


def test_an_async_publish_during_the_next_session_sends_its_own_mtime(tmp_path):
    """Async: a closed version published while the next save of the file is open
    carries that version's mtime, not the open one's."""
    async def body(a, b, store) -> None:
        ino = await b.save(ROOT_INO, b"f1", b"closed version")
        await b.fs.setattr(ino, mtime_ns=MTIME)      # rides with its publish
        fh = await open_and_write(b, ino, b"unclosed")
        await b.fs.wait_idle()
        entry = stored(store, "f1")
        assert entry["size"] == len(b"closed version")
        assert entry["mtime_ns"] == MTIME, "the publish sent the open session's mtime"
        await close(b, fh)
    run(tmp_path, "async", body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_another_nodes_utime_of_the_closed_version_survives_a_chmod_here(
        tmp_path, durability):
    """B holds the file open for writing; A sets its (closed version's) mtime; B's chmod
    finds the entry changed, takes the store's attributes and sends its own again: the
    closed version's mtime it sends is A's, not the one B had seen."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f1", b"closed version")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f1")
        fh = await open_and_write(b, ino_b, b"unclosed")
        await a.fs.setattr(ino_a, mtime_ns=MTIME)
        await a.fs.wait_idle()
        assert stored(store, "f1")["mtime_ns"] == MTIME
        await b.fs.setattr(ino_b, mode=0o600)
        await b.fs.wait_idle()
        entry = stored(store, "f1")
        assert entry["mode"] & 0o777 == 0o600
        assert entry["mtime_ns"] == MTIME, "B's chmod undid A's utime"
        await close(b, fh)
    run(tmp_path, durability, body)
