"""A save through a link another node just made (``Publish._save_through_link``) takes
the names of the inode that held the linked file here (``take_names_of``), so that the
node holds the linked file on one inode.

Soak seed 1215503 (async, both stores, stop 46) ended in a rename between two names of
one hard-linked file that removed one of them: B creates ``f2`` and writes it; A makes
``f2`` a hard link of ``f0``; B's listing takes ``f0`` as the linked file (its inode
for ``f0``); B's close then saves through the link on its inode for ``f2``, and that
inode became the linked file's too.  A review (stop 50) found two ways the fix of
then still left the node wrong:

- **No fault at all.**  ``take_names_of`` unlinks the holder's names and gives back
  each one ``if st.ns.lookup(parent, name) is None`` -- inside ``st.ns.batch()``.
  ``Namespace.lookup`` read through a read transaction of its own, which did not see
  the batch's unlink, so it still found the holder there and never gave the name back:
  the node lost the name until its next listing (an exclusive create of it then
  succeeded, and its publish saved through the link over the linked file).  Reads
  inside a batch now see its writes (``Transactions._read``).  The stop-46 test
  (``..._leaves_one_inode_for_the_linked_file[answered]``) runs with
  ``metadata_ttl=0`` and lists before it looks: the listing put the name back and hid
  it.
- **A lost reply, or a kill, in the object PUT.**  The link id was set before the PUT
  and the names taken after it; a retry (the publish queue, the restart's recovery)
  publishes a linked file and never comes back to take them: the node held the linked
  file on two inodes, and a change through one name did not show under the other.
  The names are now taken in the step that sets the link id, before the PUT."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config, Handle
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from ckptfs.store.base import StoreTimeout
from support.core import WRITE_NEW, Core, die_during, open_core, two_cores

pytestmark = pytest.mark.trio

FIRST = b"the first file " * 10
SAVE = b"B's save of f2 " * 10


@asynccontextmanager
async def nodes(tmp_path: Path, durability: str, ttl: float = 3600.0
                ) -> AsyncIterator[tuple[MemoryStore, Core, Core]]:
    """(the store, node A, node B); a long metadata TTL: no listing unasked."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=ttl)
    async with two_cores(tmp_path, store, config) as (a, b):
        yield store, a, b


async def a_save_beside_a_new_link(a: Core, b: Core) -> Handle:
    """A saves ``f0``; B starts a new file ``f2``; A links ``f0`` as ``f2``; B lists
    and holds the linked file on its inode for ``f0``.  B's writer of ``f2``, whose
    close saves through the link."""
    f0 = await a.save(ROOT_INO, b"f0", FIRST)
    with trio.fail_after(30):
        await a.fs.wait_idle()
    assert await b.names() == ["f0"]
    handle, _ = await b.fs.create(ROOT_INO, b"f2", 0o644, WRITE_NEW, 0, 0, b.me())
    await b.fs.write(handle.fh, 0, SAVE)
    await a.fs.link(f0, ROOT_INO, b"f2")
    with trio.fail_after(30):
        await a.fs.wait_idle()
    await b.fs.refresh_dir(ROOT_INO, force=True)    # B: f0 is the linked file
    assert await b.names() == ["f0", "f2"]
    return handle


async def close(core: Core, handle: Handle) -> None:
    try:
        await core.fs.flush(handle.fh)
    except FsError:
        pass                              # (sync: the close saw the store's failure)
    await core.fs.release(handle.fh)
    with trio.fail_after(60):
        await core.fs.wait_idle()


def lose_the_first_answer(store: MemoryStore) -> list[str]:
    """The next inode object PUT lands and its answer is lost: [its key] once it has."""
    lost: list[str] = []

    def lose_answer(call) -> None:
        if call.error is None and not lost:
            lost.append(call.key)
            raise StoreTimeout("answer lost after the store acted")
    store.after(lose_answer, "put", prefix="inodes/", times=1)
    return lost


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_save_through_a_link_keeps_the_other_name_on_its_node(
        tmp_path: Path, durability: str):
    async with nodes(tmp_path, durability) as (_, a, b):
        await close(b, await a_save_beside_a_new_link(a, b))
        # Nobody removed f0; B's own save through f2 made it vanish on B.
        assert await b.names() == ["f0", "f2"], "B lost the name f0 of the linked file"
        one, two = await b.resolve("f0"), await b.resolve("f2")
        assert one == two
        assert await b.load(one) == SAVE


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_an_exclusive_create_of_the_other_name_is_refused(
        tmp_path: Path, durability: str):
    """The kernel's ``open(f0, O_CREAT|O_EXCL)`` after a lookup must meet EEXIST
    (nobody removed ``f0``).  With the name lost, the create went on, and its publish
    met the link entry under ``f0`` and saved through it: the linked file's bytes
    (``f2`` on every node) were replaced by a file its writer created as new."""
    async with nodes(tmp_path, durability) as (_, a, b):
        await close(b, await a_save_beside_a_new_link(a, b))
        created = None
        try:
            await b.fs.lookup(ROOT_INO, b"f0")
        except FsError as exc:
            assert exc.errno == errno.ENOENT
            try:        # what the kernel does for O_CREAT|O_EXCL after that ENOENT
                created = await b.save(ROOT_INO, b"f0", b"a brand-new exclusive file")
            except FsError as exc2:
                assert exc2.errno == errno.EEXIST
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)
        got = await a.load(await a.resolve("f2"))
        assert created is None and got == SAVE, \
            f"an exclusive create of f0 succeeded on B (inode {created}) and A's f2 " \
            f"now reads {got!r}"


@pytest.mark.parametrize("lose", [False, True], ids=["answered", "reply lost"])
@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_save_through_a_link_leaves_one_inode_for_the_linked_file(
        tmp_path: Path, durability: str, lose: bool):
    async with nodes(tmp_path, durability, ttl=0.0) as (store, a, b):
        handle = await a_save_beside_a_new_link(a, b)
        lost = lose_the_first_answer(store) if lose else ["(none)"]
        await close(b, handle)
        assert lost, "the save through the link made no object PUT"
        for node in (a, b):
            await node.fs.refresh_dir(ROOT_INO, force=True)
            assert await node.names() == ["f0", "f2"]
            one, two = await node.resolve("f0"), await node.resolve("f2")
            assert await node.load(one) == SAVE
            assert await node.load(two) == SAVE
            assert one == two, f"{'a' if node is a else 'b'} holds the file on two inodes"
            assert node.fs.getattr(one).nlink == 2


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_after_a_lost_reply_a_change_through_one_name_shows_under_the_other(
        tmp_path: Path, durability: str):
    """As B's user sees it (no listing in between: a long metadata TTL): after the
    save through the link (reply lost, tried again), B chmods ``f0`` and saves again
    through it, then stats and reads ``f2``: one file, so the new mode and bytes."""
    async with nodes(tmp_path, durability) as (store, a, b):
        handle = await a_save_beside_a_new_link(a, b)
        lost = lose_the_first_answer(store)
        await close(b, handle)
        assert lost
        await b.fs.setattr(await b.resolve("f0"), mode=0o600)
        again = b"B's second save, through f0 " * 7
        h = await b.open_by_name("f0", os.O_WRONLY | os.O_TRUNC)
        await b.fs.write(h.fh, 0, again)
        await close(b, h)
        seen = {}
        for name in ("f0", "f2"):
            ino = await b.resolve(name)
            attrs = b.fs.getattr(ino)
            seen[name] = ((await b.load(ino))[:28], oct(attrs.mode & 0o7777), attrs.nlink)
        want = (again[:28], oct(0o600), 2)
        assert seen == {"f0": want, "f2": want}, seen


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_save_through_a_link_killed_before_its_put_leaves_one_inode(
        tmp_path: Path, durability: str):
    """The daemon dies with the object PUT on its way; the restart publishes the
    closed version (recovery) as a linked file's."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=3600.0)
    async with open_core(tmp_path / "a", store, config) as a_fs:
        a = Core(a_fs, store)
        async with open_core(tmp_path / "b", store, config) as b_fs:
            b = Core(b_fs, store)
            handle = await a_save_beside_a_new_link(a, b)
            gate = store.gate("put", prefix="inodes/")     # the save's object PUT
            dead = await die_during(store, lambda: close(b, handle), [gate],
                                    tmp_path / "b", tmp_path / "killed")
        for hook in dead:
            hook.remove()
        async with open_core(tmp_path / "killed", store, config) as k_fs:
            k = Core(k_fs, store)
            with trio.fail_after(60):
                await k.fs.wait_idle()
            async with open_core(tmp_path / "fresh", store, config) as c_fs:
                c = Core(c_fs, store)        # what the store has: the save, both names
                for name in ("f0", "f2"):
                    assert await c.load(await c.resolve(name)) == SAVE, name
            seen = {}
            for name in ("f0", "f2"):
                ino = await k.resolve(name)
                seen[name] = (ino, (await k.load(ino))[:15])
            assert seen["f0"][1] == seen["f2"][1] == SAVE[:15], seen
            assert seen["f0"][0] == seen["f2"][0], \
                f"the restarted node holds the linked file on two inodes: {seen}"
