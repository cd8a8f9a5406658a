"""A rename over a hard-linked name that another node has just renamed away.

Found by the core model test once it drew hard links: node B renames ``f0`` (a name of a
linked file: its entry links to the shared inode object) to ``f2``; node A, whose view
is older, renames ``d0/f0`` over ``f0``.  A's rename counted ``f0`` out of the object it
thought it replaced -- but B's rename had moved that link entry to ``f2``, so nothing of
the object was replaced.  Its count fell to 0 and the object was deleted: ``f2`` named a
missing inode object ("link b'f2' names a missing inode object", EIO), the file lost.

Now a rename counts a name out of a linked file only when its store step replaced (or
deleted) that name's link entry."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.format.remote import INODES_PREFIX, Entry
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import two_cores

pytestmark = pytest.mark.trio

LINKED = b"the linked file's bytes " * 200
MOVED = b"the file renamed over the name " * 100


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("names", [1, 2], ids=["one name left", "two names"])
async def test_a_rename_over_a_link_another_node_moved_away_keeps_the_linked_file(
        tmp_path: Path, caplog, durability: str, names: int):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        d0 = (await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)).ino
        f0 = await a.save(ROOT_INO, b"f0", LINKED)
        await a.fs.link(f0, ROOT_INO, b"f1")
        if names == 1:
            await a.fs.unlink(ROOT_INO, b"f1")      # linked, with one name left
        await a.save(d0, b"f0", MOVED)
        await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)      # B first
        await b.fs.wait_idle()
        await a.fs.rename(d0, b"f0", ROOT_INO, b"f0", 0)   # A's view: f0 is the link
        await a.fs.wait_idle()
        for node in (a, b):
            await node.fs.refresh_dir(ROOT_INO, force=True)
            seen = {n: await node.load(await node.resolve(n)) for n in await node.names()
                    if n != "d0"}
            want = {"f0": MOVED, "f2": LINKED} | ({"f1": LINKED} if names == 2 else {})
            assert seen == want, (node is a, {k: v[:10] for k, v in seen.items()})
        objects = [k for k in store.keys() if k.startswith(INODES_PREFIX)]
        assert len(objects) == 1, objects
        counted = Entry.from_json(store.get(objects[0])[0]).nlink
        assert counted == names, "the inode object counts the names that link to it"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
