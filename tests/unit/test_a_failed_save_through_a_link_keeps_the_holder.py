"""Found by a review (stop 50) of 5099db9: ``become_linked`` ran ``take_names_of``
inside its own batch, so ``take_names_of``'s ``delete_inode(holder)`` (staging files
removed, cache untracked, queue/leases forgotten) ran BEFORE the batch committed.  When that batch then
fails (a full state dir), the holder is rolled back -- it keeps its names and its
``local_copy`` -- but its staging file is already gone: the linked file, untouched on
every node, no longer read on this one (EIO: staging file missing).

Before 5099db9 ``take_names_of`` ran after the PUT in a batch of its own, and
``delete_inode`` only after that batch had committed.  Now ``take_names_of``'s work
outside the namespace waits for the commit (``after_commit``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, two_cores
from test_state_dir_full import DISK_FULL, commit_fails

pytestmark = pytest.mark.trio

FIRST = b"B's own save of f0 " * 10
SAVE = b"B's save of f2 " * 10


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_failed_save_through_a_link_keeps_the_holders_local_copy(
        tmp_path: Path, durability: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        # B saves f0 itself: its inode for f0 keeps a local copy (staging file).
        f0 = await b.save(ROOT_INO, b"f0", FIRST)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        holder = b.fs.ns.get(f0)
        assert holder.local_copy and b.fs.st.staging.exists(f0, holder.ver)
        await a.fs.refresh_dir(ROOT_INO, force=True)
        a_f0 = await a.resolve("f0")
        # B starts f2; A links f0 as f2; B's listing makes its f0 the linked file.
        handle, _ = await b.fs.create(ROOT_INO, b"f2", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.write(handle.fh, 0, SAVE)
        await a.fs.link(a_f0, ROOT_INO, b"f2")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert b.fs.ns.get(f0).link_id is not None and b.fs.ns.get(f0).local_copy
        # B's close saves through the link; a write of that step fails (the state dir
        # is full): the holder's publish record, as it lets the holder go.
        hits: list[int] = []

        def fires(ino: int) -> bool:
            if ino == f0 and not hits:
                hits.append(ino)
                return True
            return False
        with commit_fails(b.fs.ns, "publish_pending_done", when=fires, error=DISK_FULL):
            try:
                await b.fs.flush(handle.fh)
            except FsError:
                pass
            with trio.fail_after(30):
                while not hits:
                    await trio.sleep(0.01)
            await trio.sleep(0.1)
        # Whatever that failure left on B, f0 reads: the holder's bytes (the step
        # undone) or the save through the link (the step done) -- never a local copy
        # that is gone.
        now = b.fs.ns.get(b.fs.ns.lookup(ROOT_INO, b"f0"))
        state = (now.ino, now.local_copy, now.dirty, now.link_id is not None,
                 b.fs.st.staging.exists(now.ino, now.ver))
        try:
            got = await b.load(now.ino)
        except (FsError, OSError) as exc:
            got = exc
        assert got in (FIRST, SAVE), \
            f"after the failed batch B's f0 (inode, local_copy, dirty, linked, staging " \
            f"file exists) = {state} reads {got!r}"
        await b.fs.release(handle.fh)

