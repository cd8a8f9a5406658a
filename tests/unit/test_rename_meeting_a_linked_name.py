"""A rename that meets a hard-linked name another node put there meanwhile.

Soak seed 1215583 (async, both stores): A renames ``d0/f0 -> d0/d1/f0`` (journaled,
acknowledged) while B renames ``d0/f2`` -- one name of a hard-linked file -- to the same
``d0/d1/f0`` (a linked name's rename goes to the store at once).  When A's record ran it
found B's link entry there and kept A's file as ``f0.ckptfs-conflict-<node>``: both,
which no serial order gives.  The order to take is "B's rename, then A's": the name
holds A's file, and the link it replaced is counted out of its shared object -- by the
node whose write replaced the link entry, and by no other.

The other half: a node unlinking a linked name counted the link out of its object
whatever it then deleted.  Where another node's rename had replaced that name already
(and counted the link out itself), the object was counted out twice and went while
another name still linked it: that name then answered EIO ("names a missing inode
object").  An unlink removes the link it knows, or leaves what another node put there
(as a late removal leaves another node's newer save, stop 41).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import Entry, inode_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from support.core import Core, reached, two_cores

pytestmark = pytest.mark.trio

A_DATA = b"A's renamed file " * 300
LINKED = b"the hard-linked file's bytes " * 100


@asynccontextmanager
async def nodes(tmp_path: Path, durability: str
                ) -> AsyncIterator[tuple[Core, Core, MemoryStore]]:
    store = MemoryStore()
    config = Config(durability=durability, metadata_ttl=3600.0, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        yield a, b, store


async def contents(node: Core) -> dict[str, bytes]:
    await node.fs.refresh_dir(ROOT_INO, force=True)
    return {name: await node.load(await node.resolve(name)) for name in await node.names()}


async def linked_nlink(store: MemoryStore, node: Core, name: str) -> int:
    """The link count the store's shared object has for ``name``'s file (0: the
    object is gone)."""
    link_id = node.fs.getattr(await node.resolve(name)).link_id
    assert link_id, f"{name} is no hard-linked file on this node"
    try:
        body, _ = store.get(inode_key(link_id))
    except NotFound:
        return 0
    return Entry.from_json(body, 1 << 30).nlink


async def linked_pair(a: Core, b: Core) -> None:
    """``f1`` and ``lnk``, two names of one file, and ``tmp``, a plain file; both nodes
    know all three."""
    ino = await a.save(ROOT_INO, b"f1", LINKED)
    await a.fs.link(ino, ROOT_INO, b"lnk")
    await a.save(ROOT_INO, b"tmp", A_DATA)
    with trio.fail_after(30):
        await a.fs.wait_idle()
    await b.fs.refresh_dir(ROOT_INO, force=True)


@pytest.mark.parametrize("then", ["nothing", "unlink f1"])
async def test_a_late_rename_replaces_a_linked_name_another_node_put_there(
        tmp_path: Path, then: str):
    """A's ``tmp -> dst`` is made first and lands after B's ``lnk -> dst``: the name
    holds A's file, ``f1`` its linked bytes with a link count of one; removing ``f1``
    then removes the file (its object goes, nothing else)."""
    async with nodes(tmp_path, "async") as (a, b, store):
        await linked_pair(a, b)
        claim = store.gate("put", prefix="dirs/root/tmp")
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        await reached(claim)
        await b.fs.rename(ROOT_INO, b"lnk", ROOT_INO, b"dst", 0)
        claim.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
            await b.fs.wait_idle()
        for label, node in (("A", a), ("B", b)):
            assert await contents(node) == {"dst": A_DATA, "f1": LINKED}, \
                f"{label}: not the serial order 'B renames lnk to dst, then A renames tmp there'"
        assert await linked_nlink(store, b, "f1") == 1, \
            "the link A's rename replaced was not counted out of the shared object"
        if then == "unlink f1":
            await b.fs.unlink(ROOT_INO, b"f1")
            with trio.fail_after(30):
                await b.fs.wait_idle()
            for node in (a, b):
                assert await contents(node) == {"dst": A_DATA}
            assert not [k for k in store.keys() if k.startswith("inodes/")], \
                "the shared object outlived its last name"


async def test_an_unlink_of_a_linked_name_another_node_replaced_counts_nothing_out(
        tmp_path: Path):
    """Sync: A renames ``tmp`` over ``lnk`` (counting that link out); B, which has not
    listed since, unlinks ``lnk``.  The object keeps its count of one for ``f1``, and
    ``f1`` reads on both nodes."""
    async with nodes(tmp_path, "sync") as (a, b, store):
        await linked_pair(a, b)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"lnk", 0)
        await b.fs.unlink(ROOT_INO, b"lnk")
        with trio.fail_after(30):
            await a.fs.wait_idle()
            await b.fs.wait_idle()
        assert await linked_nlink(store, a, "f1") == 1, \
            "the link was counted out twice: by the rename that replaced it and the unlink"
        for node in (a, b):
            assert await contents(node) == {"f1": LINKED, "lnk": A_DATA}, \
                "not the serial order 'B unlinks lnk, then A renames tmp there'"


async def test_a_rename_over_a_name_another_node_just_made_a_link_counts_it_out(
        tmp_path: Path):
    """Sync: B renames ``lnk`` over ``dst``; A, which has not listed since and knows
    ``dst`` as a plain file, renames ``tmp`` over it.  A's write replaced the link: A
    counts it out, so that removing ``f1`` afterwards removes the file's object (before:
    the count stayed one too high, and the object outlived every name)."""
    async with nodes(tmp_path, "sync") as (a, b, store):
        await linked_pair(a, b)
        await a.save(ROOT_INO, b"dst", b"the version both nodes know")
        await b.fs.refresh_dir(ROOT_INO, force=True)
        await b.fs.rename(ROOT_INO, b"lnk", ROOT_INO, b"dst", 0)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        for node in (a, b):
            assert await contents(node) == {"dst": A_DATA, "f1": LINKED}
        assert await linked_nlink(store, a, "f1") == 1, \
            "the link A's rename replaced was not counted out"
        await a.fs.unlink(ROOT_INO, b"f1")
        assert not [k for k in store.keys() if k.startswith("inodes/")], \
            "the shared object outlived its last name"


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_rename_that_moved_a_link_it_did_not_know_learns_the_linked_file(
        tmp_path: Path, durability: str):
    """A hard-links ``f0`` as ``f1``; B, which has not listed since and knows ``f0`` as
    a plain file, renames it to ``f2``: the store's link entry moves (a rename moves
    whatever file entry it finds).  A then saves new bytes through ``f1``.  B's ``f2``
    must show them: it is the linked file (soak seed 1215586, once: B kept the bytes
    from before, as its inode took the moved link entry's ETag for its own plain
    entry's, and no listing read it again)."""
    async with nodes(tmp_path, durability) as (a, b, store):
        ino = await a.save(ROOT_INO, b"f0", b"the bytes before " * 10)
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        await a.fs.link(ino, ROOT_INO, b"f1")
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await a.save(ROOT_INO, b"f1", LINKED)
        with trio.fail_after(30):
            await a.fs.wait_idle()
        for label, node in (("A", a), ("B", b)):
            assert await contents(node) == {"f1": LINKED, "f2": LINKED}, \
                f"{label}: f2 is not the linked file"
