"""A process that exits holding one file open twice for writing publishes it.

Found by a hostile run with sqlite (WAL mode: a connection keeps its database's
descriptors open for its POSIX locks, and the process exits with them): at exit the
kernel flushes every descriptor first and releases them after.  Each flush passed the
close on (the opener still held the other descriptor, or another writable handle was
still open), so no flush decided, and the last release took the version for one no
writer closed: a new file vanished (ENOENT), an existing one went back to its previous
bytes, and the program had exited with status 0.

Now a flush that passes the close on says so (``Session.meant``), and the last release
of a session whose last flush meant it makes the close decision there.  A writer killed
with two descriptors still publishes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, two_cores

pytestmark = pytest.mark.trio

OLD = b"the version before " * 400
NEW = b"written through one of two descriptors " * 900


async def _exit_holding_two(core: Core, existing: bool, order: str) -> int:
    """open twice, write through one, then what the kernel does at exit: every flush,
    then every release (in ``order``)."""
    if existing:
        ino = await core.resolve("f")
        first = await core.fs.open(ino, os.O_RDWR | os.O_TRUNC, core.me())
    else:
        first, inode = await core.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0,
                                            core.me())
        ino = inode.ino
    second = await core.fs.open(ino, os.O_RDWR, core.me())
    await core.fs.write(first.fh, 0, NEW)
    handles = [first.fh, second.fh] if order == "written first" else [second.fh, first.fh]
    for fh in handles:
        await core.fs.flush(fh)
    for fh in handles:
        await core.fs.release(fh)
    return ino


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("existing", [False, True], ids=["new file", "existing file"])
@pytest.mark.parametrize("order", ["written first", "written last"])
async def test_an_exit_holding_a_file_twice_for_writing_publishes_it(
        tmp_path: Path, durability: str, existing: bool, order: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        if existing:
            await a.save(ROOT_INO, b"f", OLD)
            await a.fs.wait_idle()
        ino = await _exit_holding_two(a, existing, order)
        await a.fs.wait_idle()
        assert await a.load(await a.resolve("f")) == NEW, "its own node shows the save"
        assert a.fs.state_of(ino) in ("published", "remote"), a.fs.state_of(ino)
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f")) == NEW, "another node shows the save"


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_writer_killed_holding_a_file_twice_publishes_nothing(
        tmp_path: Path, durability: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.save(ROOT_INO, b"f", OLD)
        await a.fs.wait_idle()
        a.fs.died_unclean = lambda opener: True          # its writer "was killed"
        await _exit_holding_two(a, True, "written first")
        a.fs.died_unclean = lambda opener: False
        await a.fs.wait_idle()
        assert await a.load(await a.resolve("f")) == OLD
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f")) == OLD
