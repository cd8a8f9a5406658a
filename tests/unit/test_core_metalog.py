"""Async mode's metadata log in the core, without FUSE, over the in-memory store
(decision 0012): the store's calls are held by gates, so each test is inside the window
it names when it acts."""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import Entry, chunk_key, entry_key
from support.core import reached

pytestmark = pytest.mark.trio
CS = 64 << 10
OTHER = "5" * 32        # another node's directory id


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "chunk_size": CS, "stale_wait": 0.2}


def content(store, dir_id: str, name: bytes) -> bytes:
    entry = Entry.from_json(store.get(entry_key(dir_id, name))[0])
    return b"".join(store.get(chunk_key(sha))[0] for sha, _ in entry.chunks)


def ops(store, op: str, prefix: str) -> list[int]:
    """Positions of the store's calls of ``op`` under ``prefix``, in call order (``put``:
    a conditional create too, as a new name's first publish is)."""
    kinds = ("put", "put_if_absent") if op == "put" else (op,)
    return [i for i, c in enumerate(store.calls) if c.op in kinds and c.key.startswith(prefix)]


async def test_a_directory_rename_returns_at_once_and_lands_after_the_files(core):
    fs, store = core.fs, core.store
    d = await fs.mkdir(ROOT_INO, b"step.tmp", 0o755, 0, 0)
    await fs.wait_idle()
    gate = store.gate("put", prefix="chunks/")           # the shard's upload waits
    await core.save(d.ino, b"shard", b"s" * (2 * CS))
    await reached(gate)
    with trio.fail_after(5):                              # never waits for the upload
        await fs.rename(ROOT_INO, b"step.tmp", ROOT_INO, b"step", 0)
    assert fs.ns.lookup(ROOT_INO, b"step") == d.ino       # here at once
    assert not store.exists(entry_key("root", b"step"))   # the store: not yet
    gate.release()
    await fs.wait_idle()
    assert content(store, d.dir_id, b"shard") == b"s" * (2 * CS)
    shard_put = ops(store, "put", entry_key(d.dir_id, b"shard"))[-1]
    dir_put = ops(store, "put", entry_key("root", b"step"))[-1]
    assert shard_put < dir_put                            # the tree landed whole
    assert not store.exists(entry_key("root", b"step.tmp"))


async def test_a_name_removed_and_created_again_is_deleted_before_the_new_file_lands(core):
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"latest", b"old")
    await fs.wait_idle()
    gate = store.gate("delete", prefix=entry_key("root", b"latest"))
    await fs.unlink(ROOT_INO, b"latest")
    await reached(gate)                                   # the log applies the unlink
    await core.save(ROOT_INO, b"latest", b"new")
    await trio.sleep(0.3)
    # The new file's publish follows the record before it: no entry PUT yet.
    assert store.get(entry_key("root", b"latest"))[0] and \
        content(store, "root", b"latest") == b"old"
    gate.release()
    await fs.wait_idle()
    assert content(store, "root", b"latest") == b"new"


async def test_mkdir_while_the_store_is_slow_joins_the_directory_another_node_made(core):
    fs, store = core.fs, core.store
    await fs.listdir(ROOT_INO)
    # Another node makes "run" meanwhile; this node's first try at the store is slow
    # (held past stale_wait), so its mkdir goes local-first.
    store.put(entry_key("root", b"run"), Entry(type="dir", mode=0o755, id=OTHER,
                                                mtime_ns=1).to_json())
    # Held: the mkdir's own try, then its record's (so the rank saves before the join).
    gate = store.gate("put_if_absent", prefix=entry_key("root", b"run"), times=2)
    d = await fs.mkdir(ROOT_INO, b"run", 0o755, 0, 0)
    local_id = d.dir_id
    assert local_id != OTHER and not d.published
    await core.save(d.ino, b"rank1.bin", b"1" * 100)
    assert not store.exists(entry_key(local_id, b"rank1.bin"))   # waits for the record
    gate.release()
    await fs.wait_idle()
    assert fs.ns.get(d.ino).dir_id == OTHER          # joined
    assert content(store, OTHER, b"rank1.bin") == b"1" * 100
    assert not [k for k in store.keys() if k.startswith(f"dirs/{local_id}/")]
    assert fs.oplog.resolve(local_id) == OTHER
    assert json.loads(store.get(entry_key("root", b"run"))[0])["id"] == OTHER


async def test_a_seal_is_journaled_and_lands_after_the_uploads_below(core):
    fs, store = core.fs, core.store
    ckpt = await fs.mkdir(ROOT_INO, b"checkpoint-3", 0o755, 0, 0)   # staged (hf-trainer)
    await fs.wait_idle()
    gate = store.gate("put", prefix="chunks/")
    await core.save(ckpt.ino, b"model.bin", b"m" * CS)
    await reached(gate)
    assert await fs.seal(ckpt.ino) is True                # journaled, not waited for
    assert fs.oplog.pending_of("seal", ckpt.ino)
    assert json.loads(store.get(entry_key("root", b"checkpoint-3"))[0])["staged"] is True
    gate.release()
    await fs.wait_idle()
    entry = json.loads(store.get(entry_key("root", b"checkpoint-3"))[0])
    assert entry["staged"] is False and not fs.ns.get(ckpt.ino).staged
    assert ops(store, "put", entry_key(ckpt.dir_id, b"model.bin"))[-1] < \
        ops(store, "put", entry_key("root", b"checkpoint-3"))[-1]


async def test_a_move_another_node_beat_keeps_the_file_it_would_have_replaced(core):
    # Found by the model test (soak, seed 581249469): two async nodes renamed the same
    # published file at once, B's over an existing file.  A's move won in the store; B's
    # record then met no source and deleted the file it would have replaced, which no
    # serial order of the two renames removes.  The file is lost.
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"f0", b"moved")
    await core.save(ROOT_INO, b"f2", b"kept")
    await fs.wait_idle()
    # Another node moves f0 away; this node has not listed the root since.
    raw, _ = store.get(entry_key("root", b"f0"))
    store.put(entry_key("root", b"elsewhere"), raw)
    store.delete(entry_key("root", b"f0"))
    await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)   # local first: returns ok
    await fs.wait_idle()
    assert content(store, "root", b"f2") == b"kept"
    assert content(store, "root", b"elsewhere") == b"moved"
    # And this node comes round to what the store has, at its next listing.
    await trio.sleep(fs.config.metadata_ttl + 0.1)
    inode = await fs.lookup(ROOT_INO, b"f2")
    handle = await fs.open(inode.ino, os.O_RDONLY, core.me())
    assert await fs.read(handle.fh, 0, 100) == b"kept"
    await fs.release(handle.fh)


async def test_a_move_whose_file_is_unlinked_while_it_waits_for_the_lock_is_applied(
        core, caplog):
    # mv x y; rm y -- the unlink holds the inode's lock when the log's move comes to
    # it, and the inode is gone when the move gets the lock.  Before: the move failed
    # with ENOENT, said "needs an operator" and held the records after it back.
    fs, store = core.fs, core.store
    ino = await core.save(ROOT_INO, b"x", b"data")
    await core.save(ROOT_INO, b"other", b"o")
    await fs.wait_idle()
    earlier = store.gate("get", prefix=entry_key("root", b"other"))
    await fs.unlink(ROOT_INO, b"other")                   # an earlier record, held
    await reached(earlier)
    await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)
    lock = fs.st._rt(ino).lock
    async with trio.open_nursery() as nursery:
        async with lock:
            nursery.start_soon(fs.unlink, ROOT_INO, b"y")
            with trio.fail_after(10):
                while lock.statistics().tasks_waiting < 1:      # the unlink waits
                    await trio.sleep(0.01)
                earlier.release()
                while lock.statistics().tasks_waiting < 2:      # then the log's move
                    await trio.sleep(0.01)
    with trio.fail_after(30):
        await fs.wait_idle()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert not store.exists(entry_key("root", b"x"))
    assert not store.exists(entry_key("root", b"y"))
