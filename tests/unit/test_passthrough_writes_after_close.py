"""Writes through the kernel after a passthrough version's close (a hostile run, stop 43).

A writer's descriptor (or a mapping of it) may outlive the close that made its version
the closed one: a forked child writing after its parent's close, a mapping written back
long after.  Through kernel passthrough those writes go straight into that version's
staging file and the daemon never sees them: the store kept the bytes of the close
while the writer's node showed the later ones (a fresh node read ``PPP...`` where the
writer's read ``CCC...``; an extension was lost everywhere but there).  Now the release
of such a handle finds the file changed since its close and makes those bytes the next
closed version, published like any other."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, two_cores

pytestmark = pytest.mark.trio

CLOSED = b"P" * 40000
LATER = b"C" * 100


async def _closed_through_the_kernel(core, wait_first: bool):
    """A passthrough save of ``f`` whose writer's close came and whose handle stays
    (a forked child holds it): the handle, the inode and the staging file's path."""
    core.fs.st.passthrough_available = lambda: True
    handle, inode = await core.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, core.me())
    assert handle.passthrough, "the kernel writes this handle's bytes"
    path = core.fs.st.staging.path(inode.ino, core.fs.st.runtime[inode.ino].session.ver)
    with open(path, "r+b") as kernel:           # what the kernel does
        kernel.write(CLOSED)
    await core.fs.flush(handle.fh)              # the parent's close
    if wait_first:
        await core.fs.wait_idle()
    return handle, inode, path


@pytest.mark.parametrize("extends", [False, True], ids=["in place", "extending"])
@pytest.mark.parametrize("wait_first", [False, True], ids=["upload pending", "uploaded"])
async def test_kernel_writes_after_the_close_become_the_next_version(
        tmp_path: Path, extends: bool, wait_first: bool):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="async",
                                                 upload_hold=0.0)) as (a, b):
        handle, inode, path = await _closed_through_the_kernel(a, wait_first)
        with open(path, "r+b") as kernel:           # the child writes on
            kernel.seek(len(CLOSED) if extends else 0)
            kernel.write(LATER)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        await a.fs.release(handle.fh)               # ... and exits
        await a.fs.wait_idle()
        want = CLOSED + LATER if extends else LATER + CLOSED[len(LATER):]
        assert await a.load(inode.ino) == want
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f")) == want, "every node has the same bytes"


async def test_an_unchanged_file_is_not_published_again(tmp_path: Path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="async",
                                                 upload_hold=0.0)) as (a, b):
        a.fs.st.passthrough_available = lambda: True
        handle, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        path = a.fs.st.staging.path(inode.ino, a.fs.st.runtime[inode.ino].session.ver)
        with open(path, "r+b") as kernel:
            kernel.write(CLOSED)
        await a.fs.flush(handle.fh)
        await a.fs.wait_idle()
        puts = len([c for c in store.calls if c.op in ("put", "put_if_absent")])
        await a.fs.release(handle.fh)
        await a.fs.wait_idle()
        assert len([c for c in store.calls if c.op in ("put", "put_if_absent")]) == puts


@pytest.mark.parametrize("wait_first", [False, True], ids=["upload pending", "uploaded"])
async def test_a_truncate_through_the_handle_after_the_close_keeps_the_writes_after_it(
        tmp_path: Path, wait_first: bool):
    """The child truncates through the inherited descriptor (a SETATTR with its handle,
    on the daemon's path), then writes on (through the kernel, into the closed
    version's staging file).  The truncate made a version of its own from a copy and
    the writes after it were dropped: ``PPPPPPPPPP`` where the child wrote
    ``CCCCCPPPPP`` (a real mount showed it).  Now the truncate acts on the file the
    kernel writes, and the release makes the whole of it the next version."""
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="async",
                                                 upload_hold=0.0)) as (a, b):
        handle, inode, path = await _closed_through_the_kernel(a, wait_first)
        await a.fs.setattr(inode.ino, size=10, fh=handle.fh)    # the child's ftruncate
        with open(path, "r+b") as kernel:           # ... its write through the kernel
            kernel.write(b"C" * 5)
        await a.fs.release(handle.fh)               # ... and its exit
        await a.fs.wait_idle()
        want = b"C" * 5 + CLOSED[5:10]
        assert await a.load(inode.ino) == want
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f")) == want, "every node has the same bytes"


@pytest.mark.parametrize("wait_first", [False, True], ids=["pending", "uploaded"])
async def test_an_ftruncate_through_a_closed_passthrough_handle_answers_the_new_size(
        tmp_path: Path, wait_first: bool):
    """(A review, stop 44.)  The truncate cut the staging file to 10 bytes and answered 40 000 (the kernel
    takes the file's size from that answer: fstat and SEEK_END saw the old size)."""
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability="async", upload_hold=0.0)) as (a, _):
        handle, inode, path = await _closed_through_the_kernel(a, wait_first)
        answered = await a.fs.setattr(inode.ino, size=10, fh=handle.fh)
        assert (os.stat(path).st_size, answered.size, a.fs.getattr(inode.ino).size) == \
            (10, 10, 10)
        await a.fs.release(handle.fh)


async def test_a_failed_record_of_writes_after_the_close_leaves_no_second_name(
        tmp_path: Path):
    """(A review, stop 44.)  The record of the next version failed (a full state dir): the hard link made for
    it stayed, its version number was handed out again, and the next session's copy
    opened that name with "wb" -- truncating the closed version's file: 1 byte left."""
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability="async", upload_hold=0.0)) as (a, _):
        handle, inode, path = await _closed_through_the_kernel(a, False)
        with open(path, "r+b") as kernel:           # the child writes on
            kernel.write(LATER)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))

        def full(_inode) -> None:
            raise FsError(errno.ENOSPC, "state dir full (injected)")
        a.fs.publisher._journal_publish = full      # inside the release's batch
        await a.fs.release(handle.fh)               # must not raise
        del a.fs.publisher._journal_publish
        writer = await a.fs.open(inode.ino, os.O_RDWR, a.me())
        await a.fs.write(writer.fh, 0, b"X")
        await a.fs.flush(writer.fh)
        await a.fs.release(writer.fh)
        await a.fs.wait_idle()
        got = await a.load(inode.ino)
        assert (got[:1], len(got)) == (b"X", len(CLOSED))


# Soak seed 1215482 (async, a real mount; about one run in twenty): a process saved a
# new file through the kernel and exited holding it twice -- both flushes, then both
# releases, and the close decision left to the last release, in the background.  In
# that moment the daemon answered the size it had seen written (none: the kernel wrote
# every byte) instead of the staging file's, and a reader opening then read an empty
# file, a version nobody saved.
async def test_between_the_last_release_and_its_close_decision_the_file_shows_its_bytes(
        tmp_path: Path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="async",
                                                 upload_hold=0.0)) as (a, b):
        a.fs.st.passthrough_available = lambda: True
        first, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        second = await a.fs.open(inode.ino, os.O_RDWR, a.me())
        assert first.passthrough and second.passthrough
        path = a.fs.st.staging.path(inode.ino, a.fs.st.runtime[inode.ino].session.ver)
        with open(path, "r+b") as kernel:
            kernel.write(CLOSED)
        await a.fs.flush(first.fh)              # the exit: both flushes first,
        await a.fs.flush(second.fh)
        await a.fs.release(first.fh)            # then both releases
        await a.fs.release(second.fh)
        assert inode.ino in a.fs.st.closing_at_release, "(the decision is still to come)"
        assert a.fs.getattr(inode.ino).size == len(CLOSED)
        reader = await a.fs.open(inode.ino, os.O_RDONLY, a.me())
        assert await a.fs.read(reader.fh, 0, len(CLOSED) + 1) == CLOSED
        await a.fs.release(reader.fh)
        await a.fs.wait_idle()
        assert a.fs.getattr(inode.ino).size == len(CLOSED)
        assert await b.load(await b.resolve("f")) == CLOSED
