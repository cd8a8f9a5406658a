"""Sync durability: a chmod, chown or utime of a published file is its entry rewritten in
the store.  When that rewrite fails (the store away: EIO), the change happened or did
not -- never here only.  It was kept here: the node that got EIO went on showing the new
mode while the store, and so every other node, kept the old one, and nothing ever sent
it (the inode is not dirty, the store's ETag did not change, so no listing corrects it).
Found by the model test's attribute steps (tests/integration/test_model.py,
``file_attrs`` in a sync store fault)."""

from __future__ import annotations

import errno
import json

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import two_cores

CHANGES = [{"mode": 0o600}, {"mtime_ns": 1_000_000_000_123_456_789},
           {"uid": 1234, "gid": 4321}]
FIELD = {"mode": "mode", "mtime_ns": "mtime_ns", "uid": "uid", "gid": "gid"}


def run(tmp_path, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store, Config(metadata_ttl=0.05)) as (a, b):
            await body(a, b, store)
    trio.run(main)


def attrs(inode, change: dict) -> dict:
    return {k: getattr(inode, FIELD[k]) for k in change}


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: "+".join(c))
def test_a_sync_setattr_the_store_refused_is_not_kept_here(tmp_path, change):
    async def body(a, b, store) -> None:
        ino = await a.save(ROOT_INO, b"f0", b"checkpoint")
        await a.fs.wait_idle()
        before = attrs(a.fs.getattr(ino), change)
        entry_before = json.loads(store.get("dirs/root/f0")[0])
        refused = store.fail("put", TransientStoreError("connection refused"), times=-1)
        with pytest.raises(FsError) as exc:
            await a.fs.setattr(ino, **change)
        assert exc.value.errno == errno.EIO
        assert attrs(a.fs.getattr(ino), change) == before      # kept here: the bug
        refused.remove()
        assert json.loads(store.get("dirs/root/f0")[0]) == entry_before
        await trio.sleep(0.1)                                  # past the listing TTL
        for node in (a, b):
            await node.names()
            assert attrs(node.fs.getattr(await node.resolve("f0")), change) == before
        await a.fs.setattr(ino, **change)                      # and then it can
        for node in (a, b):
            await trio.sleep(0.1)
            await node.names()
            assert attrs(node.fs.getattr(await node.resolve("f0")), change) == change
    run(tmp_path, body)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: "+".join(c))
def test_a_sync_setattr_whose_answer_was_lost_shows_everywhere(tmp_path, change):
    """The rewrite landed and its answer was lost (EIO): it happened, and every node,
    this one too, shows it once it lists the directory again."""
    async def body(a, b, store) -> None:
        ino = await a.save(ROOT_INO, b"f0", b"checkpoint")
        await a.fs.wait_idle()

        def lose(call) -> None:
            raise TransientStoreError("connection reset")
        lost = store.after(lose, "put", times=1)
        with pytest.raises(FsError) as exc:
            await a.fs.setattr(ino, **change)
        assert exc.value.errno == errno.EIO
        lost.remove()
        assert {k: json.loads(store.get("dirs/root/f0")[0])[k] for k in change} == change
        for node in (a, b):
            await trio.sleep(0.1)
            await node.names()
            assert attrs(node.fs.getattr(await node.resolve("f0")), change) == change
    run(tmp_path, body)
