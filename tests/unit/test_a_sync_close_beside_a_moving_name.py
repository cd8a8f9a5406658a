"""Found by a review: in sync mode a close returns once its file is in the store
(DESIGN.md promise 5).  A writer's open beside a reader of that closed version, while
the close's upload was under way, moved the name to a fresh inode that took the owed
version over (``taken.hand_owed_version_to``): the close's own publish then found its
inode nameless and ended, and the close returned 0 with the version only queued.  The
hand-over is async mode's only: in sync mode the writer waits for the upload (up to
2 s) as before."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached

pytestmark = pytest.mark.trio

V1, V2 = b"version one " * 100, b"version two, closed in sync mode " * 100


async def test_a_sync_close_returns_only_once_its_version_is_in_the_store(tmp_path):
    store = MemoryStore()
    sync = Config(durability="sync", upload_hold=0.0)
    async with open_core(tmp_path / "a", store, sync) as fs, \
            open_core(tmp_path / "b", store, sync) as other_fs:
        core, other = Core(fs, store), Core(other_fs, store)
        ino = await core.save(ROOT_INO, b"f0", V1)
        uploading = store.gate("put", prefix="chunks/", times=1000)
        writer, _ = await fs.create(ROOT_INO, b"f0", 0o644, WRITE_NEW, 0, 0, core.me())
        await fs.write(writer.fh, 0, V2)
        closed: list[str] = []

        async def close() -> None:
            try:
                await fs.flush(writer.fh)
                closed.append("ok")
            except Exception as exc:        # noqa: BLE001
                closed.append(f"error {exc}")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(close)
            await reached(uploading)        # the close's upload is under way
            reader = await fs.open(ino, os.O_RDONLY, core.me())   # reads the closed V2
            # Another writer opens the name beside that reader (the kernel's retry).
            entries = store.gate("put", prefix="dirs/", times=1000)   # nothing lands
            second = await core.open_by_name("f0", os.O_WRONLY | os.O_TRUNC)
            uploading.release()
            await reached(entries)          # the close's entry PUT, held
            assert not closed, "a sync close returned before its version was in the store"
            entries.release()
            with trio.fail_after(10):
                while not closed:
                    await trio.sleep(0.01)
            assert closed == ["ok"]
            assert await other.load(await other.resolve("f0")) == V2
        await fs.release(second.fh)
        await fs.release(reader.fh)
        await fs.release(writer.fh)
