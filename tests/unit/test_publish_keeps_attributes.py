"""A save over a file keeps the mode, owner and ``user.*`` attributes another node gave
it, like any POSIX filesystem keeps them across an ``O_TRUNC`` write.

A node that still had the old entry in view (within its listing TTL) published its
new content with the old mode: the entry PUT was unconditional and carried the whole
entry, so a chmod another node had just made -- and been told was saved -- was undone
everywhere.  The model test's race step left chmod out because of it.

What this node changed itself and has not sent yet (a chmod of a closed, not yet
published version) still rides with its publish: that is the newer intention.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, me, two_cores
from test_lost_reply_entries import run as run_one, save as save_one

TTL = 30.0      # B keeps its view of the entry for the whole test unless told


def run(tmp_path, durability: str, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        config = Config(metadata_ttl=TTL, durability=durability)
        async with two_cores(tmp_path, store, config) as (a, b):
            await body(a, b, store)
    trio.run(main)


async def overwrite(node, ino: int, data: bytes, *, chmod_after_close: int | None = None
                    ) -> None:
    """open(O_TRUNC), write, close on ``node``: a save over an existing file."""
    handle = await node.fs.open(ino, os.O_WRONLY | os.O_TRUNC, node.me())
    await node.fs.write(handle.fh, 0, data)
    await node.fs.flush(handle.fh)
    await node.fs.release(handle.fh)
    if chmod_after_close is not None:
        await node.fs.setattr(ino, mode=chmod_after_close)


def stored(store, name: str) -> dict:
    return json.loads(store.get(f"dirs/root/{name}")[0])


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_save_from_a_node_with_an_older_view_keeps_another_nodes_chmod(
        tmp_path, durability):
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")                       # B's view: mode 0644
        await a.fs.setattr(ino_a, mode=0o600, uid=1234, gid=4321)
        await a.fs.setxattr(ino_a, b"user.step", b"7")
        await a.fs.wait_idle()
        assert stored(store, "f0")["mode"] == 0o600
        await overwrite(b, ino_b, b"version two, from B")   # B still sees 0644
        await b.fs.wait_idle()
        entry = stored(store, "f0")
        assert entry["mode"] == 0o600, "B's save undid A's chmod"
        assert (entry["uid"], entry["gid"]) == (1234, 4321)
        assert entry["size"] == len(b"version two, from B")
        assert b.fs.getattr(ino_b).mode == 0o600            # and B shows what it saved
        assert b.fs.getxattr(ino_b, b"user.step") == b"7"
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_chmod_made_here_before_the_publish_still_wins(tmp_path, durability):
    """B chmods its own closed version before it is published: the later change is
    B's, and it stays, over A's earlier one."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        await a.fs.setattr(ino_a, mode=0o600)
        await a.fs.wait_idle()
        await overwrite(b, ino_b, b"version two", chmod_after_close=0o640)
        await b.fs.wait_idle()
        assert stored(store, "f0")["mode"] == 0o640
        assert b.fs.getattr(ino_b).mode == 0o640
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_save_over_a_hard_linked_file_keeps_another_nodes_chmod(tmp_path, durability):
    """The same for a file with two names: its content lives in one shared object
    (decision 0008), rewritten by a compare-and-swap that took the other node's newer
    object but wrote this node's old mode over it."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.link(ino_a, ROOT_INO, b"f1")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        assert await b.resolve("f1") == ino_b
        await a.fs.setattr(ino_a, mode=0o600)
        await a.fs.wait_idle()
        await overwrite(b, ino_b, b"version two, from B")
        await b.fs.wait_idle()
        link = stored(store, "f0")["inode"]
        shared = json.loads(store.get(f"inodes/{link}")[0])
        assert shared["size"] == len(b"version two, from B")
        assert shared["mode"] == 0o600, "B's save undid A's chmod"
        assert b.fs.getattr(ino_b).mode == 0o600
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_new_file_saved_over_a_name_another_node_just_filled_keeps_its_mode(
        tmp_path, durability):
    """Found by the soak (seed 1215253): A renames f1 (mode 0664) to f2 while B, whose
    listing does not show f2 yet, creates f2 and saves into it.  In either serial
    order f2 ends with mode 0664 (an ``O_CREAT`` open of an existing file keeps its
    mode); B's first publish wrote its new file's 0644 over it."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f1", b"version one")
        await a.fs.setattr(ino_a, mode=0o664)
        await a.fs.wait_idle()
        assert await b.names() == ["f1"]                    # B's view, kept for TTL
        await a.fs.rename(ROOT_INO, b"f1", ROOT_INO, b"f2", 0)
        await a.fs.wait_idle()
        ino_b = await b.save(ROOT_INO, b"f2", b"version two, from B")
        await b.fs.wait_idle()
        entry = stored(store, "f2")
        assert entry["size"] == len(b"version two, from B")
        assert entry["mode"] == 0o664, "B's new file's mode went over the existing one's"
        assert b.fs.getattr(ino_b).mode == 0o664
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_file_renamed_over_a_name_before_its_first_close_keeps_its_own_mode(
        tmp_path, durability):
    """The other side of it: a new file renamed over a published name before its first
    close (the name's old entry is held in the store until the publish) replaces that
    file, mode and all -- it takes nothing of the entry it replaces."""
    async def body(a, b, store) -> None:
        await a.save(ROOT_INO, b"latest", b"old checkpoint")
        await a.fs.wait_idle()
        handle, inode = await a.fs.create(ROOT_INO, b"tmp", 0o600, os.O_WRONLY | os.O_CREAT,
                                          0, 0, a.me())
        await a.fs.write(handle.fh, 0, b"new checkpoint")
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"latest", 0)
        await a.fs.flush(handle.fh)
        await a.fs.release(handle.fh)
        await a.fs.wait_idle()
        entry = stored(store, "latest")
        assert entry["size"] == len(b"new checkpoint")
        assert entry["mode"] == 0o600
        assert a.fs.getattr(inode.ino).mode == 0o600
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("first", ["utime", "chmod"])
def test_a_chmod_and_a_utime_on_two_nodes_both_stay(tmp_path, durability, first):
    """Found by the soak (seed 1215263, the model's race step): A sets f0's mtime while
    B, with the older entry in view, chmods it (or the other way round).  In either
    order both changes stay; B's rewrite took A's newer entry but wrote its own old mtime
    over it (only a changed content brought the store's mtime along)."""
    mtime = 2_000_000_000_999_999_999

    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        changes = {"utime": (a, ino_a, {"mtime_ns": mtime}),
                   "chmod": (b, ino_b, {"mode": 0o640})}
        order = [first, "chmod" if first == "utime" else "utime"]
        for what in order:
            node, ino, change = changes[what]
            await node.fs.setattr(ino, **change)
            await node.fs.wait_idle()
        entry = stored(store, "f0")
        assert (entry["mode"], entry["mtime_ns"]) == (0o640, mtime)
    run(tmp_path, durability, body)


# A review's findings.

@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_utime_over_another_nodes_newer_save_stays(tmp_path, durability):
    """B (older view) sets f0's mtime after A saved new content: serially the utime
    is last, so it stays; _adopt_newer's content branch writes A's mtime over it."""
    mtime = 2_000_000_000_999_999_999

    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        handle = await a.fs.open(ino_a, os.O_WRONLY | os.O_TRUNC, a.me())
        await a.fs.write(handle.fh, 0, b"version two")
        await a.fs.flush(handle.fh)
        await a.fs.release(handle.fh)
        await a.fs.wait_idle()
        await b.fs.setattr(ino_b, mtime_ns=mtime)
        await b.fs.wait_idle()
        entry = json.loads(store.get("dirs/root/f0")[0])
        assert entry["size"] == len(b"version two")
        assert entry["mtime_ns"] == mtime, "B's utime, told saved, was lost"
        assert b.fs.getattr(ino_b).mtime_ns == mtime
    async def main2() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store,
                             Config(metadata_ttl=30.0, durability=durability)) as (a, b):
            await body(a, b, store)
    trio.run(main2)


def test_a_directory_chmodded_before_its_mkdir_landed_leaves_a_later_chmod_alone(tmp_path):
    """Async: a chmod of a directory whose mkdir record has not run yet rides with the
    mkdir.  Later B chmods the directory, and A's utime rewrite meets B's entry: B's
    mode stays (A's mode was counted as unsent still, and written over B's)."""
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store,
                             Config(metadata_ttl=0.05, durability="async")) as (a, b):
            from ckptfs.store import TransientStoreError
            refused = store.fail("put_if_absent", TransientStoreError("refused"),
                                 prefix="dirs/root/d", times=2)
            d = await a.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)    # local: the log makes it
            await a.fs.setattr(d.ino, mode=0o750)                # not published: no record
            await a.fs.wait_idle()
            assert json.loads(store.get("dirs/root/d")[0])["mode"] == 0o750
            ino_b = await b.resolve("d")
            await b.fs.setattr(ino_b, mode=0o700)
            await b.fs.wait_idle()
            await a.fs.setattr(d.ino, mtime_ns=2_000_000_000_000_000_000)
            await a.fs.wait_idle()
            assert json.loads(store.get("dirs/root/d")[0])["mode"] == 0o700, \
                "A's stale mode went over B's later chmod"
    trio.run(main)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_linked_files_first_publish_leaves_its_chmod_unsent(tmp_path, durability):
    """f chmodded and hard-linked before its first close: put_new sends the mode but
    leaves "mode" in attrs_unsent; B's later chmod is undone by A's next save."""
    async def main() -> None:
        store = MemoryStore()
        async with two_cores(tmp_path, store,
                             Config(metadata_ttl=30.0, durability=durability)) as (a, b):
            handle, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, me())
            await a.fs.write(handle.fh, 0, b"one")
            await a.fs.setattr(inode.ino, mode=0o600)
            await a.fs.link(inode.ino, ROOT_INO, b"g")
            await a.fs.flush(handle.fh)
            await a.fs.release(handle.fh)
            await a.fs.wait_idle()
            ino_b = await b.resolve("f")
            await b.fs.setattr(ino_b, mode=0o640)
            await b.fs.wait_idle()
            h = await a.fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC, a.me())
            await a.fs.write(h.fh, 0, b"two")
            await a.fs.flush(h.fh)
            await a.fs.release(h.fh)
            await a.fs.wait_idle()
            link = json.loads(store.get("dirs/root/f")[0])["inode"]
            shared = json.loads(store.get(f"inodes/{link}")[0])
            assert shared["size"] == 3
            assert shared["mode"] == 0o640, "A's stale mode went over B's chmod"
    trio.run(main)


def test_a_save_over_a_file_on_a_store_that_refuses_every_if_match(tmp_path):
    """probe_store admits (--single-writer) a store that answers 412 to every If-Match
    PUT; the publish's entry PUT is now one: 8 GET+PUT rounds, then EIO."""
    from ckptfs.store import PreconditionFailed

    async def body(fs, store) -> None:
        ino = await save_one(fs, b"f", b"one")
        def refuse(call) -> None:
            if call.if_match is not None:
                raise PreconditionFailed(call.key)
        store.before(refuse, "put")
        await save_one(fs, b"f", b"two", ino)
        assert fs.getattr(ino).size == 3
    run_one(tmp_path, "sync", body)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("away", ["rename", "unlink"])
def test_a_save_whose_name_another_node_took_away_is_written_again_as_the_file_it_was(
        tmp_path, durability, away):
    """Soak seed 1215648: B's ``O_TRUNC`` save of f0 (mode 0640, set by a chmod) while A
    renames f0 to f1 or removes it.  B's publish finds the name gone and writes it
    again -- as the file B had open: its mode, owner and ``user.*`` attributes, its
    content and mtime the save's.  The daemon never learns what mode the program's
    ``O_CREAT`` open would have given a new file, and widens no permission on a guess
    (decision 0016, addendum of stop 49)."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"version one")
        await a.fs.setattr(ino_a, mode=0o640, uid=1234, gid=4321)
        await a.fs.setxattr(ino_a, b"user.step", b"7")
        await a.fs.wait_idle()
        ino_b = await b.resolve("f0")
        assert b.fs.getattr(ino_b).mode == 0o640
        handle = await b.fs.open(ino_b, os.O_WRONLY | os.O_TRUNC, b.me())
        await b.fs.write(handle.fh, 0, b"version two, from B")
        if away == "rename":
            await a.fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        else:
            await a.fs.unlink(ROOT_INO, b"f0")
        await a.fs.wait_idle()
        await b.fs.flush(handle.fh)
        await b.fs.release(handle.fh)
        await b.fs.wait_idle()
        entry = stored(store, "f0")
        assert entry["size"] == len(b"version two, from B")
        assert entry["mode"] == 0o640
        assert (entry["uid"], entry["gid"]) == (1234, 4321)
        assert b.fs.getxattr(ino_b, b"user.step") == b"7"
        if away == "rename":
            moved = stored(store, "f1")
            assert (moved["size"], moved["mode"]) == (len(b"version one"), 0o640)
    run(tmp_path, durability, body)
