"""A failed namespace write (a full state dir) reads its inodes again from disk INTO the
objects callers hold, and puts back what is kept only in memory (an open writer's size
and mtime).  Cases a review of the first fix (soak seed 1215183) found: with a fresh
object beside the held one, a retried removal left the cache naming a removed file, a
publish in flight wrote a failed close's version to disk, and a reload took the last
write's mtime over one the user had set."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO, Inode, _k
from ckptfs.meta.reserve import RoomReserve
from ckptfs.procstat import Opener
from ckptfs.store import MemoryStore
from support.core import open_core
from test_state_dir_full import DISK_FULL, commit_fails
from test_state_dir_reserve import read_all

WRITE_NEW = os.O_WRONLY | os.O_CREAT


def on_disk(ns, ino: int) -> Inode | None:
    with ns.env.begin() as txn:
        raw = txn.get(_k(ino), db=ns.db_inodes)
    return None if raw is None else Inode.decode(raw)


def run(tmp_path, durability: str, body, reserve: RoomReserve | None = None) -> None:
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "state", store, Config(durability=durability),
                             reserve=reserve) as fs:
            await body(fs, store)
    trio.run(main)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_removal_retried_with_the_reserve_leaves_no_name_and_no_record(tmp_path,
                                                                         durability):
    reserve = RoomReserve(tmp_path / "reserve")

    async def body(fs, store) -> None:
        handle, inode = await fs.create(ROOT_INO, b"tmp", 0o644, WRITE_NEW, 0, 0,
                                        Opener.from_tid(os.getpid()))
        await fs.write(handle.fh, 0, b"never closed")
        fs.st.died_unclean = lambda opener: True    # its writer was killed
        with commit_fails(fs.ns, "unlink", when=lambda *args: reserve.held(),
                          error=DISK_FULL):
            await fs.flush(handle.fh)                # the kernel's flush: abandoned
        assert reserve.given_up == 1
        assert fs.ns.get(inode.ino).parent == 0 == on_disk(fs.ns, inode.ino).parent
        await fs.release(handle.fh)
        assert fs.ns.lookup(ROOT_INO, b"tmp") is None
        await fs.wait_idle()
        assert on_disk(fs.ns, inode.ino) is None           # released: its record gone
        assert fs.ns.maybe_get(inode.ino) is None

    run(tmp_path, durability, body, reserve)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_an_mtime_set_on_an_open_file_outlives_a_failed_commit(tmp_path, durability):
    async def body(fs, store) -> None:
        handle, inode = await fs.create(ROOT_INO, b"f0", 0o644, WRITE_NEW, 0, 0,
                                        Opener.from_tid(os.getpid()))
        await fs.write(handle.fh, 0, b"x" * 100)
        await fs.setattr(inode.ino, mtime_ns=10**18)
        with commit_fails(fs.ns, "move", error=DISK_FULL), pytest.raises(FsError):
            await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        assert fs.getattr(inode.ino).mtime_ns == 10**18
        assert fs.getattr(inode.ino).size == 100
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        await fs.wait_idle()
        assert fs.getattr(inode.ino).mtime_ns == 10**18

    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_close_that_failed_is_not_published_by_the_publish_in_flight(tmp_path,
                                                                       durability):
    """v1 is closed and its entry PUT is in flight; a writer writes v2 and its close
    fails to commit (ENOSPC).  v1's publish then saved the inode object v2's close had
    changed: v2 (never closed) reached the store and the file read EIO."""
    async def body(fs, store) -> None:
        me = Opener.from_tid(os.getpid())
        held = store.gate("put_if_absent", prefix="dirs/root/f")
        first, inode = await fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, me)
        await fs.write(first.fh, 0, b"A" * 10)

        async def close_first() -> None:
            await fs.flush(first.fh)
            await fs.release(first.fh)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_first)
            assert await trio.to_thread.run_sync(held.wait_reached, 10.0)
            second = await fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC, me)
            await fs.write(second.fh, 0, b"B" * 20)
            with commit_fails(fs.ns, "save", when=lambda i: i.ino == inode.ino,
                              error=DISK_FULL), pytest.raises(FsError):
                await fs.flush(second.fh)
            held.release()
        await fs.release(second.fh)
        with trio.fail_after(30):       # (it published v2, then retried forever: EIO)
            await fs.wait_idle()
        assert await read_all(fs, inode.ino) == b"A" * 10
        body_of_entry = store.get("dirs/root/f")[0]
        assert b'"size":10' in body_of_entry.replace(b" ", b""), body_of_entry

    run(tmp_path, durability, body)
