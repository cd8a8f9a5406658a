"""A save (or a truncate) on the node where a reader holds the version before open.

The kernel keeps one size per inode, for every handle of it: a writer's ``O_TRUNC`` open
and writes, or a truncate, set it, and a reader still holding the version before read
that version cut at the new size -- a watcher's ``torch.load`` of ``latest.pt`` while the
trainer saved over it in place (soak seed 1215616, both stores, sync: "a reader held
open on A read f0 as f0 truncated to 0"; on a mount, a reader of 70 000 bytes read 100
of them after a 100-byte save).  Another node's save already moved the name to a fresh
inode beside the readers (``Opening._fresh_inode_for_name``); now this node's own new
version does too: the writer's open (or truncate) answers ESTALE once the name has
moved, and the kernel opens the fresh inode by name again.  The reader's inode keeps its
size and bytes.  A version still owed to the store waits for its upload first (up to
``PASSTHROUGH_DRAIN``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import errno
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core, reached

pytestmark = pytest.mark.trio

OLD, NEW = b"the version the reader holds " * 2000, b"the new save " * 8


async def step_by_name(core: Core, step) -> int:
    """``step`` on the inode the name has, as the kernel does it: once more by name
    when it answers ESTALE (the kernel's one retry).  The inode it acted on."""
    ino = await core.resolve("f0")
    try:
        await step(ino)
        return ino
    except FsError as exc:
        assert exc.errno == errno.ESTALE
    ino = await core.resolve("f0")
    await step(ino)
    return ino


async def save_over(core: Core, ino: int) -> None:
    handle = await core.fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    await core.fs.write(handle.fh, 0, NEW)
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)


async def truncate(core: Core, ino: int) -> None:
    await core.fs.setattr(ino, size=len(NEW))


@pytest.mark.parametrize("step", ["save", "truncate"])
@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_new_version_beside_a_reader_leaves_the_readers_inode_its_size(
        tmp_path, durability: str, step: str):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability=durability, upload_hold=0.0)) as fs:
        core = Core(fs, store)
        old = await core.save(ROOT_INO, b"f0", OLD)
        uploading = store.gate("put", prefix="chunks/") if durability == "async" else None
        if uploading is None:
            await fs.wait_idle()
        reader = await fs.open(old, os.O_RDONLY, core.me())
        assert await fs.read(reader.fh, 0, len(OLD)) == OLD
        if uploading is not None:           # the version is still owed to the store:
            await reached(uploading)        # it lands while the writer waits
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_release_after, uploading, 0.3)
                acted = await step_by_name(
                    core, lambda ino: (save_over if step == "save" else truncate)(core, ino))
        else:
            acted = await step_by_name(
                core, lambda ino: (save_over if step == "save" else truncate)(core, ino))
        assert acted != old, "the new version went into the reader's inode"
        assert fs.getattr(old).size == len(OLD), \
            "the kernel's size of the reader's inode is not the reader's version's"
        assert await fs.read(reader.fh, 0, len(OLD)) == OLD
        await fs.release(reader.fh)
        want = NEW if step == "save" else OLD[:len(NEW)]
        assert await core.load(await core.resolve("f0")) == want
        with trio.fail_after(30):
            await fs.wait_idle()
    async with open_core(tmp_path / "b", store, Config(durability=durability)) as fs:
        other = Core(fs, store)
        assert await other.load(await other.resolve("f0")) == want


async def _release_after(gate, seconds: float) -> None:
    await trio.sleep(seconds)
    gate.release()


async def test_no_reader_no_fresh_inode(tmp_path):
    """Without a reader the save goes into the inode, as ever (no ESTALE, no new inode
    for the kernel)."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="sync")) as fs:
        core = Core(fs, store)
        old = await core.save(ROOT_INO, b"f0", OLD)
        await save_over(core, old)
        assert await core.resolve("f0") == old
        assert await core.load(old) == NEW


@asynccontextmanager
async def a_linked_file(tmp_path, monkeypatch) -> AsyncIterator[tuple]:
    """An async core (a short drain wait) with ``f0`` saved, landed and hard-linked as
    ``f1``: its versions cannot move to a fresh inode until they land.  (fs, core,
    store, the inode)."""
    from ckptfs.core import opening
    monkeypatch.setattr(opening, "PASSTHROUGH_DRAIN", 0.2)
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability="async", upload_hold=0.0)) as fs:
        core = Core(fs, store)
        old = await core.save(ROOT_INO, b"f0", b"the first version")
        await fs.link(old, ROOT_INO, b"f1")
        with trio.fail_after(30):
            await fs.wait_idle()
        yield fs, core, store, old


async def test_beside_a_reader_of_a_version_not_uploaded_the_save_goes_on_in_place_once(
        tmp_path, monkeypatch, caplog):
    """The version the reader holds is not in the store (its upload held) and cannot
    go to a fresh inode (a hard-linked file's: ``taken.may_hand_over``; a plain file's
    does, test_save_beside_a_reader_of_a_version_not_uploaded.py): the first save waits
    for it, then goes on in place and says so; the next save within ``IN_PLACE_QUIET``
    does not wait again (an appending logger beside a ``tail -f``)."""
    import logging
    async with a_linked_file(tmp_path, monkeypatch) as (fs, core, store, old):
        uploading = store.gate("put", prefix="chunks/", times=1000)
        await save_over(core, old)
        reader = await fs.open(old, os.O_RDONLY, core.me())
        with caplog.at_level(logging.WARNING, logger="ckptfs.core.opening"):
            for _ in range(3):
                await save_over(core, old)
        said = [r for r in caplog.records if "saved over while a reader" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert await core.resolve("f0") == old, "moved although the version was owed"
        await fs.release(reader.fh)
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        assert await core.load(old) == NEW


async def test_a_reader_beside_a_save_in_place_reads_the_file_as_it_is(tmp_path,
                                                                      monkeypatch):
    """Where the name cannot move (a hard-linked file's version not in the store
    yet), the save goes on in place after the wait.  Its reader kept reading the
    version it had opened -- through the kernel's size of the new one, which cuts
    every read (measured on a mount, stop 50: read to EOF and read by ``fstat`` size
    both gave the old version's first 1 MiB of 3).  It reads the file as it is, as on
    a disk."""
    async with a_linked_file(tmp_path, monkeypatch) as (fs, core, store, old):
        uploading = store.gate("put", prefix="chunks/", times=1000)
        handle = await fs.open(old, os.O_WRONLY | os.O_TRUNC, core.me())
        await fs.write(handle.fh, 0, OLD)
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        reader = await fs.open(old, os.O_RDONLY, core.me())
        await save_over(core, old)
        assert await core.resolve("f0") == old
        size = fs.getattr(old).size
        seen = (await fs.read(reader.fh, 0, len(OLD) + 1))[:size]   # (the kernel's cut)
        await fs.release(reader.fh)
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
    assert seen == NEW, f"read {len(seen)} bytes (size {size}): the version before " \
        f"cut at the new size: {seen == OLD[:size]}"


async def test_the_writers_retry_pass_is_spent_even_where_the_retry_meets_no_reader(
        tmp_path):
    """Found by a review: the pass a fresh inode gets for its writer's retry was spent
    only where the retry met readers of the fresh inode.  The usual retry meets none
    (the readers hold the old inode), so the pass stayed, and the trainer's next save
    within ``WRITER_RETRY_WINDOW`` went on in place beside an evaluator that had opened
    the fresh inode meanwhile: its version cut at the new size."""
    first, second = b"the first save " * 3000, b"the second " * 4
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="sync")) as fs:
        core = Core(fs, store)
        old = await core.save(ROOT_INO, b"f0", OLD)
        r1 = await fs.open(old, os.O_RDONLY, core.me())

        async def save(data: bytes, ino: int) -> None:
            handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
            await fs.write(handle.fh, 0, data)
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
        fresh = await step_by_name(core, lambda ino: save(first, ino))
        assert fresh != old
        r2 = await fs.open(fresh, os.O_RDONLY, core.me())          # an evaluator
        assert await fs.read(r2.fh, 0, len(first)) == first
        acted = await step_by_name(core, lambda ino: save(second, ino))
        assert acted != fresh, "the next save went in place into the inode a reader holds"
        assert fs.getattr(fresh).size == len(first)
        assert await fs.read(r2.fh, 0, len(first) + 1) == first
        for handle in (r1, r2):
            await fs.release(handle.fh)
