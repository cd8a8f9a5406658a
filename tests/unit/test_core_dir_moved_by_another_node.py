"""A directory another node renamed or moved while this node holds work in it.

Node B has a file open in ``d0`` (never closed, so no node but B knows it); node A
renames ``d0`` to ``d1`` or moves it into another directory.  B must show its open file
under the new path at once (POSIX on the node that holds it: the file is in the directory
whatever the directory is called now), and every node shows it there after B closes it.

Before: B's listing took ``d1`` for a new directory and forgot ``d0`` with the open file
under it, so B's own open file was under no name until its close (soak seed 1215015).
Now the listing moves B's inode for the directory to its new name (``Refresh._move_here``),
and a directory that vanished keeps itself and the names above B's work until the
listing of its new place takes it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, reached, two_cores

pytestmark = pytest.mark.trio

DATA = b"held open while its directory moved " * 500


async def _listed(core: Core, path: str) -> None:
    """Force listings of ``path``'s directories, root first (B learns of the move)."""
    await core.fs.refresh_dir(ROOT_INO, force=True)
    ino = ROOT_INO
    for part in [p for p in path.split("/") if p]:
        ino = (await core.fs.lookup(ino, part.encode())).ino
        await core.fs.refresh_dir(ino, force=True)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("opened_in", ["root", "d0", "d0/sub"])
@pytest.mark.parametrize("new_path", ["d1", "p/d1"])
async def test_a_file_held_open_follows_its_directory_renamed_by_another_node(
        tmp_path: Path, durability: str, opened_in: str, new_path: str):
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        d0 = (await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)).ino
        await a.fs.mkdir(d0, b"sub", 0o755, 0, 0)
        await a.fs.mkdir(ROOT_INO, b"p", 0o755, 0, 0)
        await a.fs.wait_idle()
        await _listed(b, "d0/sub")
        start = await b.resolve(opened_in) if opened_in != "root" else ROOT_INO
        handle, opened = await b.fs.create(start, b"f1", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.write(handle.fh, 0, DATA)
        where = await b.resolve("d0/sub" if opened_in == "d0/sub" else "d0")
        await b.fs.rename(start, b"f1", where, b"f2", 0)   # a name only B knows yet
        await b.fs.wait_idle()
        await _listed(a, "d0/sub")
        target_dir, _, target_name = new_path.rpartition("/")
        await a.fs.rename(ROOT_INO, b"d0", await a.resolve(target_dir) if target_dir
                          else ROOT_INO, target_name.encode(), 0)
        await a.fs.wait_idle()
        inner = new_path + ("/sub" if opened_in == "d0/sub" else "")

        await _listed(b, inner)
        assert "d0" not in await b.names()
        ino = await b.resolve(f"{inner}/f2")
        assert ino == opened.ino
        assert await b.load(ino) == DATA, "B shows its own open file under the new name"

        await b.fs.flush(handle.fh)
        await b.fs.release(handle.fh)
        await b.fs.wait_idle()
        for core in (a, b):
            await _listed(core, inner)
            assert "d0" not in await core.names()
            assert await core.load(await core.resolve(f"{inner}/f2")) == DATA


@pytest.mark.parametrize("new_path", ["d1", "p/d1"])
async def test_a_closed_file_waiting_to_publish_follows_its_directory(
        tmp_path: Path, new_path: str):
    """Async: B closed d0/f and its publish is uploading (held); A renames or moves d0;
    B's listing learns of it.  The publish then lands in the directory's new place.
    Before, the listing deleted B's inode of d0, and the publish failed with ENOENT
    (the parent inode) and was retried forever: closed, never published, and
    ``ckptfs wait`` never done."""
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)
        await a.fs.mkdir(ROOT_INO, b"p", 0o755, 0, 0)
        await a.fs.wait_idle()
        await _listed(b, "d0")
        uploading = store.gate("put", prefix=CHUNKS_PREFIX)
        await b.save(await b.resolve("d0"), b"f", DATA)
        await reached(uploading)
        await _listed(a, "d0")
        target_dir, _, target_name = new_path.rpartition("/")
        await a.fs.rename(ROOT_INO, b"d0", await a.resolve(target_dir) if target_dir
                          else ROOT_INO, target_name.encode(), 0)
        await a.fs.wait_idle()
        await _listed(b, new_path)
        assert await b.load(await b.resolve(f"{new_path}/f")) == DATA
        uploading.release()
        with trio.fail_after(10):
            await b.fs.wait_idle()
        for core in (a, b):
            await _listed(core, new_path)
            assert "d0" not in await core.names()
            assert await core.load(await core.resolve(f"{new_path}/f")) == DATA


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_moved_directory_kept_for_work_is_dropped_at_the_next_mount_once_idle(
        tmp_path: Path, durability: str):
    """B kept ``d0`` under no name for its open file (A moved it into ``p``, and B never
    lists ``p``).  Once the file is closed and published, the nameless directory holds
    nothing B still owes the store: the next mount drops it (and what is below it) from
    B's metadata -- it used to stay there for good.  The store still has it all."""
    from support.core import open_core
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with open_core(tmp_path / "a", store, config) as a_fs:
        a = Core(a_fs, store)
        async with open_core(tmp_path / "b", store, config) as b_fs:
            b = Core(b_fs, store)
            d0 = (await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)).ino
            await a.fs.mkdir(ROOT_INO, b"p", 0o755, 0, 0)
            await a.fs.wait_idle()
            await _listed(b, "d0")
            handle, _ = await b.fs.create(await b.resolve("d0"), b"f", 0o644, WRITE_NEW,
                                          0, 0, b.me())
            await b.fs.write(handle.fh, 0, DATA)
            await a.fs.rename(ROOT_INO, b"d0", await a.resolve("p"), b"d1", 0)
            await a.fs.wait_idle()
            await b.fs.refresh_dir(ROOT_INO, force=True)
            assert await b.names() == ["p"]
            await b.fs.flush(handle.fh)
            await b.fs.release(handle.fh)
            await b.fs.wait_idle()
            nameless = [i.ino for i in b.fs.st.ns.all_inodes()
                        if i.type == "dir" and not i.parent and i.ino != ROOT_INO]
            assert nameless, "B kept d0 under no name while its file was open"
        async with open_core(tmp_path / "b", store, config) as b_fs:
            b = Core(b_fs, store)
            await b.fs.wait_idle()
            left = [(i.ino, i.type) for i in b.fs.st.ns.all_inodes()
                    if not i.parent and i.ino != ROOT_INO]
            assert left == [], "nameless inodes stayed in B's metadata"
            await _listed(b, "p/d1")
            assert await b.load(await b.resolve("p/d1/f")) == DATA
        await _listed(a, "p/d1")
        assert await a.load(await a.resolve("p/d1/f")) == DATA


async def test_a_moved_directory_kept_for_a_publish_still_owed_stays_through_a_mount(
        tmp_path: Path):
    """Async: B's file in the nameless ``d0`` is closed but its publish has not reached
    the store when B unmounts.  The next mount keeps the directory (its publish is owed)
    and the publish lands under the directory's id: the file is at ``p/d1/f``."""
    from support.core import open_core
    from ckptfs.store import TransientStoreError
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0)
    async with open_core(tmp_path / "a", store, config) as a_fs:
        a = Core(a_fs, store)
        async with open_core(tmp_path / "b", store, config) as b_fs:
            b = Core(b_fs, store)
            await a.fs.mkdir(ROOT_INO, b"d0", 0o755, 0, 0)
            await a.fs.mkdir(ROOT_INO, b"p", 0o755, 0, 0)
            await a.fs.wait_idle()
            await _listed(b, "d0")
            handle, opened = await b.fs.create(await b.resolve("d0"), b"f", 0o644,
                                               WRITE_NEW, 0, 0, b.me())
            await b.fs.write(handle.fh, 0, DATA)
            await a.fs.rename(ROOT_INO, b"d0", await a.resolve("p"), b"d1", 0)
            await a.fs.wait_idle()
            await b.fs.refresh_dir(ROOT_INO, force=True)
            down = [store.fail(op, TransientStoreError("store away"), times=100_000)
                    for op in ("put", "put_if_absent", "exists")]
            await b.fs.flush(handle.fh)
            await b.fs.release(handle.fh)
            await trio.sleep(0.3)
            assert b.fs.getattr(opened.ino).dirty, "the publish is still owed"
        for hook in down:
            hook.remove()
        async with open_core(tmp_path / "b", store, config) as b_fs:
            b = Core(b_fs, store)
            with trio.fail_after(30):
                await b.fs.wait_idle()
            await _listed(b, "p/d1")
            assert await b.load(await b.resolve("p/d1/f")) == DATA
        await _listed(a, "p/d1")
        assert await a.load(await a.resolve("p/d1/f")) == DATA


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("old,new", [("d0", "d1"), ("d1", "d0")])
async def test_a_file_held_open_follows_its_directory_when_its_old_name_is_made_again(
        tmp_path: Path, durability: str, old: str, new: str):
    """Another node renames the directory and makes a new one under the old name: one
    listing shows both names, the old one with another directory id.  B's inode of the
    directory moves to the new name with B's open file in it; the old name is the new,
    empty directory (model test, two nodes: mkdir d1, B opens d1/f0, A renames d1 to d0
    and makes d1 again -- B showed d0 empty until its close)."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        await a.fs.mkdir(ROOT_INO, old.encode(), 0o755, 0, 0)
        await a.fs.wait_idle()
        await _listed(b, old)
        held_dir = await b.resolve(old)
        handle, opened = await b.fs.create(held_dir, b"f0", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.write(handle.fh, 0, DATA)
        await _listed(a, old)
        await a.fs.rename(ROOT_INO, old.encode(), ROOT_INO, new.encode(), 0)
        await a.fs.mkdir(ROOT_INO, old.encode(), 0o755, 0, 0)
        await a.fs.wait_idle()

        await _listed(b, new)
        assert await b.resolve(new) == held_dir, "B's directory inode moved to the new name"
        assert await b.resolve(f"{new}/f0") == opened.ino
        assert await b.load(opened.ino) == DATA
        await _listed(b, old)
        assert await b.names(await b.resolve(old)) == []

        await b.fs.flush(handle.fh)
        await b.fs.release(handle.fh)
        await b.fs.wait_idle()
        for core in (a, b):
            await _listed(core, new)
            await _listed(core, old)
            assert await core.load(await core.resolve(f"{new}/f0")) == DATA
            assert await core.names(await core.resolve(old)) == []


async def _names_or_error(core: Core, path: str) -> list[str] | str:
    try:
        return await core.names(await core.resolve(path))
    except Exception as exc:   # what the user would see: an errno, not a listing
        return repr(exc)


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("listed_first", ["root", "the moved-into directory"])
async def test_a_chain_of_directory_moves_by_another_node_shows_its_tree(
        tmp_path: Path, durability: str, listed_first: str):
    """B knows ``d0`` (dir X, holding ``d0``) and ``d1`` (dir Y, holding ``d1``).  A
    moves X over ``d1/d1`` and then Y to ``d0``: the tree is ``d0/d1/d0``.  B's listing
    of the root moved its inode of Y onto the name ``d0`` its inode of X still thought
    it held; moving X later (into Y) then took the root's ``d0`` with it.  B listed
    ``d0`` as ``[d1]`` and answered ENOENT for ``d0/d1`` (soak seed 1215343 logged
    ``corrupt entry b'd0'`` at every listing)."""
    store = MemoryStore()
    config = Config(durability=durability, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        x = (await b.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        await b.fs.rename(ROOT_INO, b"d1", ROOT_INO, b"d0", 0)
        await b.fs.mkdir(x, b"d0", 0o755, 0, 0)
        y = (await b.fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        await b.fs.mkdir(y, b"d1", 0o755, 0, 0)
        await b.fs.wait_idle()
        await _listed(a, "d1/d1")
        await _listed(a, "d0/d0")
        a_y = await a.resolve("d1")
        await a.fs.rename(ROOT_INO, b"d0", a_y, b"d1", 0)
        await a.fs.rename(ROOT_INO, b"d1", ROOT_INO, b"d0", 0)
        await a.fs.wait_idle()
        if listed_first == "root":
            await b.fs.refresh_dir(ROOT_INO, force=True)
            await b.fs.refresh_dir(y, force=True)
        else:
            await b.fs.refresh_dir(y, force=True)
            await b.fs.refresh_dir(ROOT_INO, force=True)
        await _listed(b, "d0/d1/d0")
        for core in (a, b):
            assert await _names_or_error(core, "") == ["d0"]
            assert await _names_or_error(core, "d0") == ["d1"]
            assert await _names_or_error(core, "d0/d1") == ["d0"]
            assert await _names_or_error(core, "d0/d1/d0") == []
