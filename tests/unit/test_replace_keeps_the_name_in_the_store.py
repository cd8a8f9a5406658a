"""``os.replace(tmp, name)`` in async mode never takes ``name`` out of the store.

The pattern every checkpoint writer uses (``torch.save`` to a temporary name, then
rename over the last one): the temporary file is closed, its publish queued, and the
rename's log record runs before that publish lands.  The record found no entry of the
temporary file to move and deleted the replaced entry, and the file's own publish wrote
the name again only later.  In between the name was in no listing: another node
answered ENOENT for a name that never stopped existing (hostile run D: up to 9.19 s on
end with a replace every 20 ms).  DESIGN.md promise 2 says a name changes in the store
only when a closed version lands there; so the replaced entry is held, as for a file
renamed before its first close (``core/held.py``), until the new version lands over it.
"""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX, Entry, entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, reached, two_cores

pytestmark = pytest.mark.trio

OLD, NEW = b"the last checkpoint " * 50, b"the next checkpoint, longer " * 60
KEY = entry_key("root", b"t")


async def _name_stays_while_the_log_runs(store: MemoryStore, key: str) -> None:
    """The store keeps ``key`` for a while the metadata log has to act (the replaced
    entry's deletion came at once before)."""
    for _ in range(100):
        assert store.exists(key), f"{key} left the store before its new version landed"
        await trio.sleep(0.01)


@asynccontextmanager
async def _replaced(tmp_path: Path, kind: str = "file"
                    ) -> AsyncIterator[tuple[Core, Core, MemoryStore, Any, int]]:
    """Two async nodes; A makes ``t`` (a saved file, or ``kind``: a fifo, a symlink, a
    file's second hard link), published; then saves ``tmp`` with its upload held, and
    renames ``tmp`` over ``t``; the store keeps ``t`` while A's log runs (but a hard
    link's name).  Yields both nodes, the store, the held upload's gate and the new
    inode."""
    store = MemoryStore(gate_limit=30)
    async with two_cores(tmp_path, store, Config(durability="async", upload_hold=0.0,
                                                 metadata_ttl=0.0)) as (a, b):
        await _make_target(a, kind)
        await a.fs.wait_idle()
        uploading = store.gate("put", prefix=CHUNKS_PREFIX)
        ino = await a.save(ROOT_INO, b"tmp", NEW)           # async: closed, publish queued
        await reached(uploading)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"t", 0)
        if kind != "hard link":     # (a link's name goes first, as before)
            await _name_stays_while_the_log_runs(store, KEY)
        yield a, b, store, uploading, ino


async def _make_target(a: Core, kind: str) -> None:
    if kind == "file":
        await a.save(ROOT_INO, b"t", OLD)
    elif kind == "fifo":
        await a.fs.mknod(ROOT_INO, b"t", stat.S_IFIFO | 0o644, 0, 0, 0)
    elif kind == "symlink":
        await a.fs.symlink(ROOT_INO, b"t", b"somewhere", 0, 0)
    else:
        ino = await a.save(ROOT_INO, b"first", OLD)
        await a.fs.wait_idle()
        await a.fs.link(ino, ROOT_INO, b"t")


async def test_a_replaced_name_stays_in_the_store_until_the_new_version_lands(
        tmp_path: Path):
    async with _replaced(tmp_path) as (a, b, store, uploading, ino):
        assert Entry.from_json(store.get(KEY)[0]).size == len(OLD)
        assert await b.names() == ["t"], "the other node lost the name meanwhile"
        assert await b.load(await b.resolve("t")) == OLD
        assert await a.load(ino) == NEW                  # this node: the new one at once
        uploading.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        assert Entry.from_json(store.get(KEY)[0]).size == len(NEW)
        assert not store.exists(entry_key("root", b"tmp"))
        assert await b.names() == ["t"]
        assert await b.load(await b.resolve("t")) == NEW


@pytest.mark.parametrize("then", ["renamed away", "unlinked"])
async def test_the_held_name_goes_with_the_file_moved_on_before_it_landed(
        tmp_path: Path, then: str):
    """Moved on (or removed) before its version landed, the file takes the held entry
    with it: the name this node removed does not come back with the old version."""
    async with _replaced(tmp_path) as (a, b, store, uploading, ino):
        if then == "unlinked":
            await a.fs.unlink(ROOT_INO, b"t")
        else:
            await a.fs.rename(ROOT_INO, b"t", ROOT_INO, b"u", 0)
        uploading.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        assert not store.exists(KEY), "the name removed here came back with the old version"
        want = [] if then == "unlinked" else ["u"]
        assert await a.names() == want
        assert await b.names() == want
        if then == "renamed away":
            assert await b.load(await b.resolve("u")) == NEW


@pytest.mark.parametrize("kind", ["fifo", "symlink", "hard link"])
async def test_a_replaced_name_of_another_kind_becomes_the_new_file(tmp_path: Path,
                                                                     kind: str):
    """The replaced name held something else than a plain file: the new version lands
    over it as well (the held entry is this rename's, no other node's: no conflict
    name), and a hard link's other name keeps the old version."""
    async with _replaced(tmp_path, kind) as (a, b, store, uploading, ino):
        uploading.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        want = ["first", "t"] if kind == "hard link" else ["t"]
        for node in (a, b):
            assert await node.names() == want
            t = await node.resolve("t")
            assert node.fs.getattr(t).type == "file"
            assert await node.load(t) == NEW
        if kind == "hard link":
            for node in (a, b):
                first = await node.resolve("first")
                assert await node.load(first) == OLD, "the other name took the new version"
                assert node.fs.getattr(first).nlink == 1
