"""A save closed by a process that exits holding the file twice is decided at its last
release, in the background (both flushes come before either release).  A writer that
opens the file meanwhile must start after that save, not inside it.

Found by the core model (shrunk to three steps: a file created and held open; closed
by an exit holding it twice; opened again with ``O_TRUNC`` and held): the second
writer joined the undecided session, its ``O_TRUNC`` cut the save, and the decision at
the release then left it to the second writer's close.  The other node never saw the
save -- and had the second writer been killed, the save was gone everywhere.  Now the
open waits for the decision (``Writes._join_session``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, HeldCheck, open_core

pytestmark = pytest.mark.trio

SAVED = b"saved by a process that exited holding it twice " * 2000   # checked in a thread


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("then", ["closed", "killed"])
async def test_a_writer_opening_while_a_release_decides_a_save_comes_after_it(
        tmp_path: Path, durability: str, then: str):
    slow_check = HeldCheck()
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=0.0)
    async with open_core(tmp_path / "a", store, config, check_complete=slow_check) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        first, inode = await a.fs.create(ROOT_INO, b"f1", 0o644, WRITE_NEW, 0, 0, a.me())
        again = await a.fs.open(inode.ino, os.O_RDWR, a.me())
        await a.fs.write(first.fh, 0, SAVED)
        for fh in (first.fh, again.fh):         # the exit: both flushes, then releases
            await a.fs.flush(fh)
        for fh in (first.fh, again.fh):
            await a.fs.release(fh)
        await slow_check.reached()
        opened: list = []

        async def open_over() -> None:
            opened.append(await a.fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC, a.me()))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_over)
            await trio.sleep(0.2)               # the open is under way
            slow_check.go_on.set()
        handle = opened[0]
        with trio.fail_after(30):
            await a.fs.wait_idle()
        assert await b.names() == ["f1"], "the other node never saw the save"
        assert await b.load(await b.resolve("f1")) == SAVED
        if then == "closed":
            await a.fs.write(handle.fh, 0, b"the next save")
            await a.fs.flush(handle.fh)
        await a.fs.release(handle.fh)           # (no close that meant it: killed)
        with trio.fail_after(30):
            await a.fs.wait_idle()
        want = b"the next save" if then == "closed" else SAVED
        for node in (a, b):
            assert await node.load(await node.resolve("f1")) == want
