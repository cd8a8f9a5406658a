"""Races across await points in the core, driven directly over the in-memory store:
a test holds one store call inside its window with a *gate* (``MemoryStore.gate``) and
waits for the call to arrive there, so it always enters the window it names (never a
sleep that may miss it on a slow machine).  Found by review; each test failed before its
fix."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.procstat import Opener
from ckptfs.format.remote import Entry, chunk_key, entry_key
from ckptfs.store import MemoryStore
from support.core import me, reached

CS = 64 << 10
pytestmark = pytest.mark.trio


def stored(store: MemoryStore, parent_dir_id: str, name: bytes) -> bytes:
    body, _ = store.get(entry_key(parent_dir_id, name))
    entry = Entry.from_json(body)
    return b"".join(store.get(chunk_key(sha))[0] for sha, _ in entry.chunks)


async def write_file(fs, ino, data, trunc=True):
    h = await fs.open(ino, os.O_WRONLY | (os.O_TRUNC if trunc else 0), me())
    await fs.write(h.fh, 0, data)
    await fs.flush(h.fh)
    await fs.release(h.fh)


@pytest.mark.parametrize("core_config", [{"durability": "async", "chunk_size": CS, "upload_concurrency": 4}])
async def test_rewrite_during_background_publish_ends_with_the_new_version(core):
    fs, store = core.fs, core.store
    gate = store.gate("put", prefix="chunks/")     # V1's first chunk upload waits
    h, inode = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
    await fs.write(h.fh, 0, b"A" * (3 * CS + 100))
    await fs.flush(h.fh)
    await fs.release(h.fh)
    await reached(gate)                            # V1's upload is in flight
    r = await fs.open(inode.ino, os.O_RDONLY, me())   # a reader comes and goes
    await fs.release(r.fh)
    await write_file(fs, inode.ino, b"B" * (3 * CS + 100))
    gate.release()
    await fs.wait_idle()
    final = fs.ns.get(inode.ino)
    assert not final.dirty and not fs.queue.queued and fs.ns.journal() == [] \
        and fs.ns.publish_pending() == {}
    assert stored(store, "root", b"f") == b"B" * (3 * CS + 100)


@pytest.mark.parametrize("core_config", [{"chunk_size": CS}])
async def test_refresh_during_rename_keeps_the_renamed_file_and_tree(core):
    fs, store = core.fs, core.store
    h, inode = await fs.create(ROOT_INO, b"a", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
    await fs.write(h.fh, 0, b"hello")
    await fs.flush(h.fh)
    await fs.release(h.fh)
    d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    h, child = await fs.create(d.ino, b"x", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
    await fs.write(h.fh, 0, b"child")
    await fs.flush(h.fh)
    await fs.release(h.fh)
    # Both renames stop before deleting their old keys: the store lists both names.
    gate = store.gate("delete", prefix="dirs/root/", times=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.rename, ROOT_INO, b"a", ROOT_INO, b"b", 0)
        nursery.start_soon(fs.rename, ROOT_INO, b"d", ROOT_INO, b"e", 0)
        await reached(gate, 2)
        await fs.refresh_dir(ROOT_INO, force=True)
        gate.release()
    b = await fs.lookup(ROOT_INO, b"b")
    r = await fs.open(b.ino, os.O_RDONLY, me())
    assert await fs.read(r.fh, 0, 10) == b"hello"
    await fs.release(r.fh)
    e = await fs.lookup(ROOT_INO, b"e")
    x = await fs.lookup(e.ino, b"x")
    r = await fs.open(x.ino, os.O_RDONLY, me())
    assert await fs.read(r.fh, 0, 10) == b"child"
    await fs.release(r.fh)


@pytest.mark.parametrize("core_config", [{"durability": "async", "chunk_size": CS}])
async def test_unlink_during_entry_put_does_not_resurrect(core):
    fs, store = core.fs, core.store
    gate = store.gate("put_if_absent", prefix="dirs/root/tmpfile")
    h, inode = await fs.create(ROOT_INO, b"tmpfile", 0o644, os.O_WRONLY | os.O_CREAT, 0,
                               0, me())
    await fs.write(h.fh, 0, b"scratch")
    await fs.flush(h.fh)
    await fs.release(h.fh)
    await reached(gate)                        # the entry PUT is in flight
    lock = fs.runtime[inode.ino].lock          # held by that publish
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fs.unlink, ROOT_INO, b"tmpfile")
        with trio.fail_after(30):
            while not lock.statistics().tasks_waiting:
                await trio.sleep(0.01)         # the unlink waits for the PUT...
        gate.release()                         # ...which lands first
    await fs.wait_idle()
    assert [o.key for o in store.list("dirs/")] == []
    await fs.refresh_dir(ROOT_INO, force=True)
    assert fs.ns.lookup(ROOT_INO, b"tmpfile") is None


@pytest.mark.parametrize("core_config", [{"durability": "async", "chunk_size": CS}])
async def test_killed_process_that_never_wrote_does_not_abandon_a_closed_version(core):
    fs, store = core.fs, core.store
    h, inode = await fs.create(ROOT_INO, b"ckpt", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                               me())
    await fs.write(h.fh, 0, b"V0")
    await fs.flush(h.fh)
    await fs.release(h.fh)
    await fs.queue.wait_idle()
    await write_file(fs, inode.ino, b"V1-closed-cleanly")
    other = await fs.open(inode.ino, os.O_RDWR, me())   # opened, never written
    fs.died_unclean = lambda opener: True    # injected: the opener "was killed"
    await fs.flush(other.fh)
    await fs.release(other.fh)
    await fs.queue.wait_idle()
    assert stored(store, "root", b"ckpt") == b"V1-closed-cleanly"
