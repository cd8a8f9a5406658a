"""An attribute change through a reader's descriptor, after the name moved on.

A save on the node where a reader holds the version before moves the name to a fresh
inode (``Opening._fresh_inode_for_name``): the reader keeps its inode, its size and its
bytes.  The kernel sends ``fchmod``, ``fchown``, ``futimens`` and ``fsetxattr`` through
the reader's descriptor for that inode, with no handle, and never retries them: ESTALE
reached the program (``os.fchmod`` failed where a local disk succeeds), and a
``fsetxattr`` changed only the nameless inode, so the file under the name never got it
-- nor did the store.  The same steps by path through a dentry the kernel kept a moment
longer were lost the same way.  Now they go to the file the name moved to, and to the
reader's inode too."""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core
from test_save_beside_a_reader_on_its_node import OLD, save_over, step_by_name

pytestmark = pytest.mark.trio

CHANGES = {
    "chmod": (dict(mode=0o600), lambda inode: inode.mode == 0o600,
              lambda entry: entry["mode"] == 0o600),
    "chown": (dict(uid=1234, gid=4321), lambda inode: (inode.uid, inode.gid) == (1234, 4321),
              lambda entry: (entry["uid"], entry["gid"]) == (1234, 4321)),
    "utime": (dict(mtime_ns=2_000_000_000_123_456_789),
              lambda inode: inode.mtime_ns == 2_000_000_000_123_456_789,
              lambda entry: entry["mtime_ns"] == 2_000_000_000_123_456_789),
}


async def moved_beside_a_reader(core: Core, fs) -> tuple[int, int, object]:
    old = await core.save(ROOT_INO, b"f0", OLD)
    with trio.fail_after(30):
        await fs.wait_idle()
    reader = await fs.open(old, os.O_RDONLY, core.me())
    fresh = await step_by_name(core, lambda ino: save_over(core, ino))
    assert fresh != old
    return old, fresh, reader


@pytest.mark.parametrize("what", sorted(CHANGES))
@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_change_through_the_readers_descriptor_reaches_the_named_file(
        tmp_path, durability: str, what: str):
    store = MemoryStore()
    change, shown, stored = CHANGES[what]
    async with open_core(tmp_path / "a", store,
                         Config(durability=durability, upload_hold=0.0)) as fs:
        core = Core(fs, store)
        old, fresh, reader = await moved_beside_a_reader(core, fs)
        await fs.setattr(old, **change)             # fchmod(reader's fd): no handle
        assert shown(fs.getattr(fresh)), "the file under the name did not get it"
        assert shown(fs.getattr(old)), "the reader's fstat does not show it"
        assert await fs.read(reader.fh, 0, len(OLD)) == OLD
        await fs.release(reader.fh)
        with trio.fail_after(30):
            await fs.wait_idle()
        assert stored(json.loads(store.get("dirs/root/f0")[0]))


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_an_xattr_set_through_the_readers_descriptor_reaches_the_named_file(
        tmp_path, durability: str):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store,
                         Config(durability=durability, upload_hold=0.0)) as fs:
        core = Core(fs, store)
        old, fresh, reader = await moved_beside_a_reader(core, fs)
        await fs.setxattr(old, b"user.step", b"7")
        assert fs.getxattr(fresh, b"user.step") == b"7"
        assert fs.getxattr(old, b"user.step") == b"7"
        await fs.release(reader.fh)
        with trio.fail_after(30):
            await fs.wait_idle()
    async with open_core(tmp_path / "b", store, Config(durability=durability)) as fs:
        other = Core(fs, store)
        assert fs.getxattr(await other.resolve("f0"), b"user.step") == b"7"
