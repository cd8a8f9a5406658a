"""Async mode's synchronous store steps (hard links, the rename of a hard-linked name)
follow the metadata log: they act on the store only once the records pending before
them are applied, so they find the names the log has not moved yet where the log will
put them, and never overwrite a name a pending record still moves away.  In the core,
without FUSE, over the in-memory store; gates hold the log's store calls so each test is
inside the window it names when it acts."""

from __future__ import annotations

import errno
import stat

import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.core.state import RENAME_EXCHANGE
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import Entry, chunk_key, entry_key, inode_key

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "chunk_size": 64 << 10, "stale_wait": 0.2}


async def reached(gate) -> None:
    with trio.fail_after(20):
        await trio.to_thread.run_sync(gate.wait_reached, 20)


def entry(store, name: bytes) -> Entry:
    return Entry.from_json(store.get(entry_key("root", name))[0])


async def log_held_up(fs, store):
    """An earlier record of the log (the entry of a FIFO) held in the store: the records
    after it wait their turn.  Returns the gate to release."""
    gate = store.gate("put", prefix=entry_key("root", b"slow"))
    await fs.mknod(ROOT_INO, b"slow", stat.S_IFIFO | 0o644, 0, 0, 0)
    await reached(gate)
    return gate


def content(store, name: bytes) -> bytes:
    return b"".join(store.get(chunk_key(sha))[0] for sha, _ in entry(store, name).chunks)


async def outcome(fn, *args) -> object:
    """The call's result, or the FsError it raised (to assert on, not to fail with)."""
    try:
        return await fn(*args)
    except FsError as exc:
        return exc


async def test_a_hard_link_to_a_name_whose_rename_is_pending_waits_for_the_move(core):
    # pjdfstest rename/00.t (socket): bind n0, rename n0 n1, link n1 n0 -- with the
    # entry of n0 in the store and the move to n1 not applied yet.
    fs, store = core.fs, core.store
    sock = await fs.mknod(ROOT_INO, b"n0", stat.S_IFSOCK | 0o644, 0, 0, 0)
    await fs.wait_idle()                                  # n0's entry is in the store
    gate = await log_held_up(fs, store)
    await fs.rename(ROOT_INO, b"n0", ROOT_INO, b"n1", 0)  # the move waits in the log
    results = []

    async def link() -> None:
        results.append(await outcome(fs.link, sock.ino, ROOT_INO, b"n0"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link)
        await trio.sleep(0.3)
        gate.release()
    assert not isinstance(results[0], FsError), results[0]
    assert fs.ns.lookup(ROOT_INO, b"n0") == fs.ns.lookup(ROOT_INO, b"n1") == sock.ino
    assert fs.nlink(fs.ns.get(sock.ino)) == 2
    await fs.wait_idle()
    n0, n1 = entry(store, b"n0"), entry(store, b"n1")
    assert n0.type == n1.type == "link" and n0.link == n1.link
    shared = Entry.from_json(store.get(inode_key(n0.link))[0])
    assert shared.type == "sock" and shared.nlink == 2


async def test_a_linked_rename_over_a_name_whose_move_is_pending_keeps_the_moved_file(core):
    # mv x y (journaled, not applied yet), then mv a x where a is hard-linked (the
    # synchronous path): the store's x is moved to y first, never overwritten before.
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"x", b"the checkpoint")
    sock = await fs.mknod(ROOT_INO, b"a", stat.S_IFSOCK | 0o644, 0, 0, 0)
    await fs.wait_idle()
    await fs.link(sock.ino, ROOT_INO, b"b")
    gate = await log_held_up(fs, store)
    await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)    # the move waits in the log
    results = []

    async def rename() -> None:
        results.append(await outcome(fs.rename, ROOT_INO, b"a", ROOT_INO, b"x", 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rename)
        await trio.sleep(0.3)
        gate.release()
    assert not isinstance(results[0], FsError), results[0]
    await fs.wait_idle()
    assert store.exists(entry_key("root", b"y")), "the moved checkpoint is not in the store"
    y = entry(store, b"y")
    assert y.type == "file"
    assert b"".join(store.get(chunk_key(sha))[0] for sha, _ in y.chunks) == \
        b"the checkpoint"
    assert entry(store, b"x").type == "link"


async def test_an_exchange_with_a_name_whose_rename_is_pending_waits_for_the_move(core):
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"x", b"first")
    await core.save(ROOT_INO, b"z", b"second")
    await fs.wait_idle()
    gate = await log_held_up(fs, store)
    await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)    # the move waits in the log
    results = []

    async def exchange() -> None:
        results.append(await outcome(fs.rename, ROOT_INO, b"y", ROOT_INO, b"z",
                                     RENAME_EXCHANGE))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(exchange)
        await trio.sleep(0.3)
        gate.release()
    assert not isinstance(results[0], FsError), results[0]
    await fs.wait_idle()
    assert {name: content(store, name) for name in (b"y", b"z")} == \
        {b"y": b"second", b"z": b"first"}
    assert not store.exists(entry_key("root", b"x"))


@pytest.mark.parametrize("core_config", [{"durability": "async", "store_timeout": 1.0,
                                          "stale_wait": 0.2}])
async def test_a_hard_link_behind_a_record_the_store_holds_answers_eio_and_changes_nothing(
        core):
    fs, store = core.fs, core.store
    sock = await fs.mknod(ROOT_INO, b"n0", stat.S_IFSOCK | 0o644, 0, 0, 0)
    await fs.wait_idle()
    gate = await log_held_up(fs, store)
    result = await outcome(fs.link, sock.ino, ROOT_INO, b"n1")
    assert isinstance(result, FsError) and result.errno == errno.EIO
    assert "not in the store yet" in result.reason
    assert fs.ns.lookup(ROOT_INO, b"n1") is None
    gate.release()
    await fs.wait_idle()
    assert entry(store, b"n0").type == "sock"            # not linked
    assert not store.exists(entry_key("root", b"n1"))
