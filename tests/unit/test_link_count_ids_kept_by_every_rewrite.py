"""Found by a review: a link count-out's id must survive every rewrite of the shared
object until the count-out's retry (decision 0008, stop 49).  A node that learned the
object from a listing (``EntryIO.adopt``, ``Refresh._take_entry``), or a fresh inode
made beside a reader (``Opening._fresh_inode_for_name``), took its ETag but not its
``counted``: its next rewrite (a chmod, a save) was a compare-and-swap on that ETag,
which succeeded and wrote ``counted: []``.  The count-out whose reply was lost was then
made again: the link was counted out twice, and the object went with the next unlink
while another name still linked it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import Entry, inode_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from ckptfs.store.base import StoreTimeout
from support.core import Core, open_core
from test_link_count_after_a_lost_reply import a_late_rename_over_a_link

pytestmark = pytest.mark.trio


class HeldGets:
    """Node A's view of the store: its GETs of inode objects wait while ``hold`` is
    set (the count-out record's retry waits until the third node has acted)."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.hold: threading.Event | None = None

    def get(self, key, *args, **kwargs):
        hold = self.hold
        if hold is not None and key.startswith("inodes/"):
            hold.wait(30)
        return self._inner.get(key, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def object_of(store: MemoryStore, link_id: str) -> Entry | None:
    try:
        body, _ = store.get(inode_key(link_id))
    except NotFound:
        return None
    return Entry.from_json(body, 1 << 30)


async def test_a_listing_nodes_rewrite_keeps_the_count_out_ids(tmp_path: Path):
    store = MemoryStore()
    a_view = HeldGets(store)
    config = Config(durability="async", metadata_ttl=3600.0, upload_hold=0.0)
    async with open_core(tmp_path / "a", a_view, config) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        link_id, claim = await a_late_rename_over_a_link(a, b, store)

        lost = []
        held = threading.Event()

        def lose_answer(call) -> None:        # A's count-out lands, its answer is lost
            if call.error is None and not lost:
                lost.append(call.key)
                a_view.hold = held              # its retry waits (below)
                raise StoreTimeout("answer lost after the store acted")
        store.after(lose_answer, "put", prefix="inodes/", times=1)
        claim.release()
        with trio.fail_after(30):
            while not lost:
                await trio.sleep(0.01)
        counted_ids = object_of(store, link_id).counted
        assert counted_ids, "the count-out left no id in the object"

        # A third node lists the directory and chmods the linked file.
        async with open_core(tmp_path / "c", store,
                             Config(durability="sync", metadata_ttl=3600.0)) as c_fs:
            c = Core(c_fs, store)
            await c.fs.refresh_dir(ROOT_INO, force=True)
            await c.fs.setattr(await c.resolve("lnk2"), mode=0o600)
        after_chmod = object_of(store, link_id)
        a_view.hold = None
        held.set()
        with trio.fail_after(60):
            await a.fs.wait_idle()
            await b.fs.wait_idle()
        obj = object_of(store, link_id)
        await b.fs.unlink(ROOT_INO, b"f1")
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert object_of(store, link_id) is not None, \
            f"the shared object went while lnk2 still links it (count after the " \
            f"count-out's retry: {obj.nlink}, want 2; ids after the chmod: " \
            f"{after_chmod.counted}, before it: {counted_ids})"


async def test_a_save_that_moved_a_linked_name_beside_a_reader_keeps_the_ids(tmp_path):
    """The same loss through ``Opening._fresh_inode_for_name``: the fresh inode of a
    linked file gets the object's ETag but not its ``link_counted``; the save's
    rewrite of the object (a compare-and-swap that succeeds) writes ``counted: []``."""
    import os
    from test_save_beside_a_reader_on_its_node import NEW, OLD, save_over, step_by_name
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="sync")) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT_INO, b"f0", OLD)
        await fs.link(ino, ROOT_INO, b"f1")
        await fs.link(ino, ROOT_INO, b"f2")
        await fs.unlink(ROOT_INO, b"f2")              # a count-out: its id is kept
        link_id = fs.getattr(ino).link_id
        ids = object_of(store, link_id).counted
        assert ids
        reader = await fs.open(ino, os.O_RDONLY, core.me())
        acted = await step_by_name(core, lambda i: save_over(core, i))
        assert acted != ino                           # the name moved beside the reader
        obj = object_of(store, link_id)
        assert obj.chunks and obj.size == len(NEW)
        await fs.release(reader.fh)
        assert set(ids) <= set(obj.counted), \
            f"the save's rewrite dropped the object's count-out ids: {obj.counted}"
