"""Found by a review: a *reader's* open that moves the name (``wait_for_passthrough_readers``,
a reader of another version than the kernel's passthrough backing file) leaves the
writer's retry pass on the fresh inode (``_move_for_a_writer`` is called with its
default ``writes=True``; decision 0031 says a reader's move gets no pass).  The next
writer within ``WRITER_RETRY_WINDOW`` then goes on in place beside that reader, on the
fresh inode it holds: the kernel's size of the reader's inode is cut."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached
from test_save_beside_a_reader_on_its_node import step_by_name

pytestmark = pytest.mark.trio

CLOSED, LATE, NEXT = b"a" * 3000, b"b" * 4000, b"the next save"


async def test_a_readers_move_leaves_no_pass_for_the_next_writer(tmp_path):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability="async", upload_hold=0.0)) as fs:
        fs.st.passthrough_available = lambda: True
        core = Core(fs, store)
        uploading = store.gate("put", prefix="chunks/", times=1000)
        try:
            await _scenario(fs, core, uploading)
        finally:
            uploading.release()


async def _scenario(fs, core, uploading) -> None:
        writer, inode = await fs.create(ROOT_INO, b"f0", 0o644, WRITE_NEW, 0, 0, core.me())
        assert writer.passthrough
        os.pwrite(fs.backing_fd(writer), CLOSED, 0)
        early = await fs.open(inode.ino, os.O_RDONLY, core.me())   # joins, passthrough
        assert early.passthrough
        await fs.flush(writer.fh)
        await reached(uploading)
        os.pwrite(fs.backing_fd(writer), LATE, 0)    # a child writes on after the close
        await fs.release(writer.fh)                  # -> the next version, owed
        with trio.fail_after(10):
            while fs.st.oplog.pending:
                await trio.sleep(0.01)

        handles = []

        async def read_open(ino: int) -> None:
            handles.append(await fs.open(ino, os.O_RDONLY, core.me()))
        fresh = await step_by_name(core, read_open)     # a reader's open moves the name
        assert fresh != inode.ino
        evaluator = handles[0]
        assert await fs.read(evaluator.fh, 0, 10000) == LATE

        async def save(ino: int) -> None:               # the trainer's next save
            handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
            await fs.write(handle.fh, 0, NEXT)
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
        acted = await step_by_name(core, save)
        assert acted != fresh, \
            "the next save went in place into the inode a reader holds (a reader's pass)"
        assert fs.getattr(fresh).size == len(LATE)
        for h in (early, evaluator):
            await fs.release(h.fh)
