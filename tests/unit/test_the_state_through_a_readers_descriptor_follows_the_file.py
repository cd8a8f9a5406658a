"""Found by a review (stop 50). ``user.ckptfs.state`` read through a reader's
descriptor (``fgetxattr``: the FUSE getxattr names the reader's inode,
``FuseOps.getxattr`` -> ``Filesystem.state_of``).  Before a save beside the reader,
the version it holds and the file's is "uploading"; the save moves the name and hands
the owed version to a fresh inode (``taken.hand_owed_version_to``: ``old.dirty =
False``, queue entry moved), and the same descriptor now answers "published" -- the
reader's inode is clean with a local copy -- although no store has those bytes yet.
A program that reads a checkpoint and checks the state through its descriptor before
deleting its own copy is told the bytes are safe.  ``ckptfs wait`` follows the name
(``Filesystem.now_at``); the state does not."""

from __future__ import annotations

import errno
import os

import pytest

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.store import MemoryStore
from support.core import Core, open_core
from test_save_beside_a_reader_of_a_version_not_uploaded import owed_beside_a_reader

pytestmark = pytest.mark.trio


async def test_the_readers_descriptor_never_says_published_before_the_store_has_it(
        tmp_path):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability="async", upload_hold=0.0)) as fs:
        core = Core(fs, store)
        uploading, old, reader = await owed_beside_a_reader(core, store)
        try:
            before = fs.state_of(old)                   # fgetxattr(reader, state)
            with pytest.raises(FsError) as moved:       # the trainer's next save
                await fs.open(old, os.O_WRONLY | os.O_TRUNC, core.me())
            assert moved.value.errno == errno.ESTALE
            after = fs.state_of(old)                    # the same descriptor
            in_store = not fs.st.queue.queued
        finally:
            uploading.release()
        await fs.release(reader.fh)
    assert not in_store
    assert (before, after) == ("uploading", "uploading"), \
        f"through the reader's descriptor: {before!r} before the save beside it, " \
        f"{after!r} after, while its bytes are in no store"
