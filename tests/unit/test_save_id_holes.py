"""Review of the save-id change (decision 0016, "A late removal and another node's save
of the same bytes"): holes where an entry without a save id, or an inode whose save id
is not the one the store has under its name, lets a late removal take a save its
writer was told is saved, or leave a removed name behind -- and a publish that wrote
over a directory another node made under its name.  Each failed before its fix."""

from __future__ import annotations

import os
import stat

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import WRITE_NEW, me, open_core, two_cores
from test_same_bytes_saved_again import refuse_deletes, save_over


def run(tmp_path, body, **config) -> None:
    async def main() -> None:
        store = MemoryStore()
        cfg = dict(durability="async", metadata_ttl=30.0)
        cfg.update(config)
        async with two_cores(tmp_path, store, Config(**cfg)) as (a, b):
            await body(a, b, store)
    trio.run(main)


async def close_after_writing(node, handle, data: bytes) -> None:
    """The writer that was open across the other node's steps writes and closes."""
    await node.fs.write(handle.fh, 0, data)
    await node.fs.flush(handle.fh)
    await node.fs.release(handle.fh)
    with trio.fail_after(30):
        await node.fs.wait_idle()


def test_a_late_removal_of_a_mknod_file_leaves_another_nodes_empty_save(tmp_path):
    """``mknod(S_IFREG)`` publishes an empty file at once -- with no save id.  Another
    node saves the name again, empty (``touch``-style marker rewritten, ``: > f0``),
    and is told it is saved; this node's removal, journaled before, lands late.  Its
    record's identity has no save id, so ``same_object`` falls back to content and
    takes B's save -- the very case decision 0016's save id was made for."""
    async def body(a, b, store) -> None:
        await a.fs.mknod(ROOT_INO, b"f0", stat.S_IFREG | 0o644, 0, 0, 0)
        await a.fs.wait_idle()
        assert store.get("dirs/root/f0")
        ino_b = await b.resolve("f0")
        refused = refuse_deletes(store)
        await a.fs.unlink(ROOT_INO, b"f0")            # journaled; its delete waits
        await trio.sleep(0.2)
        await save_over(b, ino_b, b"")                 # B saves f0 again, same bytes
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert store.get("dirs/root/f0")
        refused.remove()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        objects = [o.key for o in store.list("dirs/root/")]
        assert "dirs/root/f0" in objects, "A's late removal took B's newer save"
    run(tmp_path, body)


def late_removal_then_made_again(tmp_path, make_first, make_again) -> None:
    """A (async) makes f0 (``make_first(fs)``) and removes it, its delete refused for
    now; B (sync) removes f0 and makes it again (``make_again(fs)``), told it exists;
    then A's removal lands late: B's new f0 must stay."""
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "a", store, Config(durability="async",
                                                           metadata_ttl=30.0)) as a, \
                open_core(tmp_path / "b", store, Config(durability="sync",
                                                        metadata_ttl=30.0)) as b:
            await make_first(a)
            await a.wait_idle()
            await b.lookup(ROOT_INO, b"f0")

            def refuse_conditional(call) -> None:       # A's journaled delete only
                if call.if_match is not None:
                    raise TransientStoreError("connection refused")
            refused = store.before(refuse_conditional, "delete", prefix="dirs/root/f0")
            await a.unlink(ROOT_INO, b"f0")             # journaled; its delete waits
            await trio.sleep(0.2)
            await b.unlink(ROOT_INO, b"f0")             # sync: gone from the store
            await make_again(b)
            assert store.get("dirs/root/f0")            # B's new f0 is in the store
            refused.remove()
            with trio.fail_after(60):
                await a.wait_idle()
            objects = [o.key for o in store.list("dirs/root/")]
            assert "dirs/root/f0" in objects, "A's late removal took B's new f0"
    trio.run(main)


def test_a_late_removal_leaves_a_file_another_node_made_again_with_mknod(tmp_path):
    """The other side of the fallback: A saved f0 (empty, with a save id); B (sync)
    removes it and makes it again with ``mknod`` (the same content), and is told it
    exists.  A's removal of its own f0, journaled before B's, lands late: an entry
    without a save id matched on content, and B's new file went."""
    async def save_empty(fs) -> None:
        handle, _ = await fs.create(ROOT_INO, b"f0", 0o644, WRITE_NEW, 0, 0, me())
        await fs.flush(handle.fh)
        await fs.release(handle.fh)

    async def mknod(fs) -> None:
        await fs.mknod(ROOT_INO, b"f0", stat.S_IFREG | 0o644, 0, 0, 0)
    late_removal_then_made_again(tmp_path, save_empty, mknod)


def test_a_late_removal_leaves_a_symlink_another_node_made_again(tmp_path):
    """The same race for a symlink (and any special file): its identity was its content
    alone (type, target), so a symlink another node removed and made again with the same
    target -- ``ln -sfn latest ckpt-7`` style, told it exists -- was taken by this
    node's removal of the old one, journaled before and landing late."""
    async def symlink(fs) -> None:
        await fs.symlink(ROOT_INO, b"f0", b"ckpt-7", 0, 0)
    late_removal_then_made_again(tmp_path, symlink, symlink)


def test_a_publish_that_fails_after_its_put_landed_keeps_the_save_id_it_sent(tmp_path):
    """A publish whose entry PUT was answered, but whose step after it failed (the
    check of the directory's removal mark, ``EntryIO.landed``: a GET that can fail),
    puts back the previous chunks *and save id* in memory -- while the store has the
    new save, the inode's ETag is the new one and the unanswered-PUT note was cleared
    (the PUT was answered).  The file saved again with the same bytes and then removed:
    the removal's identity names the old save, the store holds the new one, and the
    removed file stays in the store (before save ids, content alone matched)."""
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "a", store, Config(durability="async",
                                                           metadata_ttl=0.05)) as fs:
            d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
            await fs.wait_idle()
            key = f"dirs/{d.dir_id}/f0"
            handle, inode = await fs.create(d.ino, b"f0", 0o644, WRITE_NEW, 0, 0, me())
            await fs.write(handle.fh, 0, b"config v1\n")
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
            await fs.wait_idle()
            first = store.get(key)[0]
            hooks = []

            def refuse(call) -> None:
                raise TransientStoreError("connection refused")

            def mark_check_fails(call) -> None:     # the GET of d's removal mark
                hooks.append(store.before(refuse, "put", prefix=key))  # retries wait
                raise TransientStoreError("connection reset")
            hooks.append(store.before(mark_check_fails, "get", prefix="removed/", times=1))
            handle = await fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC, me())
            await fs.write(handle.fh, 0, b"config v1\n")    # saved again, same bytes
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
            with trio.fail_after(10):
                while len(hooks) < 2:
                    await trio.sleep(0.01)
            await trio.sleep(0.1)
            assert store.get(key)[0] != first           # the new save is in the store
            await fs.unlink(d.ino, b"f0")
            for hook in hooks:
                hook.remove()
            with trio.fail_after(60):
                await fs.wait_idle()
            assert [o.key for o in store.list(f"dirs/{d.dir_id}/")] == [], \
                "a removed file stayed in the store"
    trio.run(main)


def test_a_symlink_whose_put_answer_was_lost_goes_with_its_removal(tmp_path):
    """(Beside the save id, same family as ``test_lost_reply_entries``.)  Async: a
    symlink's (or special file's, or mknod'd empty file's) entry PUT is its log record
    ``put`` (``MetaLogApply._exec_put``): no unanswered-PUT note is taken before it.
    Its answer lost, the record waits; the name is removed here meanwhile -- the
    record then does nothing, the removal has nothing to delete (never published) --
    and the landed entry stays: a removed name back from the dead."""
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "a", store, Config(durability="async",
                                                           metadata_ttl=0.05)) as fs:
            def lose_answer(call) -> None:
                raise TransientStoreError("connection reset (answer lost)")
            hook = store.after(lose_answer, "put", prefix="dirs/root/s0", times=1)
            await fs.symlink(ROOT_INO, b"s0", b"target", 0, 0)
            with trio.fail_after(10):
                while not [o for o in store.list("dirs/root/")]:
                    await trio.sleep(0.01)
            await fs.unlink(ROOT_INO, b"s0")
            hook.remove()
            with trio.fail_after(60):
                await fs.wait_idle()
            assert [o.key for o in store.list("dirs/root/")] == [], \
                "a removed symlink stayed in the store"
    trio.run(main)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_publish_over_a_name_another_node_made_a_directory_keeps_both(tmp_path, durability):
    """(Found by the review of the save id; older than it: the publish conflict path,
    ``EntryIO._keep_attributes``.)  A save whose compare-and-swap met another entry under
    its name wrote over it whatever it was.  B removed f0 and made it a directory, with a
    file in it, and was told both are done; A, writing the f0 it opened before, closes:
    its publish replaced B's directory entry with A's file -- B's directory and the file
    in it were gone from every listing.  Now B's directory stays, and A's save is kept
    under ``f0.ckptfs-conflict-<node>`` (decision 0016: a conflict never deletes)."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"v1")
        await a.fs.wait_idle()
        handle = await a.fs.open(ino_a, os.O_WRONLY | os.O_TRUNC, a.me())
        await b.resolve("f0")
        await b.fs.unlink(ROOT_INO, b"f0")
        d = await b.fs.mkdir(ROOT_INO, b"f0", 0o755, 0, 0)
        await b.save(d.ino, b"inside", b"B's data")
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await close_after_writing(a, handle, b"v2")
        from ckptfs.format.remote import Entry
        entry = Entry.from_json(bytes(store.get("dirs/root/f0")[0]))
        assert entry.type == "dir", "A's publish wrote over B's directory"
        kept = [o.key for o in store.list("dirs/root/") if ".ckptfs-conflict-" in o.key]
        assert len(kept) == 1, store.list("dirs/root/")
        assert Entry.from_json(bytes(store.get(kept[0])[0])).size == 2
        names = await a.names()
        assert "f0" not in names or a.fs.getattr(await a.resolve("f0")).type == "dir"
        assert any(n.startswith("f0.ckptfs-conflict-") for n in names), names
        assert await a.load(await a.resolve(kept[0].rpartition("/")[2])) == b"v2"
    run(tmp_path, body, durability=durability)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_publish_whose_conflict_name_is_taken_too_takes_the_next_free_one(tmp_path,
                                                                            durability):
    """As above, and B also made ``f0.ckptfs-conflict-<A's node>`` a directory (a
    conflict of an earlier save, or a user's name), which A has not listed.  The second
    refusal went out of the publish as it came: async retried it for ever (``wait``
    never done), sync answered the close with an error no errno names.  A's save now
    takes the next free conflict name, ``...-2``, and B's directories stay."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", b"v1")
        await a.fs.wait_idle()
        handle = await a.fs.open(ino_a, os.O_WRONLY | os.O_TRUNC, a.me())
        taken = b"f0.ckptfs-conflict-" + a.fs.st.leases.node_id.encode()[:12]
        await b.resolve("f0")
        await b.fs.unlink(ROOT_INO, b"f0")
        await b.fs.mkdir(ROOT_INO, b"f0", 0o755, 0, 0)
        await b.fs.mkdir(ROOT_INO, taken, 0o755, 0, 0)
        with trio.fail_after(30):
            await b.fs.wait_idle()
        await close_after_writing(a, handle, b"v2")
        from ckptfs.format.remote import Entry
        for name in (b"f0", taken):
            entry = Entry.from_json(bytes(store.get("dirs/root/" + name.decode())[0]))
            assert entry.type == "dir", f"A's publish wrote over B's directory {name!r}"
        second = (taken + b"-2").decode()
        assert Entry.from_json(bytes(store.get("dirs/root/" + second)[0])).size == 2
        await a.fs.refresh_dir(ROOT_INO, force=True)
        assert await a.load(await a.resolve(second)) == b"v2"
    run(tmp_path, body, durability=durability)


@pytest.mark.parametrize("data", [b"", b"same bytes"], ids=["empty", "same-bytes"])
def test_a_late_removal_of_an_entry_written_before_save_ids_leaves_a_newer_save(tmp_path,
                                                                              data):
    """A store written by a release before save ids: B reads ``f0``'s entry, which has
    none, and removes it while the store refuses its deletes; A saves ``f0`` again with
    the same bytes (a save id now).  B's record named the entry by content only, which
    also matched A's new save: the late delete took it.  A node of this release that read
    an entry without a save id now says so in its record, and an entry with one is then
    another save."""
    async def body(a, b, store) -> None:
        ino_a = await a.save(ROOT_INO, b"f0", data)
        await a.fs.wait_idle()
        import json
        doc = json.loads(bytes(store.get("dirs/root/f0")[0]))
        del doc["save"]                                    # as an older release wrote it
        store.put("dirs/root/f0", json.dumps(doc).encode())
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.load(await b.resolve("f0")) == data
        refused = refuse_deletes(store)
        await b.fs.unlink(ROOT_INO, b"f0")                # journaled; its delete waits
        await trio.sleep(0.2)
        await save_over(a, ino_a, data)                   # A saves f0 again, same bytes
        with trio.fail_after(30):
            await a.fs.wait_idle()
        refused.remove()
        with trio.fail_after(60):
            await b.fs.wait_idle()
        assert "dirs/root/f0" in [o.key for o in store.list("dirs/root/")], \
            "B's late removal took A's newer save"
    run(tmp_path, body)
