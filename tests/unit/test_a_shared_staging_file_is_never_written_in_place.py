"""Found by a review: the owed version a fresh inode takes over beside a reader is a
hard link of the reader's staging file (``taken.hand_owed_version_to``).  Once it had
landed, it was the fresh inode's clean local copy, and the next writer opening without
``O_TRUNC`` took that file over and wrote in it (``WritePath._join_session``:
``staging.rename_version``) -- the same file on disk as the reader's version, so the
reader read the new bytes (DESIGN.md promise 2).  A staging file with another name is
now copied, never written in place."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core, reached
from test_save_beside_a_reader_on_its_node import OLD, step_by_name

pytestmark = pytest.mark.trio


async def test_a_writer_after_the_landing_leaves_the_readers_version_alone(tmp_path):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability="async", upload_hold=0.0)) as fs:
        core = Core(fs, store)
        uploading = store.gate("put", prefix="chunks/", times=1000)
        old = await core.save(ROOT_INO, b"f0", OLD)
        await reached(uploading)                    # OLD is owed to the store
        reader = await fs.open(old, os.O_RDONLY, core.me())

        async def open_and_close(ino: int) -> None:   # a writer's open: the name moves
            handle = await fs.open(ino, os.O_RDWR, core.me())
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
        fresh = await step_by_name(core, open_and_close)
        assert fresh != old
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()                    # OLD landed, from the fresh inode
        # A writer patches the file in place (no O_TRUNC), as a logger appends.
        handle = await fs.open(fresh, os.O_RDWR, core.me())
        await fs.write(handle.fh, 0, b"PATCHED")
        assert await fs.read(reader.fh, 0, 7) == OLD[:7], \
            "the reader's version changed under it: its staging file was written"
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        await fs.release(reader.fh)
