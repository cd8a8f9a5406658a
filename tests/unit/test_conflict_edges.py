"""Edges of the conflict rules of stop 42 (decision 0016, "A late rename and another
node's newer save"), found by a review of them: a late rename's target compared
against what this node sent there unanswered, a listing that moves another node's
directory onto a name this node still owes the store, a conflict name on the node
that made it while other records of the file wait -- and cases that hold (a late
rename over a save this node knew, over its own save being published, after a
restart).  The failing ones failed before their fix."""

from __future__ import annotations

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import Core, reached
from test_late_rename_over_a_newer_save import (A_DATA, B_DATA, both_know, contents, nodes,
                                                save_over)
from test_lost_reply_entries import lose_answers_then_refuse

pytestmark = pytest.mark.trio

ENTRY = "dirs/root/"


async def until(predicate, seconds: float = 20.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.01)


# --------------------------------------------------------------------------- unanswered PUTs
# (A regression of the first version of the fix, on one node.)  The target's publish PUT
# landed with its answer lost (unsure note), the rename over it hands the note to the renamed inode, and a
# later rename of the file on (dst -> final) takes that note into its own record.  When
# the first move is applied, ``expect`` no longer knows the landed entry: NameTaken, the
# file goes to a transit conflict name, and ``dst`` keeps the replaced file's entry.

@pytest.mark.parametrize("which", ["first_version", "second_version"])
async def test_a_rename_chain_over_a_target_whose_put_answer_was_lost(tmp_path, which):
    async with nodes(tmp_path) as (a, b, store):
        await a.save(ROOT_INO, b"tmp", A_DATA)
        if which == "second_version":
            dst = await a.save(ROOT_INO, b"dst", b"v1 of dst, published")
        await a.fs.wait_idle()
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "dst")
        if which == "second_version":
            await save_over(a, dst, b"v2 of dst: its PUT landed, answer lost")
        else:
            await a.save(ROOT_INO, b"dst", b"v1 of dst: its PUT landed, answer lost")
        await until(lambda: landed)
        # Hold the log: the move's claim of tmp is refused until both renames are made.
        held = store.fail("put", TransientStoreError("refused"), prefix=ENTRY + "tmp",
                          times=-1)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        await a.fs.rename(ROOT_INO, b"dst", ROOT_INO, b"final", 0)
        held.remove()
        for hook in hooks:
            hook.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for node in (a, b):
            assert await contents(node) == {"final": A_DATA}, \
                sorted(o.key for o in store.list(ENTRY))


# --------------------------------------------------------------------------- moved onto a save
# ``_move_here`` unlinked whatever this node held under the name a moved directory lands
# on, and ``_forget_subtree`` deleted it -- even a file closed here (async:
# acknowledged) whose publish is still queued: its bytes were gone.  Now it is kept
# beside the directory as ``n.ckptfs-conflict-<node>``.

async def test_a_directory_moved_onto_a_name_this_node_saved_keeps_the_save(tmp_path):
    async with nodes(tmp_path) as (a, b, store):
        await b.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)
        assert await a.names() == ["d"]
        # A's uploads are refused for now: its save of n is closed, not yet published.
        refused = store.fail("put", TransientStoreError("refused"), prefix=CHUNKS_PREFIX,
                             times=-1)
        await a.save(ROOT_INO, b"n", A_DATA)
        await b.fs.rename(ROOT_INO, b"d", ROOT_INO, b"n", 0)   # n is free in the store
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)    # A learns d moved to n
        refused.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for node in (a, b):
            seen = await contents(node)
            assert seen.get("n") == "<dir>"
            kept = [v for k, v in seen.items() if k.startswith("n.ckptfs-conflict-")]
            assert kept == [A_DATA], f"A's closed save of n is gone: {seen.keys()}"


# --------------------------------------------------------------------------- a chmod pending
# A late rename met another node's newer save while a chmod of the file waited in the log
# (an ``attrs`` record, not a move): the store got a transit conflict name while A went
# on showing its own file as ``dst``.  Now only a later move sends it through a transit
# name; here A shows the save that holds the name.

async def test_a_late_rename_with_a_chmod_pending_shows_the_conflict_name_on_its_node(
        tmp_path):
    async with nodes(tmp_path) as (a, b, store):
        await both_know(a, b)
        # The log is held back (the move's claim refused) while A chmods and B saves.
        held = store.fail("put", TransientStoreError("refused"), prefix=ENTRY + "tmp",
                          times=-1)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        await a.fs.setattr(await a.resolve("dst"), mode=0o100600)   # an attrs record
        await save_over(b, await b.resolve("dst"), B_DATA)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        held.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        stored = sorted(o.key for o in store.list(ENTRY))
        here = {n: await a.load(await a.resolve(n)) for n in await a.names()}  # no listing
        assert here.get("dst") != A_DATA, \
            f"A serves its file as dst; the store has {stored}, A shows {sorted(here)}"


# --------------------------------------------------------------------------- checks that hold

async def test_holds_two_node_ordinary_late_rename_over_a_name_the_other_node_saved(
        tmp_path):
    """B saves dst, A lists it, A's rename tmp -> dst lands late: no conflict name."""
    async with nodes(tmp_path) as (a, b, store):
        await b.save(ROOT_INO, b"dst", B_DATA)
        await b.fs.wait_idle()
        await a.save(ROOT_INO, b"tmp", A_DATA)
        await a.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)
        await b.fs.setattr(await b.resolve("dst"), mode=0o100600)   # a chmod by B: same save
        await b.fs.wait_idle()
        held = store.fail("put", TransientStoreError("refused"), prefix=ENTRY + "tmp",
                          times=-1)
        await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        await trio.sleep(0.2)
        held.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for node in (a, b):
            assert await contents(node) == {"dst": A_DATA}


@pytest.mark.parametrize("target", ["queued", "in_flight"])
async def test_holds_rename_over_this_nodes_own_save_being_published(tmp_path, target):
    async with nodes(tmp_path) as (a, b, store):
        await a.save(ROOT_INO, b"tmp", A_DATA)
        await a.fs.wait_idle()
        if target == "queued":
            refused = store.fail("put", TransientStoreError("refused"), prefix=CHUNKS_PREFIX,
                                 times=-1)
            await a.save(ROOT_INO, b"dst", b"A's own save of dst, not uploaded yet")
            await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
            refused.remove()
        else:
            gate = store.gate("put_if_absent", prefix=ENTRY + "dst")
            await a.save(ROOT_INO, b"dst", b"A's own save of dst, its PUT in flight")
            await reached(gate)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a.fs.rename, ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
                await trio.sleep(0.2)
                gate.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        for node in (a, b):
            assert await contents(node) == {"dst": A_DATA}


async def test_holds_a_late_rename_replayed_after_a_restart(tmp_path):
    """A's rename is journaled, A stops with it pending, B saves dst, A starts again."""
    from support.core import open_core
    store = MemoryStore()
    config = Config(durability="async", metadata_ttl=3600.0, upload_hold=0.0)
    async with open_core(tmp_path / "b", store, config) as b_fs:
        b = Core(b_fs, store)
        async with open_core(tmp_path / "a", store, config) as a_fs:
            a = Core(a_fs, store)
            await a.save(ROOT_INO, b"tmp", A_DATA)
            await a.save(ROOT_INO, b"dst", b"the version both nodes know")
            await a.fs.wait_idle()
            await b.fs.refresh_dir(ROOT_INO, force=True)
            held = store.fail("put", TransientStoreError("refused"), prefix=ENTRY + "tmp",
                              times=-1)
            await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
        await save_over(b, await b.resolve("dst"), B_DATA)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        held.remove()
        async with open_core(tmp_path / "a", store, config) as a_fs:
            a = Core(a_fs, store)
            with trio.fail_after(60):
                await a.fs.wait_idle()
            for node in (a, b):
                assert await contents(node) == {"dst": B_DATA}


# --------------------------------------------------------------------------- checked: holds
# The same displacement for a directory: A has a closed, not yet uploaded file in its
# directory ``n``; B (to whom ``n`` looks empty) renames its ``d`` over ``n``.

async def test_holds_a_directory_moved_over_a_directory_holding_this_nodes_save(
        tmp_path):
    async with nodes(tmp_path) as (a, b, store):
        await b.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        await b.fs.mkdir(ROOT_INO, b"n", 0o755, 0, 0)
        await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)
        n = await a.resolve("n")
        await a.fs.refresh_dir(n, force=True)
        refused = store.fail("put", TransientStoreError("refused"), prefix=CHUNKS_PREFIX,
                             times=-1)
        await a.save(n, b"f", A_DATA)
        await b.fs.refresh_dir(await b.resolve("n"), force=True)
        await b.fs.rename(ROOT_INO, b"d", ROOT_INO, b"n", 0)   # n is empty to B
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT_INO, force=True)    # A learns d moved over n
        refused.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        found = {}
        for node, tag in ((a, "a"), (b, "b")):
            await node.fs.refresh_dir(ROOT_INO, force=True)
            for top in await node.names():
                ino = await node.resolve(top)
                await node.fs.refresh_dir(ino, force=True)
                for name in await node.names(ino):
                    found[(tag, f"{top}/{name}")] = await node.load(
                        await node.resolve(f"{top}/{name}"))
        for tag in "ab":
            assert A_DATA in [v for (t, _), v in found.items() if t == tag], \
                f"A's closed save n/f is on no name of node {tag}: {sorted(found)}"
