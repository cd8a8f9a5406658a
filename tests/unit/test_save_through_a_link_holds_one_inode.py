"""A save that finds its name made a hard link meanwhile writes the linked file
(``Publish._save_through_link``), and this node then holds that file on one inode,
whatever name it knew it by first.

Soak seed 1215503 (async, both stores) ended in a rename between two names of one
hard-linked file that removed one of them; 8b48fdb made such a rename do nothing, but
how the node came to hold the one linked file on two inodes was not found.  This is
how: B creates ``f2`` and writes it; A makes ``f2`` a hard link of ``f0``; B's listing
takes ``f0`` as the linked file (its inode for ``f0``); B's close then saves through
the link on its inode for ``f2``, and that inode became the linked file's too."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, two_cores

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_save_through_a_link_leaves_one_inode_for_the_linked_file(
        tmp_path: Path, durability: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        f0 = await a.save(ROOT_INO, b"f0", b"the first file " * 10)
        await a.fs.wait_idle()
        assert await b.names() == ["f0"]
        handle, _ = await b.fs.create(ROOT_INO, b"f2", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.write(handle.fh, 0, b"B's save of f2 " * 10)
        await a.fs.link(f0, ROOT_INO, b"f2")
        await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        await b.fs.flush(handle.fh)
        await b.fs.release(handle.fh)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        for node in (a, b):
            await node.fs.refresh_dir(ROOT_INO, force=True)
            assert await node.names() == ["f0", "f2"]
            one, two = await node.resolve("f0"), await node.resolve("f2")
            assert one == two, "the node holds the linked file on two inodes"
            assert node.fs.getattr(one).nlink == 2
            assert await node.load(one) == b"B's save of f2 " * 10
