"""A reader that opens a file while a save of it is open (the daemon's path: sync mode,
or async with passthrough off) reads that save as it is written -- and kept doing so
after the save's close: the next save of the name, on this node or another, reached
it, so one descriptor read two versions (a hostile run, stop 44: a reader of 650 003
bytes read 700 001 of the next save).  Now the end of the write session pins such a
reader to the version the file has then: the one that save closed, or the one before
if it changed nothing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, two_cores

pytestmark = pytest.mark.trio

FIRST, SECOND, THIRD = b"1" * 65_003, b"2" * 70_001, b"3" * 30_000


async def _read_all(core: Core, fh: int) -> bytes:
    return await core.fs.read(fh, 0, 1 << 20)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("next_save", ["this node", "the other node"])
async def test_a_reader_opened_during_a_save_keeps_that_save(tmp_path: Path,
                                                             durability: str,
                                                             next_save: str):
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability=durability, upload_hold=0.0)) as (a, b):
        writer, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        await a.fs.write(writer.fh, 0, FIRST)
        reader = await a.fs.open(inode.ino, os.O_RDONLY, a.me())
        assert not reader.passthrough
        await a.fs.flush(writer.fh)
        await a.fs.release(writer.fh)
        assert await _read_all(a, reader.fh) == FIRST
        await a.fs.wait_idle()
        if next_save == "this node":
            await a.save(ROOT_INO, b"f", SECOND)
        else:
            await b.fs.refresh_dir(ROOT_INO, force=True)
            await b.save(ROOT_INO, b"f", SECOND)
            await b.fs.wait_idle()
            await a.fs.refresh_dir(ROOT_INO, force=True)
        assert await a.load(await a.resolve("f")) == SECOND
        assert await _read_all(a, reader.fh) == FIRST, "the reader keeps its version"
        await a.fs.release(reader.fh)


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_reader_opened_during_a_save_that_changed_nothing_keeps_the_version_before(
        tmp_path: Path, durability: str):
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability=durability, upload_hold=0.0)) as (a, b):
        ino = await a.save(ROOT_INO, b"f", FIRST)
        writer = await a.fs.open(ino, os.O_RDWR, a.me())      # opened, nothing written
        reader = await a.fs.open(ino, os.O_RDONLY, a.me())
        await a.fs.flush(writer.fh)
        await a.fs.release(writer.fh)
        await a.save(ROOT_INO, b"f", THIRD)
        assert await _read_all(a, reader.fh) == FIRST
        await a.fs.release(reader.fh)


async def test_a_reader_of_a_truncate_that_failed_is_pinned_to_the_restored_size(
        tmp_path: Path):
    """(A review, stop 44.)  A truncate by name whose commit fails ends its session unchanged; a reader that
    opened during it was pinned before the size was restored: 5 bytes of 50 000."""
    data = b"D" * 50_000
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability="async", upload_hold=0.0)) as (a, b):
        await a.save(ROOT_INO, b"f", data)
        await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        ino = await b.resolve("f")
        box = {}

        def failing_commit(inode, rt, session, size) -> None:
            # a reader opens while the truncate's session is open
            box["reader"] = b.fs.opening._new_handle(b.fs.st.ns.get(ino), b.me(), False)
            raise FsError(errno.ENOSPC, "state dir full (injected)")
        b.fs.publisher._commit = failing_commit
        with pytest.raises(FsError):
            await b.fs.setattr(ino, size=5)
        del b.fs.publisher._commit
        assert len(await b.fs.read(box["reader"].fh, 0, 1 << 20)) == len(data)
        await b.fs.release(box["reader"].fh)
