"""The state dir's reserve (``meta/reserve.py``): room given up so that a removal lands
on a full disk, and never a new way to fail.  Cases a review of the first version found
(the full-disk case itself: ``test_state_dir_full.py``)."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.meta.reserve import RETRY_SECONDS, RoomReserve
from ckptfs.procstat import Opener
from ckptfs.store import LocalStore
from support.core import open_core
from test_state_dir_full import DISK_FULL, closed_file, commit_fails

WRITE_NEW = os.O_WRONLY | os.O_CREAT


def run_core(tmp_path, durability: str, body, reserve: RoomReserve | None) -> None:
    async def main() -> None:
        (tmp_path / "store").mkdir()
        async with open_core(tmp_path / "state", LocalStore(tmp_path / "store"),
                             Config(durability=durability), reserve=reserve) as fs:
            await body(fs)
    trio.run(main)


async def read_all(fs, ino: int) -> bytes:
    handle = await fs.open(ino, os.O_RDONLY, Opener.from_tid(os.getpid()))
    try:
        return await fs.read(handle.fh, 0, 1 << 20)
    finally:
        await fs.release(handle.fh)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_name_held_by_a_never_closed_file_shows_its_checkpoint_again_on_a_full_disk(
        tmp_path, durability):
    """A new file renamed over a published checkpoint holds that entry; its writer goes
    without a close.  On a full disk (no commit lands while the reserve is held) the
    name shows the checkpoint again, the reserve is given up for it, and the release
    answers as usual."""
    reserve = RoomReserve(tmp_path / "reserve")

    async def body(fs) -> None:
        await closed_file(fs, b"ckpt", b"old" * 100)
        handle, inode = await fs.create(ROOT_INO, b"tmp", 0o644, WRITE_NEW, 0, 0,
                                        Opener.from_tid(os.getpid()))
        await fs.write(handle.fh, 0, b"new")
        await fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"ckpt", 0)
        assert fs.ns.get(inode.ino).held
        with commit_fails(fs.ns, "unlink", when=lambda *args: reserve.held(),
                          error=DISK_FULL):
            await fs.release(handle.fh)           # no close meant it: abandoned
        assert reserve.given_up == 1    # (and taken again: this disk has room)
        ino = fs.ns.lookup(ROOT_INO, b"ckpt")
        assert ino is not None and ino != inode.ino
        assert await read_all(fs, ino) == b"old" * 100

    run_core(tmp_path, durability, body, reserve)


@pytest.mark.parametrize("between", ["nothing", "rename", "chmod"])
def test_a_never_closed_name_left_on_a_full_disk_reads_as_empty(tmp_path, between):
    """No reserve left: the name of a never-closed file stays (the log says so) and
    reads as an empty file -- also when its written size was saved meanwhile (a rename
    or a chmod saves the inode), where a read raised IndexError."""
    async def body(fs) -> None:
        handle, inode = await fs.create(ROOT_INO, b"tmp", 0o644, WRITE_NEW, 0, 0,
                                        Opener.from_tid(os.getpid()))
        await fs.write(handle.fh, 0, b"abc")
        name = b"tmp"
        if between == "rename":
            await fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"final", 0)
            name = b"final"
        elif between == "chmod":
            await fs.setattr(inode.ino, mode=0o600)
        with commit_fails(fs.ns, "unlink", error=DISK_FULL):
            await fs.release(handle.fh)
        ino = fs.ns.lookup(ROOT_INO, name)
        assert ino == inode.ino
        assert fs.getattr(ino).size == 0
        assert await read_all(fs, ino) == b""

    run_core(tmp_path, "sync", body, None)


def test_a_state_dir_that_cannot_be_looked_at_holds_no_reserve_and_fails_no_commit(
        tmp_path):
    """The reserve's checks never raise (a commit that landed must run its after-commit
    work): a path under a file (ENOTDIR) is simply not held."""
    (tmp_path / "afile").write_bytes(b"")
    reserve = RoomReserve(tmp_path / "afile" / "reserve")
    assert not reserve.held() and not reserve.arm() and not reserve.give_up()
    ns = Namespace(tmp_path / "meta", reserve=reserve)
    ran: list[int] = []
    for i in range(3):
        with ns.batch():
            ns.meta_put("k", str(i))
            ns.after_commit(lambda i=i: ran.append(i))
    assert ran == [0, 1, 2]
    assert ns.meta_get("k") == "2"
    ns.close()


def test_a_full_lmdb_map_does_not_spend_the_disks_reserve(tmp_path):
    """A full map (MapFullError) is ENOSPC too, but room on the disk cannot help it:
    the reserve stays held and the removal is ENOSPC."""
    reserve = RoomReserve(tmp_path / "reserve")
    ns = Namespace(tmp_path / "meta", reserve=reserve)
    inode = ns.reserve_inode("file", 0o644, 0, 0)
    ns.attach(inode, ns.get(ROOT_INO), b"f")
    with commit_fails(ns, "unlink"), pytest.raises(FsError) as info:
        ns.with_room(lambda: ns.unlink(inode, all_names=True))
    assert info.value.errno == errno.ENOSPC
    assert reserve.held() and reserve.describe() == "held"
    ns.close()


def test_a_reserve_that_cannot_be_taken_is_tried_again_only_after_a_pause(
        tmp_path, monkeypatch):
    """A quota (which ``statvfs`` does not show) refuses the reserve: the commits after
    it try again once per ``RETRY_SECONDS``, not each."""
    import ckptfs.meta.reserve as reserve_module
    tries: list[int] = []

    def refused(fd: int, offset: int, length: int) -> None:
        tries.append(length)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(reserve_module.os, "posix_fallocate", refused)
    now = [0.0]
    reserve = RoomReserve(tmp_path / "reserve", clock=lambda: now[0])
    ns = Namespace(tmp_path / "meta", reserve=reserve)
    for i in range(100):
        ns.meta_put("k", str(i))
    assert len(tries) == 1
    now[0] += RETRY_SECONDS
    for i in range(100):
        ns.meta_put("k", str(i))
    assert len(tries) == 2
    assert not (tmp_path / "reserve.new").exists()
    monkeypatch.undo()
    now[0] += RETRY_SECONDS
    ns.meta_put("k", "held")
    assert reserve.held()
    ns.close()


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_failed_commit_keeps_an_open_writers_size_and_bytes_in_sight(tmp_path, durability):
    """Soak seed 1215183: a file being written (never closed) is renamed while the state
    dir is full; the rename fails (ENOSPC) and its inode is read again from disk, where
    the size of the writes so far was never saved: the file showed 0 bytes, not the
    bytes its writer had written."""
    from test_state_dir_full import commit_fails

    async def body(fs) -> None:
        handle, _ = await fs.create(ROOT_INO, b"f0", 0o644, WRITE_NEW, 0, 0,
                                    Opener.from_tid(os.getpid()))
        await fs.write(handle.fh, 0, b"x" * 60)
        await fs.write(handle.fh, 60, b"y" * 40)
        ino = fs.ns.lookup(ROOT_INO, b"f0")
        with commit_fails(fs.ns, "move", error=DISK_FULL), pytest.raises(FsError) as info:
            await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        assert info.value.errno == errno.ENOSPC
        assert fs.ns.lookup(ROOT_INO, b"f0") == ino and fs.ns.lookup(ROOT_INO, b"f1") is None
        assert fs.getattr(ino).size == 100
        assert await read_all(fs, ino) == b"x" * 60 + b"y" * 40
        await fs.write(handle.fh, 100, b"z")             # the writer goes on
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        await fs.wait_idle()
        assert await read_all(fs, ino) == b"x" * 60 + b"y" * 40 + b"z"
    run_core(tmp_path, durability, body, None)
