"""rename(2) between two hard links of one file does nothing (POSIX).  Soak seed 1215503
(async): A linked ``f0`` as ``f2`` while B saved a new ``f2`` -- B's save went through
the link (the name was taken by then), and B ended with two inodes for the one linked
file, so the kernel sent B's ``rename f0 f2`` to the daemon, which moved ``f0`` over
``f2``: the name ``f0`` was gone on every node.  The daemon now does nothing when both
names hold the same linked file, as the kernel does for one inode.

The first test is the race's outcome as it usually lands (one inode); the second sets
up the state the soak left on B (two inodes with one link id: how B came to hold it is
not found yet) and checks the rename alone."""

from __future__ import annotations

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import two_cores


def run(tmp_path, durability: str, body) -> None:
    """``body(a, b)`` on two nodes over one store (B keeps its view for 30 s)."""
    async def main() -> None:
        config = Config(metadata_ttl=30.0, durability=durability)
        async with two_cores(tmp_path, MemoryStore(), config) as (a, b):
            await body(a, b)
    trio.run(main)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_renaming_a_linked_name_over_another_name_of_it_keeps_both(tmp_path, durability):
    async def body(a, b) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.wait_idle()
        assert await b.names() == ["f0"]            # B lists it (then keeps its view)
        await a.fs.link(ino_a, ROOT_INO, b"f2")
        await a.fs.wait_idle()
        await b.save(ROOT_INO, b"f2", b"version two, from B")  # B: a new f2
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        f0, f2 = await b.resolve("f0"), await b.resolve("f2")
        assert b.fs.getattr(f0).nlink == b.fs.getattr(f2).nlink == 2
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
        await b.fs.wait_idle()
        assert await b.names() == ["f0", "f2"]
        await a.fs.refresh_dir(ROOT_INO, force=True)
        assert await a.names() == ["f0", "f2"]
        assert await a.load(await a.resolve("f0")) == \
            await a.load(await a.resolve("f2"))
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_rename_between_two_inodes_of_one_linked_file_does_nothing(tmp_path, durability):
    async def body(a, b) -> None:
        ino = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.link(ino, ROOT_INO, b"f2")
        await a.fs.wait_idle()
        f0, f2 = await b.resolve("f0"), await b.resolve("f2")
        assert f0 == f2
        # The soak's state: the name f2 on an inode of its own, same link id.
        ns, inode = b.fs.st.ns, b.fs.st.ns.get(f0)
        with ns.batch():
            ns.unlink(inode, ROOT_INO, b"f2")
            twin = ns.new_inode(ROOT_INO, b"f2", "file", inode.mode, 0, 0,
                                size=inode.size, chunks=list(inode.chunks),
                                published=True, remote_etag=inode.remote_etag,
                                save_id=inode.save_id, link_id=inode.link_id,
                                remote_nlink=inode.remote_nlink)
        assert twin.ino != f0 and twin.link_id == b.fs.st.ns.get(f0).link_id
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
        await b.fs.wait_idle()
        assert sorted(n.decode() for n, _ in b.fs.st.ns.children(ROOT_INO)) == \
            ["f0", "f2"], "rename(2) between two names of one file moved one"
    run(tmp_path, durability, body)
