"""A reader holds a file open on node A while node B renames or removes it.

Before: A's listings kept the old name while A's reader was open (any open handle
counted as work that keeps a vanished name, ``Refresh._forget_vanished``), so A showed
``f1`` beside B's ``d0/f1`` until the reader closed (soak seed 1215394, sync: "'f1':
expected nothing, shows 100 bytes").  A reader is no work the store is owed: the name
goes at once, the reader keeps the version it opened on the nameless inode, and the
inode goes with the reader's close (like an unlinked open file).  A writer still keeps
its name (its save is owed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, two_cores

pytestmark = pytest.mark.trio

OLD = b"the version the reader opened " * 300


async def _refresh(core: Core, path: str = "") -> None:
    await core.fs.refresh_dir(await core.resolve(path) if path else ROOT_INO, force=True)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("change", ["rename into d0", "rename in place", "unlink",
                                    "rmdir of its directory"])
async def test_a_name_another_node_moved_away_goes_while_a_reader_holds_it(
        tmp_path: Path, durability: str, change: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)
        where = ROOT_INO
        if change == "rmdir of its directory":
            where = (await a.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        await a.save(where, b"f1", OLD)
        await a.fs.wait_idle()
        path = "d1/f1" if change == "rmdir of its directory" else "f1"
        ino = await a.resolve(path)
        reader = await a.fs.open(ino, os.O_RDONLY, a.me())

        await _refresh(b)
        if change == "rmdir of its directory":
            await _refresh(b, "d1")
        b_parent = await b.resolve(path.rpartition("/")[0]) if "/" in path else ROOT_INO
        if change == "rename into d0":
            await b.fs.rename(ROOT_INO, b"f1", await b.resolve("d0"), b"f1", 0)
        elif change == "rename in place":
            await b.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"g1", 0)
        else:
            await b.fs.unlink(b_parent, b"f1")
            if change == "rmdir of its directory":
                await b.fs.rmdir(ROOT_INO, b"d1")
        await b.fs.wait_idle()

        await _refresh(a)
        if change == "rename into d0":
            assert await a.names() == ["d0"], "the moved name is gone from A's root"
            await _refresh(a, "d0")
            assert await a.names(await a.resolve("d0")) == ["f1"]
            assert await a.load(await a.resolve("d0/f1")) == OLD
        elif change == "rename in place":
            assert await a.names() == ["d0", "g1"]
            assert await a.load(await a.resolve("g1")) == OLD
        elif change == "unlink":
            assert await a.names() == ["d0"]
        else:
            assert await a.names() == ["d0"], "the removed directory is gone from A"

        assert await a.fs.read(reader.fh, 0, len(OLD) + 1) == OLD, \
            "the reader reads the version it opened"
        await a.fs.release(reader.fh)
        assert a.fs.st.ns.maybe_get(ino) is None or a.fs.st.ns.get(ino).parent, \
            "the nameless inode goes with the reader's close"
        await a.fs.wait_idle()
        for core in (a, b):
            await _refresh(core)
            assert "f1" not in await core.names()


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_writer_keeps_its_name_when_another_node_removes_it(
        tmp_path: Path, durability: str):
    """The other side of the fix: a writer's open file owes the store its save."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.save(ROOT_INO, b"f1", OLD)
        await a.fs.wait_idle()
        ino = await a.resolve("f1")
        writer = await a.fs.open(ino, os.O_WRONLY, a.me())
        await a.fs.write(writer.fh, 0, b"NEW")
        await _refresh(b)
        await b.fs.unlink(ROOT_INO, b"f1")
        await b.fs.wait_idle()
        await _refresh(a)
        assert await a.names() == ["f1"], "A's open writer keeps its name"
        await a.fs.flush(writer.fh)
        await a.fs.release(writer.fh)
        await a.fs.wait_idle()
        await _refresh(b)
        assert await b.load(await b.resolve("f1")) == b"NEW" + OLD[3:]
