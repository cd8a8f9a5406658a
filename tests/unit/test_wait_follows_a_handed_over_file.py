"""Found by a review: ``ckptfs wait FILE`` waits for the inode the path had when it was asked
(``ControlServer._wait``: ``_unfinished_under(top)`` by inode).  A writer's open beside
a reader hands the owed version, with its pending publish, to a fresh inode
(``taken.hand_owed_version_to``): the wait then finds nothing queued under the old
inode and answers done, while the closed version it waited for is not in the store."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.node.control import ControlServer, Peer
from ckptfs.store import MemoryStore
from support.core import Core, open_core, reached
from test_save_beside_a_reader_on_its_node import OLD

pytestmark = pytest.mark.trio


class Host:
    def __init__(self, fs, mountpoint: str) -> None:
        self.fs, self.opts, self.config, self.stale = \
            fs, SimpleNamespace(mountpoint=mountpoint), fs.st.config, None

    def pending(self, inos=None) -> dict:
        return {"pending_uploads": len(inos or ())}


async def test_wait_on_a_file_is_done_only_once_its_closed_version_landed(tmp_path):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability="async", upload_hold=0.0)) as fs:
        core = Core(fs, store)
        uploading = store.gate("put", prefix="chunks/", times=1000)
        try:
            old = await core.save(ROOT_INO, b"f0", OLD)
            await reached(uploading)                    # OLD is owed to the store
            reader = await fs.open(old, os.O_RDONLY, core.me())
            server = ControlServer(Host(fs, "/mnt"), str(tmp_path / "c.sock"))
            answers: list[dict] = []

            async def send(doc: dict) -> None:
                answers.append(doc)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server._wait, "/mnt/f0", Peer(1, 0, 0), send)
                await trio.sleep(0.2)
                assert not any(a.get("done") for a in answers)
                # The trainer's next save opens the name beside the reader.
                with pytest.raises(FsError) as moved:
                    await fs.open(old, os.O_WRONLY | os.O_TRUNC, core.me())
                assert moved.value.errno == errno.ESTALE
                await trio.sleep(1.5)
                landed = not fs.st.queue.queued
                assert landed or not any(a.get("done") for a in answers), \
                    "`ckptfs wait f0` said done while f0's closed version is not in the store"
                nursery.cancel_scope.cancel()
            await fs.release(reader.fh)
        finally:
            uploading.release()
