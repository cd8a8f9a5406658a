"""What a hostile run found around closes that are not the last word (helper, stop 43).

1. Writes that come after the descriptor's close: a program maps a file ``MAP_SHARED``,
   closes the descriptor, writes through the mapping, ``msync``s (0) and unmaps (the C
   idiom; ``torch.from_file(shared=True)`` does it).  The writes reach the daemon after
   the close, start a new version, and no close of its own comes: the release abandoned
   it ("no writer closed it for good"), the bytes were dropped.  Now a version started by
   writes after its handle's close is decided at its release.
2. Two writers of one file: B holds it open, A writes and closes (0: "saved"), then B is
   killed.  A's close passed the decision on to B's handle; B's killed flush abandoned
   the version -- A's saved bytes with it.  Now a version another writer's close meant
   is published when the last writer is killed (with what it wrote before), and the log
   says so; a version only a killed writer wrote still publishes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.procstat import Opener
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, two_cores

pytestmark = pytest.mark.trio

OLD = b"the version before " * 100
CLOSED = b"A: closed and told saved\n"
LATER = b"written after the close, through a mapping " * 50


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("existing", [False, True], ids=["new file", "existing file"])
async def test_writes_after_the_close_are_published_at_the_release(
        tmp_path: Path, durability: str, existing: bool):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability=durability,
                                                 upload_hold=0.0)) as (a, b):
        if existing:
            ino = await a.save(ROOT_INO, b"f", OLD)
            handle = await a.fs.open(ino, os.O_RDWR, a.me())
        else:
            handle, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0,
                                              a.me())
            await a.fs.write(handle.fh, 0, b"\0" * len(LATER))
        await a.fs.flush(handle.fh)                 # close(fd): the mapping stays
        await a.fs.write(handle.fh, 0, LATER)       # msync / munmap writes back
        await a.fs.release(handle.fh)
        await a.fs.wait_idle()
        want = LATER + (OLD[len(LATER):] if existing else b"")
        assert await a.load(await a.resolve("f")) == want
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f")) == want


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_close_another_writer_meant_survives_the_kill_of_the_last(
        tmp_path: Path, durability: str):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability=durability,
                                                 upload_hold=0.0)) as (a, b):
        ino = await a.save(ROOT_INO, b"log", OLD)
        await a.fs.wait_idle()
        writer_b = await a.fs.open(ino, os.O_WRONLY, Opener(tid=1, tgid=1))  # another
        await a.fs.write(writer_b.fh, len(OLD), b"B line 1\n")
        writer_a = await a.fs.open(ino, os.O_WRONLY, a.me())
        await a.fs.write(writer_a.fh, len(OLD) + 9, CLOSED)
        await a.fs.flush(writer_a.fh)
        await a.fs.release(writer_a.fh)               # A's close returned 0
        a.fs.died_unclean = lambda opener: opener.tgid == 1      # B is killed
        await a.fs.flush(writer_b.fh)
        await a.fs.release(writer_b.fh)
        a.fs.died_unclean = lambda opener: False
        await a.fs.wait_idle()
        want = OLD + b"B line 1\n" + CLOSED
        assert await a.load(ino) == want
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("log")) == want


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_process_killed_after_closing_one_of_its_two_descriptors_publishes_nothing(
        tmp_path: Path, durability: str):
    """The other side: the close was this same process's, which was still writing
    through its other descriptor when it was killed."""
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability=durability,
                                                 upload_hold=0.0)) as (a, b):
        ino = await a.save(ROOT_INO, b"log", OLD)
        await a.fs.wait_idle()
        first = await a.fs.open(ino, os.O_WRONLY, a.me())
        second = await a.fs.open(ino, os.O_WRONLY, a.me())
        await a.fs.write(first.fh, 0, CLOSED)
        await a.fs.flush(first.fh)
        await a.fs.release(first.fh)
        await a.fs.write(second.fh, 0, b"torn")
        a.fs.died_unclean = lambda opener: True
        await a.fs.flush(second.fh)
        await a.fs.release(second.fh)
        a.fs.died_unclean = lambda opener: False
        await a.fs.wait_idle()
        assert await a.load(ino) == OLD
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("log")) == OLD
