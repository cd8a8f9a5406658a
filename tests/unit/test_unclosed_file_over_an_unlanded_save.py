"""A file not closed yet, renamed over a name whose last save has not landed in the
store, must leave the name showing that save (DESIGN.md promise 2: a name changes only
when a closed version lands there), never the one before it.

Found by the core model (sync: a process that exits holding the file twice, so its
close is decided at the last release, in the background; then an unclosed file renamed
over it): B's closed 100-byte version was dropped with the replaced inode, and the
unclosed file held the store's older entry, so every other node showed A's 40-byte save
from before -- and, if the unclosed file's writer died, went on showing it.  Async mode
lost it the same way with any save still queued.  Now the unclosed file takes the
replaced file's closed version as its own (as an ``O_TRUNC`` open over that file would
leave it), and it is published under the name."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX, Entry, entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from support.core import WRITE_NEW, Core, HeldCheck, open_core, reached, two_cores

pytestmark = pytest.mark.trio

OLD, SAVED, NEXT = b"v1" * 20, b"B's save " * 12, b"the unclosed file, closed at last " * 3
KEY = entry_key("root", b"f0")


async def _b_saves_f0(b: Core, how: str) -> None:
    """B saves f0 through ``t0``: renamed over f0 before its close ("early") or after
    ("replace"); or closed by a process exiting with it open twice ("exit")."""
    handle, _ = await b.fs.create(ROOT_INO, b"t0", 0o644, WRITE_NEW, 0, 0, b.me())
    if how in ("early", "exit"):
        await b.fs.rename(ROOT_INO, b"t0", ROOT_INO, b"f0", 0)
    handles = [handle.fh]
    if how == "exit":
        again = await b.fs.open(await b.resolve("f0"), os.O_RDWR, b.me())
        handles.append(again.fh)
    await b.fs.write(handle.fh, 0, SAVED)
    for fh in handles:
        await b.fs.flush(fh)
    for fh in handles:
        await b.fs.release(fh)
    if how == "replace":
        await b.fs.rename(ROOT_INO, b"t0", ROOT_INO, b"f0", 0)


@asynccontextmanager
async def _f0_saved_by_a(tmp_path: Path, store: MemoryStore, durability: str
                         ) -> AsyncIterator[tuple[Core, Core]]:
    """Two nodes; A has saved ``f0`` (``OLD``), and B has listed it."""
    async with two_cores(tmp_path, store, Config(durability=durability, upload_hold=0.0,
                                                 metadata_ttl=0.0)) as (a, b):
        await a.save(ROOT_INO, b"f0", OLD)
        await a.fs.wait_idle()
        await b.names()
        yield a, b


def _stored(store: MemoryStore) -> int:
    return Entry.from_json(store.get(KEY)[0]).size


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ["early", "replace", "exit"])
@pytest.mark.parametrize("then", ["closed", "killed"])
async def test_an_unclosed_file_over_an_unlanded_save_keeps_that_save_under_the_name(
        tmp_path: Path, durability: str, how: str, then: str):
    store = MemoryStore(gate_limit=30)
    async with _f0_saved_by_a(tmp_path, store, durability) as (a, b):
        # B's save is held at its upload (a sync close waits for it but for the one
        # decided at the last release, which nobody waits for).
        held = durability == "async" or how == "exit"
        uploading = store.gate("put", prefix=CHUNKS_PREFIX) if held else None
        await _b_saves_f0(b, how)
        if uploading is not None:
            await reached(uploading)
        # Before B's save has landed: a file not closed yet, renamed over it.
        handle, _ = await b.fs.create(ROOT_INO, b"t1", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.rename(ROOT_INO, b"t1", ROOT_INO, b"f0", 0)
        if uploading is not None:
            uploading.release()
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert _stored(store) == len(SAVED), "the name went back to the save before B's"
        assert await a.load(await a.resolve("f0")) == SAVED
        if then == "closed":
            await b.fs.write(handle.fh, 0, NEXT)
            await b.fs.flush(handle.fh)
            want = NEXT
        else:
            want = SAVED        # released with no close that meant it: a killed writer's
        await b.fs.release(handle.fh)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert _stored(store) == len(want)
        for node in (a, b):
            assert await node.names() == ["f0"]
            assert await node.load(await node.resolve("f0")) == want


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_rename_over_a_save_still_being_decided_at_its_release_waits_for_it(
        tmp_path: Path, durability: str):
    """The close decision at a last release runs in the background (its completeness
    check in a thread, for a large file): a file not closed yet renamed over the name
    meanwhile must not drop the save being decided."""
    slow_check = HeldCheck()
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=0.0)
    big = SAVED * 1000          # checked in a thread (above the inline check's size)
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config, check_complete=slow_check) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        await a.save(ROOT_INO, b"f0", OLD)
        await a.fs.wait_idle()
        await b.names()
        handle, _ = await b.fs.create(ROOT_INO, b"t0", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.rename(ROOT_INO, b"t0", ROOT_INO, b"f0", 0)
        again = await b.fs.open(await b.resolve("f0"), os.O_RDWR, b.me())
        await b.fs.write(handle.fh, 0, big)
        for fh in (handle.fh, again.fh):         # a process exiting with it open twice
            await b.fs.flush(fh)
        for fh in (handle.fh, again.fh):
            await b.fs.release(fh)
        await slow_check.reached()
        t1, _ = await b.fs.create(ROOT_INO, b"t1", 0o644, WRITE_NEW, 0, 0, b.me())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.fs.rename, ROOT_INO, b"t1", ROOT_INO, b"f0", 0)
            await trio.sleep(0.2)               # the rename is under way
            slow_check.go_on.set()
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert _stored(store) == len(big), "the save decided at its release was dropped"
        assert await a.load(await a.resolve("f0")) == big
        await b.fs.release(t1.fh)               # its writer killed: the save stays
        with trio.fail_after(30):
            await b.fs.wait_idle()
        for node in (a, b):
            assert await node.load(await node.resolve("f0")) == big


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("landed", [False, True], ids=["before-it-lands", "after-it-lands"])
@pytest.mark.parametrize("then", ["closed", "killed"])
async def test_the_save_taken_stays_with_its_name_when_the_file_moves_on(
        tmp_path: Path, durability: str, landed: bool, then: str):
    """Soak seed 1215567: the save the unclosed file took is the *name's* closed version,
    not the file's.  Renamed on (back to where it came from) before its own close, the
    file leaves that save behind with the name, which it replaced here: the name goes,
    and the file has no closed version -- a killed writer leaves nothing, and the save
    never shows up under the name the file moved to.  Before, the save moved with the
    file: its killed writer left B's save under ``t1``, a name it never had."""
    store = MemoryStore(gate_limit=30)
    async with _f0_saved_by_a(tmp_path, store, durability) as (a, b):
        uploading = store.gate("put", prefix=CHUNKS_PREFIX)
        await _b_saves_f0(b, "exit" if durability == "sync" else "replace")
        await reached(uploading)
        handle, _ = await b.fs.create(ROOT_INO, b"t1", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.rename(ROOT_INO, b"t1", ROOT_INO, b"f0", 0)
        if landed:
            uploading.release()
            with trio.fail_after(30):
                await b.fs.wait_idle()
            assert _stored(store) == len(SAVED)
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"t1", 0)      # and back
        if not landed:
            uploading.release()
        if then == "closed":
            await b.fs.write(handle.fh, 0, NEXT)
            await b.fs.flush(handle.fh)
        await b.fs.release(handle.fh)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        want = {"t1": NEXT} if then == "closed" else {}
        with pytest.raises(NotFound):
            store.get(KEY)          # f0 is gone here: from the store too
        for node in (a, b):
            names = await node.names()
            assert names == sorted(want), \
                f"{'ab'[node is b]}: {names}, not {sorted(want)} (the save moved with the file)"
            for name, data in want.items():
                assert await node.load(await node.resolve(name)) == data
