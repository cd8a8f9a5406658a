"""A name that lands in a directory another node removed meanwhile (decision 0028).

Node B's rmdir sees a directory empty while node A's name in it has not reached the
store: a file still open, a mkdir made on A's older view.  A's write then landed under a
directory id no entry named: A's close answered success and no node showed the file.
Now the rmdir leaves a removal mark and A's write, finding it, brings the directory back
(with its removed parents).  A directory B *renamed* instead leaves no mark: it must not
come back under its old name (Orbax renames ``step.orbax-checkpoint-tmp`` to ``step``
while the writers' files are still open)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.remote import REMOVED_PREFIX, ROOT_DIR_ID, Entry, entry_key, removed_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import WRITE_NEW, Core, crash_image, open_core, two_cores

pytestmark = pytest.mark.trio

DATA = b"saved while its directory went " * 100


async def _remove_tree(b: Core, path: str) -> None:
    """``rm -r`` on node B, deepest first: every directory lists empty there."""
    await b.fs.refresh_dir(ROOT_INO, force=True)
    parts = path.split("/")
    for cut in range(len(parts), 0, -1):
        head = "/".join(parts[:cut - 1])
        await b.fs.rmdir(await b.resolve(head) if head else ROOT_INO, parts[cut - 1].encode())
    await b.fs.wait_idle()
    assert parts[0] not in await b.names()


async def _writing_in_new_dir(a: Core, name: bytes):
    """A makes directory ``name`` in the root and a file ``f`` in it, written and held
    open (only A knows the file); the directory is in the store.  Returns the handle."""
    d = (await a.fs.mkdir(ROOT_INO, name, 0o755, 0, 0)).ino
    handle, _ = await a.fs.create(d, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
    await a.fs.write(handle.fh, 0, DATA)
    await a.fs.wait_idle()
    return handle


async def _close(a: Core, handle) -> None:
    """A closes the file (its publish), and is idle."""
    await a.fs.flush(handle.fh)
    await a.fs.release(handle.fh)
    await a.fs.wait_idle()


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("a_listed", [False, True])
async def test_a_file_closed_in_a_directory_another_node_removed_is_kept(
        tmp_path: Path, durability: str, depth: int, a_listed: bool):
    """``a_listed``: A lists the root after the removal, before its close (its view
    loses the directory's name; the open file and the directories above it stay)."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    path = "/".join(["d1", "d2"][:depth])
    async with two_cores(tmp_path, store, config) as (a, b):
        a_fs, b_fs = a.fs, b.fs
        parent = ROOT_INO
        for name in path.split("/"):
            parent = (await a_fs.mkdir(parent, name.encode(), 0o755, 0, 0)).ino
        handle, _ = await a_fs.create(parent, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        await a_fs.write(handle.fh, 0, DATA)
        await a_fs.wait_idle()
        await _remove_tree(b, path)
        if a_listed:
            await a_fs.refresh_dir(ROOT_INO, force=True)
            assert await a.names() == []
        await _close(a, handle)
        for core in (a, b):
            await core.fs.refresh_dir(ROOT_INO, force=True)
            assert await core.load(await core.resolve(f"{path}/f")) == DATA
        assert not list(store.list(REMOVED_PREFIX)), "the marks go once the tree is back"


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_directory_made_in_a_directory_another_node_removed_is_kept(
        tmp_path: Path, durability: str):
    """A's view still has d1 (B removed it since): A's mkdir d1/sub lands under d1's id,
    then a file saved in it.  Both come back with d1."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        a_fs, b_fs = a.fs, b.fs
        d1 = (await a_fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        await a_fs.wait_idle()
        await _remove_tree(b, "d1")
        sub = (await a_fs.mkdir(d1, b"sub", 0o755, 0, 0)).ino
        await a.save(sub, b"f", DATA)
        await a_fs.wait_idle()
        for core in (a, b):
            await core.fs.refresh_dir(ROOT_INO, force=True)
            assert await core.names() == ["d1"]
            assert await core.load(await core.resolve("d1/sub/f")) == DATA


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_file_closed_in_a_directory_another_node_renamed_stays_in_it(
        tmp_path: Path, durability: str):
    """B renames d1 to d2 while A's file in it is open: the file is in d2, and d1 does
    not come back (one directory id under two names would be a corrupt store)."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        a_fs, b_fs = a.fs, b.fs
        handle = await _writing_in_new_dir(a, b"d1")
        await b_fs.refresh_dir(ROOT_INO, force=True)
        await b_fs.rename(ROOT_INO, b"d1", ROOT_INO, b"d2", 0)
        await b_fs.wait_idle()
        await _close(a, handle)
        for core in (a, b):
            await core.fs.refresh_dir(ROOT_INO, force=True)
            assert await core.names() == ["d2"]
            assert await core.load(await core.resolve("d2/f")) == DATA
        assert not list(store.list(REMOVED_PREFIX))


async def test_a_rename_into_a_removed_directory_cut_short_by_a_crash_is_never_lost(
        tmp_path: Path):
    """Sync.  B removed d1; A (its view older) renames f0 into d1: its target is written,
    and the daemon dies while it looks whether d1 was removed (the state dir is copied
    while that read is held; its later calls fail, as a dead daemon's would).  Restarted
    from the image, the journal's replay finds the target written and finishes the
    rename: before decision 0028 it deleted f0 with d1 still gone, so the file was under
    no name.  Now the replay brings d1 back first."""
    store = MemoryStore(gate_limit=30)
    config = Config(durability="sync", upload_hold=0.0, store_timeout=1.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        a_fs, b_fs = a.fs, b.fs
        await a.save(ROOT_INO, b"f0", DATA)
        d1 = (await a_fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        d1_key = entry_key(ROOT_DIR_ID, b"d1")
        d1_id = Entry.from_json(store.get(d1_key)[0]).id
        assert d1_id is not None
        await _remove_tree(b, "d1")
        # After the target's PUT, the move reads d1's mark (or, before 0028, d1's entry).
        gates = [store.gate("get", prefix=p) for p in (removed_key(d1_id), d1_key)]
        async with trio.open_nursery() as nursery:
            async def rename() -> None:
                with pytest.raises(FsError):
                    await a_fs.rename(ROOT_INO, b"f0", d1, b"f0", 0)
            nursery.start_soon(rename)
            dead: list = []
            await crash_image(gates, tmp_path / "a", tmp_path / "crashed", then=lambda: dead.extend(
                store.fail(op, TransientStoreError("the daemon is dead"), times=1000)
                for op in ("put", "delete", "put_if_absent")))
    for hook in dead:
        hook.remove()
    async with open_core(tmp_path / "crashed", store, config) as fs:
        with trio.fail_after(20):
            await fs.wait_idle()
    async with open_core(tmp_path / "c", store, config) as c_fs:
        c = Core(c_fs, store)
        assert await c.names() == ["d1"]
        assert await c.load(await c.resolve("d1/f0")) == DATA



@pytest.mark.parametrize("then", ["save", "rename", "rmdir"])
async def test_an_rmdir_that_dies_between_its_claim_and_its_delete_leaves_a_usable_directory(
        tmp_path: Path, then: str):
    """B's rmdir claims d1's entry and writes its removal mark, then dies before its
    delete (every delete of d1's entry fails from then on, as a dead daemon makes
    none).  The directory stays, and stays usable: a file saved in it is kept (its
    check finds the mark with the entry still there: nothing to bring back), and once
    the claim is older than ``rename_claim_ttl`` another node may rename or remove it."""
    store = MemoryStore()
    config = Config(durability="sync", upload_hold=0.0, store_timeout=1.0,
                    rename_claim_ttl=0.5)
    async with two_cores(tmp_path, store, config) as (a, b):
        d1 = (await a.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        d1_key = entry_key(ROOT_DIR_ID, b"d1")
        d1_id = Entry.from_json(store.get(d1_key)[0]).id
        assert d1_id is not None
        await b.fs.refresh_dir(ROOT_INO, force=True)
        dead = store.fail("delete", TransientStoreError("the daemon is dead"), prefix=d1_key,
                          times=1000)
        with pytest.raises(FsError):
            await b.fs.rmdir(ROOT_INO, b"d1")
        dead.remove()
        assert Entry.from_json(store.get(d1_key)[0]).moving_to == removed_key(d1_id)
        await b.fs.refresh_dir(ROOT_INO, force=True)
        assert await b.names() == ["d1"], "a failed rmdir did not happen"
        assert list(store.list(removed_key(d1_id)))
        if then == "save":
            await a.save(d1, b"f", DATA)
            expected, path = ["d1"], "d1/f"
        else:
            await trio.sleep(0.6)     # the dead rmdir's claim is past its TTL
            if then == "rename":
                await a.save(d1, b"f", DATA)
                await a.fs.rename(ROOT_INO, b"d1", ROOT_INO, b"d2", 0)
                expected, path = ["d2"], "d2/f"
            else:
                await a.fs.rmdir(ROOT_INO, b"d1")
                expected, path = [], None
        await a.fs.wait_idle()
        async with open_core(tmp_path / "c", store, config) as c_fs:
            c = Core(c_fs, store)
            assert await c.names() == expected
            if path is not None:
                assert await c.load(await c.resolve(path)) == DATA


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_removed_directory_whose_name_and_restored_name_are_both_taken_comes_back(
        tmp_path: Path, durability: str):
    """B removed d1 while A's file in it was open, then made a new d1 and a
    ``d1.restored-<id8>`` of its own.  A's close brings the removed d1 back under the
    next free numbered name beside them (before: an ERROR line, and its entries under
    no name at all)."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        a_fs, b_fs = a.fs, b.fs
        handle = await _writing_in_new_dir(a, b"d1")
        d1_id = Entry.from_json(store.get(entry_key(ROOT_DIR_ID, b"d1"))[0]).id
        assert d1_id is not None
        await _remove_tree(b, "d1")
        taken = f"d1.restored-{d1_id[:8]}"
        await b_fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)
        await b.save(ROOT_INO, taken.encode(), b"B's own file")
        await b_fs.wait_idle()
        await _close(a, handle)
        for core in (a, b):
            await core.fs.refresh_dir(ROOT_INO, force=True)
            assert await core.names() == ["d1", taken, f"{taken}-2"]
            assert await core.load(await core.resolve(f"{taken}-2/f")) == DATA
            assert await core.load(await core.resolve(taken)) == b"B's own file"
            assert await core.names(await core.resolve("d1")) == []
        assert not list(store.list(REMOVED_PREFIX))


@pytest.mark.parametrize("killed", ["before", "after"])
async def test_an_async_rmdir_killed_after_its_claim_is_finished_after_the_restart(
        tmp_path: Path, killed: str):
    """Async (soak seed 1215043): B's rmdir of d1 answered at once; its metadata-log
    record claimed d1's entry and the daemon was SIGKILLed before the delete (``killed``:
    before or after its removal mark's PUT).  The
    restarted daemon replays the record, finds the claim live (its own, from before the
    kill), took it for another node's rename ("its rename comes first") and dropped the
    record: d1 came back on B, and stayed in the store.  A journaled rmdir must finish:
    the replay waits for the claim to end or expire, then removes d1."""
    store = MemoryStore(gate_limit=30)
    config = Config(durability="async", upload_hold=0.0, store_timeout=1.0,
                    rename_claim_ttl=1.0)
    d1_key = entry_key(ROOT_DIR_ID, b"d1")
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)
        await a.fs.wait_idle()
        d1_id = Entry.from_json(store.get(d1_key)[0]).id
        assert d1_id is not None
        await b.fs.refresh_dir(ROOT_INO, force=True)
        gate = store.gate("put", prefix=removed_key(d1_id), when=killed)
        await b.fs.rmdir(ROOT_INO, b"d1")                 # answered: journaled
        dead: list = []
        await crash_image([gate], tmp_path / "b", tmp_path / "killed", then=lambda: dead.extend(
            store.fail(op, TransientStoreError("the daemon is dead"), times=1000)
            for op in ("put", "delete", "put_if_absent")))
    for hook in dead:
        hook.remove()
    assert Entry.from_json(store.get(d1_key)[0]).moving_to == removed_key(d1_id)
    async with open_core(tmp_path / "killed", store, config) as b_fs:
        b = Core(b_fs, store)
        assert await b.names() == [], "B shows its own rmdir after the restart"
        with trio.fail_after(30):
            await b_fs.wait_idle()
        await b_fs.refresh_dir(ROOT_INO, force=True)
        assert await b.names() == []
    assert not list(store.list(d1_key)), "the journaled rmdir reached the store"
    async with open_core(tmp_path / "c", store, config) as c_fs:
        assert await Core(c_fs, store).names() == []
