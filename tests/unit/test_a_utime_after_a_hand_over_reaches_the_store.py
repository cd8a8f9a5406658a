"""Found by a review (stop 50). ``taken.hand_owed_version_to`` gives the fresh inode
``closed_mtime_ns = closed_mtime(old)`` although no write session is open on it.
``closed_mtime_ns`` means "a session is open: the closed version's mtime is this one"
(``entries.closed_mtime``; cleared by ``Publish._commit`` and ``restore_closed_size``).
Left set on a file with no session, it wins over ``mtime_ns`` in the entry the
fresh inode publishes: a ``touch -d``/``utime`` of the file after the hand-over (by
path, or through the reader's descriptor, which ``Filesystem._set_where_the_name_moved``
sends to the fresh inode) is shown here and never reaches the store -- the nodes
disagree on the file's mtime for good.

Where the hand-over is followed by a writer's retry, the retry's session resets the
field; the cases without one are a *reader's* open that moves the name
(``wait_for_passthrough_readers(writable=False)``: a passthrough reader of the version
before, the version after written by the kernel after the close), and a writer's step
whose retry never comes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached, two_cores
from test_save_beside_a_reader_of_a_version_not_uploaded import owed_beside_a_reader

pytestmark = pytest.mark.trio

ASYNC = Config(durability="async", upload_hold=0.0)
CLOSED = b"P" * 40000
LATER = b"C" * 100
WHEN = 1_500_000_000_123_456_789     # touch -d 2017-07-14 ...


async def test_a_utime_after_a_readers_open_moved_the_name_reaches_the_store(
        tmp_path: Path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, ASYNC) as (a, b):
        a.fs.st.passthrough_available = lambda: True
        uploading = store.gate("put", prefix="chunks/", times=1000)
        try:
            writer, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0,
                                              a.me())
            assert writer.passthrough
            ver = a.fs.st.runtime[inode.ino].session.ver
            path = a.fs.st.staging.path(inode.ino, ver)
            with open(path, "r+b") as kernel:
                kernel.write(CLOSED)
            await a.fs.flush(writer.fh)             # the close; a child still holds it
            await reached(uploading)                # CLOSED is owed to the store
            first = await a.fs.open(inode.ino, os.O_RDONLY, a.me())   # (passthrough)
            assert first.passthrough
            with open(path, "r+b") as kernel:       # the child writes on, then exits
                kernel.write(LATER)
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
            await a.fs.release(writer.fh)           # the late bytes: the next version
            assert a.fs.ns.get(inode.ino).ver != ver and a.fs.ns.get(inode.ino).dirty
            # Another reader opens the name: the kernel still reads the version before
            # through the first reader's backing file, so the name moves (ESTALE) and
            # the fresh inode takes the owed version over.  No writer follows.
            with pytest.raises(FsError) as moved:
                await a.fs.open(inode.ino, os.O_RDONLY, a.me())
            assert moved.value.errno == errno.ESTALE
            fresh = await a.resolve("f")
            assert fresh != inode.ino
            second = await a.fs.open(fresh, os.O_RDONLY, a.me())
            await a.fs.setattr(fresh, mtime_ns=WHEN)           # touch -d ... f
            assert a.fs.getattr(fresh).mtime_ns == WHEN
        finally:
            uploading.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await a.fs.release(first.fh)
        await a.fs.release(second.fh)
        here = a.fs.getattr(await a.resolve("f")).mtime_ns
        await b.fs.refresh_dir(ROOT_INO, force=True)
        there = b.fs.getattr(await b.resolve("f")).mtime_ns
        assert (here, there) == (WHEN, WHEN), \
            f"touch -d after the hand-over: this node shows mtime {here}, the store " \
            f"(node b) {there}; wanted {WHEN} on both"


async def moved_beside_a_reader(core: Core, store: MemoryStore) -> tuple:
    """``f0`` owed to the store beside a reader, and a writer's open that moved the
    name (ESTALE) and never came back: (the upload gate, the reader's inode, its
    handle)."""
    uploading, old, reader = await owed_beside_a_reader(core, store)
    with pytest.raises(FsError) as moved:
        await core.fs.open(old, os.O_WRONLY, core.me())
    assert moved.value.errno == errno.ESTALE
    return uploading, old, reader


async def test_a_utime_through_the_readers_descriptor_reaches_the_store(tmp_path: Path):
    """The stop-49 promise (a change through a reader's descriptor is the file's) for an
    mtime: the writer's step moved the name and its retry never came (the writer was
    killed in between)."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await moved_beside_a_reader(core, store)
        try:
            await fs.setattr(old, mtime_ns=WHEN)     # futimens(reader's fd)
        finally:
            uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        await fs.release(reader.fh)
        here = fs.getattr(await core.resolve("f0")).mtime_ns
    async with open_core(tmp_path / "b", store, ASYNC) as fs:
        other = Core(fs, store)
        there = fs.getattr(await other.resolve("f0")).mtime_ns
    assert (here, there) == (WHEN, WHEN), \
        f"futimens through the reader's descriptor: this node shows {here}, the store " \
        f"{there}; wanted {WHEN} on both"


async def test_a_utime_after_a_hand_over_survives_a_restart(tmp_path: Path):
    """The same field reverts the change here too at the next start
    (``Recovery.start`` -> ``restore_closed_size``: ``mtime_ns = closed_mtime_ns``)."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await moved_beside_a_reader(core, store)
        try:
            await fs.setattr(await core.resolve("f0"), mtime_ns=WHEN)
        finally:
            uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        await fs.release(reader.fh)
    async with open_core(tmp_path / "a", store, ASYNC) as fs:     # the daemon restarts
        core = Core(fs, store)
        here = fs.getattr(await core.resolve("f0")).mtime_ns
    assert here == WHEN, f"after a restart f0's mtime is {here}, not the {WHEN} set"
