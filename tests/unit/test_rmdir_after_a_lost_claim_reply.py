"""An rmdir whose claim landed but whose reply was lost must not wait for its own claim.

Soak seed 1215537 (async, local store; the store resetting connections after acting):
B made ``d1`` and removed it while every answer was lost.  The rmdir's claim on the
entry landed, its call failed, and the metadata log tried the record again: it found a
live rmdir claim on ``d1`` -- its own -- took it for another node's (or a crashed
daemon's) and waited for it to end, up to the claim's 60 s TTL.  Both nodes showed
``d1`` for that long (the soak's convergence check allows 20 s).  Within one call the
retry layer tells its own write now (``test_lost_replies.py``); across calls the node
remembers the claims it sent (``DirRemovals``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.memory import Call
from support.core import two_cores

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_an_rmdir_whose_claim_reply_was_lost_finishes_at_once(tmp_path: Path,
                                                                     durability: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=0.0)
    key = entry_key("root", b"d1")
    async with two_cores(tmp_path, store, config) as (a, b):
        await b.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)
        await b.fs.wait_idle()
        assert await a.names() == ["d1"]

        def lose_reply(call: Call) -> None:
            if call.error is None:
                raise TransientStoreError("injected: the claim's reply was lost")
        store.after(lose_reply, "put", prefix=key, times=1)
        try:
            await b.fs.rmdir(ROOT_INO, b"d1")
        except Exception:           # (sync: the store step failed; it is tried again)
            await b.fs.rmdir(ROOT_INO, b"d1")
        with trio.fail_after(20):   # the claim's TTL is 60 s
            await b.fs.wait_idle()
        assert not store.exists(key), "d1 is still in the store"
        assert await a.names() == []
        assert await b.names() == []


async def test_a_directory_removed_while_its_mkdir_s_answer_was_lost_leaves_the_store(
        tmp_path: Path):
    """Async: the mkdir's PUT landed but its answer was lost, and the rmdir came before
    the log tried the mkdir again.  The node took the directory for one the store never
    had and removed it here only: the store kept ``d1``, and every other node showed it
    (soak seed 1215537, the rest of it).  Now the PUT is noted before it goes
    (``Inode.unsure``), and the removal takes the note along."""
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=0.0)
    key = entry_key("root", b"d1")
    async with two_cores(tmp_path, store, config) as (a, b):
        def lose_reply(call: Call) -> None:
            if call.error is None:
                raise TransientStoreError("injected: the mkdir's answer was lost")
        hook = store.after(lose_reply, "put_if_absent", prefix=key)
        await b.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)
        with trio.fail_after(10):
            while not store.exists(key):
                await trio.sleep(0.01)
        await trio.sleep(0.1)       # (its answer lost: the log waits to try again)
        await b.fs.rmdir(ROOT_INO, b"d1")
        hook.remove()
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert not store.exists(key), "the store kept the directory removed here"
        assert await a.names() == []
        assert await b.names() == []


async def test_a_rename_whose_claim_reply_was_lost_can_be_made_again_at_once(
        tmp_path: Path):
    """Sync: a rename's claim landed and its reply was lost, so the rename failed (EIO).
    Made again -- here to another name -- it found its own live claim and answered
    ENOENT ("being renamed by another node") for the claim's 60 s TTL."""
    store = MemoryStore()
    config = Config(durability="sync", upload_hold=0.0, metadata_ttl=0.0)
    key = entry_key("root", b"f0")
    async with two_cores(tmp_path, store, config) as (a, b):
        await b.save(ROOT_INO, b"f0", b"a file renamed " * 10)

        def lose_reply(call: Call) -> None:
            if call.error is None:
                raise TransientStoreError("injected: the claim's reply was lost")
        store.after(lose_reply, "put", prefix=key, times=1)
        with pytest.raises(Exception):
            await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        with trio.fail_after(20):
            await b.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
        await b.fs.wait_idle()
        assert not store.exists(key)
        assert await a.names() == ["f2"]
        assert await b.load(await b.resolve("f2")) == b"a file renamed " * 10
