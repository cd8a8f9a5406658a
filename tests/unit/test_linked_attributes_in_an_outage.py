"""Async mode: a chmod, utime or setxattr of a hard-linked file succeeds at once, from
the node's metadata, while the store is away, and reaches the store after it (the
model's promise for async mode: during an outage every step succeeds on its node;
the README lists what goes to the store at once -- a hard link, the rename or unlink of
a linked name, ``RENAME_EXCHANGE`` -- and attributes are not on that list).

Found by soak seed 1215578 (async, local store, a 503 outage): ``utime`` of a linked
file answered EIO, because a linked file's attributes were written to its shared
object at once instead of by a metadata-log record."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import reached, two_cores

pytestmark = pytest.mark.trio

MTIME = 1_700_000_000_000_000_001


@pytest.mark.parametrize("what", ["chmod", "utime", "setxattr"])
async def test_attributes_of_a_linked_file_succeed_in_an_outage_and_land_after(
        tmp_path: Path, what: str):
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=0.0,
                    store_timeout=2.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        ino = await a.save(ROOT_INO, b"f", b"weights")
        await a.fs.link(ino, ROOT_INO, b"g")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        outage = store.fail("*", TransientStoreError("503 Slow Down (injected)"),
                            times=1_000_000)
        with trio.fail_after(10):
            if what == "chmod":
                await a.fs.setattr(ino, mode=0o600)
            elif what == "utime":
                await a.fs.setattr(ino, mtime_ns=MTIME)
            else:
                await a.fs.setxattr(ino, b"user.step", b"7")
        store._remove(outage)
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for name in ("f", "g"):
            attrs = b.fs.getattr(await b.resolve(name))
            if what == "chmod":
                assert attrs.mode & 0o7777 == 0o600, name
            elif what == "utime":
                assert attrs.mtime_ns == MTIME, name
            else:
                assert b.fs.getxattr(attrs.ino, b"user.step") == b"7", name


async def test_a_listing_of_another_names_directory_keeps_a_change_not_landed(
        tmp_path: Path):
    """The record of a linked file's chown waits for the store; meanwhile a listing of
    the directory of the file's *other* name fetches its shared object, which has the
    owner before.  The chown stays (the lone-node rename test's flake: a name in the
    other directory showed the old owner after a lookup listed that directory)."""
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, _):
        one = (await a.fs.mkdir(ROOT_INO, b"one", 0o755, 0, 0)).ino
        two = (await a.fs.mkdir(ROOT_INO, b"two", 0o755, 0, 0)).ino
        ino = await a.save(one, b"x", b"weights")
        await a.fs.link(ino, two, b"y")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await a.save(ROOT_INO, b"other", b"o")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        # An earlier record of the log waits for the store: the chown's waits behind it.
        earlier = store.gate("get", prefix="dirs/root/other")
        await a.fs.unlink(ROOT_INO, b"other")
        await reached(earlier)
        await a.fs.setattr(ino, uid=1234)
        await a.fs.refresh_dir(two, force=True)
        assert a.fs.getattr(ino).uid == 1234, \
            "a listing took the shared object's owner from before the chown"
        earlier.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await a.fs.refresh_dir(two, force=True)
        assert a.fs.getattr(ino).uid == 1234


@pytest.mark.parametrize("what", ["utime", "chmod"])
async def test_a_change_that_lands_after_another_node_linked_the_name_goes_to_the_linked_file(
        tmp_path: Path, what: str):
    """A's utime of ``f`` is journaled; before its record lands, B hard-links ``f`` as
    ``g`` (the name's entry becomes a link to a shared object).  The record found a link
    where it expected A's plain entry, took it for a rename by another node, and dropped
    the change (soak seed 1215629: "A utime f0 || B link f0 f1", the utime lost on every
    node).  The change is the linked file's: both names show it everywhere."""
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        ino = await a.save(ROOT_INO, b"f", b"weights")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        landing = store.gate("put", prefix="dirs/root/f")
        if what == "utime":
            await a.fs.setattr(ino, mtime_ns=MTIME)
        else:
            await a.fs.setattr(ino, mode=0o600)
        await reached(landing)
        await b.fs.link(await b.resolve("f"), ROOT_INO, b"g")
        landing.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
            await b.fs.wait_idle()
        for node in (a, b):
            await node.fs.refresh_dir(ROOT_INO, force=True)
            for name in ("f", "g"):
                attrs = node.fs.getattr(await node.resolve(name))
                if what == "utime":
                    assert attrs.mtime_ns == MTIME, f"{name}: the utime was lost"
                else:
                    assert attrs.mode & 0o7777 == 0o600, f"{name}: the chmod was lost"
                assert await node.load(attrs.ino) == b"weights"
