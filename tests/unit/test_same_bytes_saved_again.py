"""A removal that lands late must not take another node's newer save of the same bytes.

An async node journals ``unlink f0`` as "delete the entry under ``f0`` if it still holds
what I published there" (a newer object under the name stays).  What it published was
told apart from a newer object by content alone (type, chunks, size).  So when another
node saved the name again *with the same bytes* before the record reached the store --
an empty marker file, a ``config.json`` written again by the next save -- the late
delete took that save, which its writer had been told was saved.  In either serial
order of "A removes f0" and "B saves f0" the name ends up holding B's save, or A's
removal came last and B's save was not acknowledged before it: the store must keep
B's file.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.core.entries import entry_identity, same_object
from ckptfs.format.remote import Entry
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import two_cores


def run(tmp_path, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store, Config(durability="async",
                                                     metadata_ttl=30.0)) as (a, b):
            await body(a, b, store)
    trio.run(main)


async def save_over(node, ino: int, data: bytes) -> None:
    handle = await node.fs.open(ino, os.O_WRONLY | os.O_TRUNC, node.me())
    await node.fs.write(handle.fh, 0, data)
    await node.fs.flush(handle.fh)
    await node.fs.release(handle.fh)


def refuse_deletes(store):
    def before(call) -> None:
        raise TransientStoreError("connection refused")
    return store.before(before, "delete", prefix="dirs/root/f0")


@pytest.mark.parametrize("data", [b"", b'{"hidden_size": 8}\n'], ids=["empty", "same-bytes"])
def test_a_late_removal_leaves_another_nodes_save_of_the_same_bytes(tmp_path, data):
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", data)
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        refused = refuse_deletes(store)
        await a.fs.unlink(ROOT_INO, b"f0")            # journaled; its delete waits
        await trio.sleep(0.2)
        await save_over(b, ino_b, data)                # B saves f0 again, same bytes
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert store.get("dirs/root/f0")                # B's save is in the store
        refused.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        objects = [o.key for o in store.list("dirs/root/")]
        assert "dirs/root/f0" in objects, "A's late removal took B's newer save"
        del ino_a
    run(tmp_path, body)


def test_a_removal_after_seeing_the_other_save_takes_it(tmp_path):
    """The other side: a node that has seen another node's save of the same bytes (its
    listing took the new save id) and then removes the name, removes that save."""
    async def main() -> None:
        store = MemoryStore()
        config = Config(durability="async", metadata_ttl=0.05)
        async with two_cores(tmp_path, store, config) as (a, b):
            await a.save(ROOT_INO, b"f0", b"")
            await a.fs.wait_idle()
            before = store.get("dirs/root/f0")[0]
            await save_over(b, await b.resolve("f0"), b"")
            await b.fs.wait_idle()
            assert store.get("dirs/root/f0")[0] != before
            await trio.sleep(0.2)
            assert await a.names() == ["f0"]             # A's listing is read again
            await a.fs.unlink(ROOT_INO, b"f0")
            await a.fs.wait_idle()
            assert [o.key for o in store.list("dirs/root/")] == []
    trio.run(main)


def test_an_entry_keeps_its_save_id_and_a_bad_one_counts_as_absent():
    entry = Entry(type="file", mode=0o644, size=3, chunks=[("ab" * 32, 3)],
                  save_id="0123456789abcdef0123456789abcdef")
    again = Entry.from_json(entry.to_json())
    assert again.save_id == entry.save_id
    assert entry_identity(again) == entry_identity(entry)
    for bad in ("", "XYZ", "0" * 31, 7, None, "0" * 4096):
        doc = json.loads(entry.to_json())
        doc["save"] = bad
        assert Entry.from_json(json.dumps(doc).encode()).save_id is None, bad


def test_save_ids_tell_saves_apart_and_missing_ones_fall_back_to_content():
    chunks = [("cd" * 32, 5)]
    one = Entry(type="file", mode=0o644, size=5, chunks=chunks, save_id="1" * 32)
    two = Entry(type="file", mode=0o600, size=5, chunks=chunks, save_id="2" * 32)
    old = Entry(type="file", mode=0o644, size=5, chunks=chunks)           # no save id
    other = Entry(type="file", mode=0o644, size=4, chunks=[("ef" * 32, 4)])
    assert same_object(one, {entry_identity(one)})
    assert not same_object(two, {entry_identity(one)}), "another save of the same bytes"
    assert same_object(old, {entry_identity(one)}), "an entry written before save ids"
    assert same_object(one, {entry_identity(old)}), "a record written before save ids"
    assert not same_object(other, {entry_identity(one), entry_identity(old)})
    assert not same_object(old, {entry_identity(other)})
