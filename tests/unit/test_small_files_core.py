"""Small files in async mode (issue 25 item 4), in the core without FUSE: a directory
this node is filling does not make a lookup or create wait for the store's listing."""

from __future__ import annotations

import errno
import time

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store.memory import MemoryStore
from support.core import WRITE_NEW, me, open_core


def test_a_directory_this_node_fills_answers_without_waiting_for_its_listing(tmp_path):
    """Its listing is past the TTL and the store holds the LIST: a lookup of a name not
    there, and a create, answer from this node's view while the listing runs (before,
    each waited for it, up to ``stale_wait``, once per TTL)."""
    async def main() -> None:
        store = MemoryStore()
        config = Config(durability="async", stale_wait=60.0)
        async with open_core(tmp_path, store, config) as fs:
            d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
            assert fs.ns.get(d.ino).published           # made in the store, listed
            handle, _ = await fs.create(d.ino, b"a", 0o644, WRITE_NEW, 0, 0, me())
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
            fs.ns.get(d.ino).listed_at = time.time() - 3600
            gate = store.gate("list")
            with trio.fail_after(30):      # a guard against a hang, not a timing assert
                with pytest.raises(FsError) as info:
                    await fs.lookup(d.ino, b"b")
                assert info.value.errno == errno.ENOENT
                handle, _ = await fs.create(d.ino, b"b", 0o644, WRITE_NEW, 0, 0, me())
                await fs.flush(handle.fh)
                await fs.release(handle.fh)
            # The listing did start, in the background: other nodes' names still come.
            assert await trio.to_thread.run_sync(gate.wait_reached, 30)
            gate.release()
            assert (await fs.lookup(d.ino, b"b")).name == b"b"

    trio.run(main)
