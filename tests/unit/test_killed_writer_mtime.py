"""A writer that opened a file with O_TRUNC and was killed leaves nothing: the file shows
its last closed version again -- its size, its bytes, and its mtime.  The mtime stayed
the truncating open's (or the last write's) on the writer's node only: the store and
every other node showed the closed version's, this node another one, for good (found by
the model test's utime steps: utime f0, a writer opens f0, the writer is SIGKILLed)."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, me, two_cores
from ckptfs.store import MemoryStore

SET = 1_000_000_000_123_456_789


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("set_during", [False, True], ids=["utime-before", "utime-during"])
def test_a_killed_writer_leaves_the_closed_version_s_mtime(tmp_path, durability, set_during):
    """``utime-during``: an mtime set while the writer had the file open is the closed
    version's too (it is published with it), and stays after the kill."""
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store, Config(metadata_ttl=0.05,
                                                     durability=durability)) as (a, b):
            ino = await a.save(ROOT_INO, b"f0", b"v1")
            await a.fs.setattr(ino, mtime_ns=SET - 1)
            await a.fs.wait_idle()
            handle = await a.fs.open(ino, WRITE_NEW & ~os.O_CREAT, me())
            await a.fs.write(handle.fh, 0, b"partial bytes")
            if set_during:
                await a.fs.setattr(ino, mtime_ns=SET)
            want = SET if set_during else SET - 1
            a.fs.died_unclean = lambda opener: True          # its writer "was killed"
            await a.fs.flush(handle.fh)
            await a.fs.release(handle.fh)
            await a.fs.wait_idle()
            await trio.sleep(0.1)
            for name, node in (("A", a), ("B", b)):
                await node.names()
                inode = node.fs.getattr(await node.resolve("f0"))
                assert (name, inode.size, inode.mtime_ns) == (name, 2, want)
    trio.run(main)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_writer_open_when_the_daemon_died_leaves_the_closed_version_s_mtime(
        tmp_path, durability):
    """The same after a daemon crash: the next run abandons the never-closed working
    version, and the file shows its closed version's mtime again -- the node kept the
    truncating open's, which the crash had left in its records (the model test's helper
    found it: utime f0, a writer opens f0, the node's daemon is SIGKILLed)."""
    from support.core import Core, open_core

    async def main() -> None:
        store = MemoryStore()
        config = Config(durability=durability)
        async with open_core(tmp_path, store, config) as fs:
            core = Core(fs, store)
            ino = await core.save(ROOT_INO, b"f0", b"v1")
            await fs.setattr(ino, mtime_ns=SET)
            await fs.wait_idle()
            handle = await fs.open(ino, WRITE_NEW & ~os.O_CREAT, me())
            await fs.write(handle.fh, 0, b"partial bytes")
            assert fs.getattr(ino).mtime_ns != SET
            # The daemon dies here: its writer's handle is never released.
        async with open_core(tmp_path, store, config) as fs:
            core = Core(fs, store)
            inode = fs.getattr(await core.resolve("f0"))
            assert (inode.size, inode.mtime_ns) == (2, SET)
            assert await core.load(inode.ino) == b"v1"
    trio.run(main)
