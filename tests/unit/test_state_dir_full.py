"""A full LMDB map is ENOSPC to mkdir and create, and a failed operation has no effect
anywhere: not in the namespace, not in the store, not journaled (issue item 9)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator

import lmdb
import pytest
import trio

from ckptfs.core import Config, Filesystem
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.meta.reserve import RoomReserve
from ckptfs.procstat import Opener
from ckptfs.store import LocalStore
from support.core import open_core
from support.posix import fill_file_system


async def with_fs(tmp_path, durability: str, body) -> None:
    """The core over a LocalStore whose namespace has a tiny LMDB map."""
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store")
    async with open_core(tmp_path, store, Config(durability=durability),
                         map_size=256 << 10) as fs:
        await body(fs, store)


def store_names(store: LocalStore) -> set[str]:
    return {obj.key.rsplit("/", 1)[-1] for obj in store.list("") if "/d" in obj.key}


async def closed_file(fs: Filesystem, name: bytes, data: bytes) -> int:
    """A new file of ``data``, closed and published; its inode."""
    handle, _ = await fs.create(ROOT_INO, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                                Opener.from_tid(os.getpid()))
    await fs.write(handle.fh, 0, data)
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    await fs.wait_idle()
    ino = fs.ns.lookup(ROOT_INO, name)
    assert ino is not None
    return ino


# What LMDB raises when the disk under the state dir is full (the map may have room).
DISK_FULL = lmdb.Error("mdb_txn_commit: No space left on device")


@contextlib.contextmanager
def commit_fails(ns, method: str, when: Callable[..., bool] = lambda *args: True,
                 error: Exception | None = None) -> Iterator[None]:
    """``ns.<method>`` writes, then its transaction fails as on a full LMDB map (or
    with ``error``, e.g. ``DISK_FULL``) when ``when(*args)``: inside a caller's
    ``batch``, that whole batch fails."""
    real = getattr(ns, method)

    def fails(*args, **kwargs):
        with ns.batch():
            result = real(*args, **kwargs)
            if when(*args):
                raise error or lmdb.MapFullError("injected: the map is full")
        return result

    setattr(ns, method, fails)
    try:
        yield
    finally:
        delattr(ns, method)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_mkdir_on_a_full_lmdb_map_is_enospc_and_leaves_nothing(tmp_path, durability):
    async def body(fs: Filesystem, store: LocalStore) -> None:
        made: list[bytes] = []
        with pytest.raises(FsError) as info:
            for i in range(100_000):
                name = f"d{i:06d}".encode()
                await fs.mkdir(ROOT_INO, name, 0o755, 0, 0)
                made.append(name)
        assert info.value.errno == errno.ENOSPC, info.value
        failed = f"d{len(made):06d}".encode()
        assert fs.ns.lookup(ROOT_INO, failed) is None
        journaled = {r.get("name") for _, r in fs.ns.journal()}
        assert failed.hex() not in journaled
        assert len(fs.oplog.pending) == len([n for n in made if n.hex() in journaled])
        # Space again: the failed name can be made, the others exist.
        fs.ns.env.set_mapsize(64 << 20)
        await fs.mkdir(ROOT_INO, failed, 0o755, 0, 0)
        with pytest.raises(FsError) as again:
            await fs.mkdir(ROOT_INO, made[-1], 0o755, 0, 0)
        assert again.value.errno == errno.EEXIST
        await fs.wait_idle()
        in_store = {n for n in store_names(store) if n.startswith("d")}
        assert len(in_store) == len(made) + 1
        assert len(made) > 10

    trio.run(with_fs, tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_create_on_a_full_lmdb_map_is_enospc_and_leaves_nothing(tmp_path, durability):
    async def body(fs: Filesystem, store: LocalStore) -> None:
        me = Opener.from_tid(os.getpid())
        made = 0
        with pytest.raises(FsError) as info:
            for i in range(100_000):
                handle, _ = await fs.create(ROOT_INO, f"f{i:06d}".encode(), 0o644,
                                            os.O_WRONLY | os.O_CREAT, 0, 0, me)
                made += 1
                try:
                    await fs.flush(handle.fh)
                finally:
                    with contextlib.suppress(FsError):  # as the kernel: release follows
                        await fs.release(handle.fh)
        assert info.value.errno == errno.ENOSPC, info.value
        if fs.ns.lookup(ROOT_INO, f"f{made - 1:06d}".encode()) is None:
            made -= 1       # the create failed, not a later close
        failed = f"f{made:06d}".encode()
        assert fs.ns.lookup(ROOT_INO, failed) is None
        assert len(fs.handles) == 0
        fs.ns.env.set_mapsize(64 << 20)
        handle, _ = await fs.create(ROOT_INO, failed, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                                    me)
        await fs.write(handle.fh, 0, b"after")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        assert made > 10

    trio.run(with_fs, tmp_path, durability, body)


def test_an_lmdb_io_error_on_a_nearly_full_disk_is_out_of_space():
    """LMDB reports a short write (a nearly full disk) as EIO, not ENOSPC: the model
    test's full tmpfs state dir made ``mkdir`` answer EIO and leave its store entry
    behind (seed 101).  EIO with room left stays an I/O error."""
    from ckptfs.meta.lmdbtxn import NEARLY_FULL, out_of_space
    eio = lmdb.Error("mdb_txn_commit: Input/output error")
    assert out_of_space(eio, free=4096)
    assert out_of_space(eio, free=NEARLY_FULL - 1)
    assert not out_of_space(eio, free=NEARLY_FULL * 4)
    assert not out_of_space(eio, free=None)
    assert out_of_space(lmdb.Error("mdb_put: No space left on device"), free=None)
    assert not out_of_space(lmdb.Error("mdb_get: Invalid argument"), free=0)


def test_a_close_whose_commit_fails_keeps_the_closed_version_and_the_new_bytes(tmp_path):
    """Async mode commits a close in one LMDB transaction (the new version and its
    pending publish).  When that commit fails, the close is ENOSPC and nothing of it
    took effect: the file still reads as its last closed version, whose staging file
    is still there, and the new bytes are kept aside for ``ckptfs gc``, not deleted."""
    async def body(fs: Filesystem, store: LocalStore) -> None:
        me = Opener.from_tid(os.getpid())
        ino = await closed_file(fs, b"f", b"first version")
        handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, me)
        await fs.write(handle.fh, 0, b"second version")
        with commit_fails(fs.ns, "publish_pending_add"), pytest.raises(FsError) as info:
            await fs.flush(handle.fh)
        assert info.value.errno == errno.ENOSPC, info.value
        await fs.release(handle.fh)

        reader = await fs.open(ino, os.O_RDONLY, me)
        assert await fs.read(reader.fh, 0, 100) == b"first version"
        await fs.release(reader.fh)
        assert fs.ns.publish_pending() == {}
        kept = [p.read_bytes() for p in (tmp_path / "abandoned").rglob("*") if p.is_file()]
        assert b"second version" in kept, kept
        await fs.wait_idle()
        assert fs.ns.get(ino).size == len(b"first version")

    trio.run(with_fs, tmp_path, "async", body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_truncate_whose_commit_fails_changes_nothing_and_the_next_one_lands(
        tmp_path, durability):
    """A truncate of a file nobody has open is a new closed version of its own.  When
    its commit fails, the truncate is ENOSPC and its working version ends with it: the
    next truncate is a change of its own again, committed and published (review of
    stop 36: it was left in the first one's working version, never closed, never
    published, while it answered success)."""
    async def body(fs: Filesystem, store: LocalStore) -> None:
        me = Opener.from_tid(os.getpid())
        ino = await closed_file(fs, b"f", b"first version")
        first_ver = fs.ns.get(ino).ver
        new_version = lambda *inodes: any(i.ino == ino and i.ver != first_ver  # noqa: E731
                                          for i in inodes)
        with commit_fails(fs.ns, "save", new_version), pytest.raises(FsError) as info:
            await fs.setattr(ino, size=5)
        assert info.value.errno == errno.ENOSPC, info.value
        assert fs.ns.get(ino).size == len(b"first version")

        await fs.setattr(ino, size=3)
        await fs.wait_idle()
        inode = fs.ns.get(ino)
        assert inode.ver != first_ver and inode.size == 3 and not inode.dirty, inode
        reader = await fs.open(ino, os.O_RDONLY, me)
        assert await fs.read(reader.fh, 0, 100) == b"fir"
        await fs.release(reader.fh)
        assert fs.ns.publish_pending() == {}

    trio.run(with_fs, tmp_path, durability, body)


def test_a_pointer_whose_close_fails_does_not_hold_its_next_version_back(tmp_path):
    """A checkpoint pointer (DeepSpeed's ``latest``) naming a staged directory is held
    until that directory is sealed.  When the close that would hold it fails, nothing
    is held: the pointer's next version, naming nothing staged, publishes at once
    (review of stop 36: the hold stayed in memory, and the next version was never
    queued or journaled)."""
    async def body(fs: Filesystem, store: LocalStore) -> None:
        me = Opener.from_tid(os.getpid())

        async def save(name: bytes, data: bytes) -> None:
            ino = fs.ns.lookup(ROOT_INO, name)
            if ino is None:
                handle, _ = await fs.create(ROOT_INO, name, 0o644,
                                            os.O_WRONLY | os.O_CREAT, 0, 0, me)
            else:
                handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, me)
            await fs.write(handle.fh, 0, data)
            try:
                await fs.flush(handle.fh)
            finally:
                await fs.release(handle.fh)

        await save(b"latest", b"nothing")
        await fs.wait_idle()
        await fs.mkdir(ROOT_INO, b"global_step1", 0o755, 0, 0)
        with commit_fails(fs.ns, "meta_put"), pytest.raises(FsError) as info:
            await save(b"latest", b"global_step1")
        assert info.value.errno == errno.ENOSPC, info.value

        await save(b"latest", b"global_step9")    # names nothing staged here
        with trio.fail_after(20):
            await fs.wait_idle()
        ino = fs.ns.lookup(ROOT_INO, b"latest")
        assert ino is not None and not fs.ns.get(ino).dirty
        assert fs.ns.publish_pending() == {}

    trio.run(with_fs, tmp_path, "async", body)


def test_a_failed_batch_runs_its_undo_calls_and_a_committed_one_its_after_calls(tmp_path):
    """``Transactions.on_rollback`` and ``after_commit``: a batch that fails undoes the
    in-memory changes made beside it (latest first) and runs none of its after-commit
    work; a batch that commits runs its after-commit work and none of its undo calls;
    outside a batch, after-commit work runs at once and an undo call is not kept."""
    ns = Namespace(tmp_path / "meta")
    seen: list[str] = []
    with pytest.raises(FsError):
        with ns.batch():
            ns.meta_put("k", "1")
            ns.on_rollback(lambda: seen.append("undo first"))
            ns.after_commit(lambda: seen.append("after"))
            with ns.batch():                          # nested: the same transaction
                ns.on_rollback(lambda: seen.append("undo second"))
            raise lmdb.MapFullError("injected")
    assert seen == ["undo second", "undo first"]
    assert ns.meta_get("k") is None
    seen.clear()
    with ns.batch():
        ns.meta_put("k", "2")
        ns.on_rollback(lambda: seen.append("undo"))
        ns.after_commit(lambda: seen.append("after"))
    assert seen == ["after"] and ns.meta_get("k") == "2"
    seen.clear()
    ns.on_rollback(lambda: seen.append("undo"))
    ns.after_commit(lambda: seen.append("after at once"))
    with ns.batch():
        ns.meta_put("k", "3")
    assert seen == ["after at once"]
    ns.close()


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_create_whose_commit_fails_leaves_no_name_and_no_staging_file(
        tmp_path, durability):
    """A create is one LMDB commit (inode, name) around its staging file.  When the
    commit fails, the create is ENOSPC and leaves nothing: no name, no staging file;
    the next create (which may get the same inode number) works."""
    async def body(fs: Filesystem, store: LocalStore) -> None:
        me = Opener.from_tid(os.getpid())
        staged_before = set(fs.staging.versions())
        with commit_fails(fs.ns, "attach"), pytest.raises(FsError) as info:
            await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me)
        assert info.value.errno == errno.ENOSPC, info.value
        assert fs.ns.lookup(ROOT_INO, b"f") is None
        assert set(fs.staging.versions()) == staged_before
        assert len(fs.handles) == 0

        handle, _ = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                                    me)
        await fs.write(handle.fh, 0, b"after")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        await fs.wait_idle()
        ino = fs.ns.lookup(ROOT_INO, b"f")
        reader = await fs.open(ino, os.O_RDONLY, me)
        assert await fs.read(reader.fh, 0, 100) == b"after"
        await fs.release(reader.fh)

    trio.run(with_fs, tmp_path, durability, body)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@contextlib.contextmanager
def small_tmpfs(directory, mib: int) -> Iterator[None]:
    """``directory`` is a tmpfs of ``mib`` MiB until the block ends."""
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(directory)],
                   check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


@needs_root
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_new_file_whose_write_failed_on_a_full_disk_leaves_no_name(tmp_path, durability):
    """Another program fills the state dir's disk while a new file is written: the write
    and the close are ENOSPC, and the file that never had a closed version is gone --
    although its removal is itself an LMDB commit on that full disk (soak seed 1215133
    showed it left as an empty name).  The state dir's reserve is given up for it, the
    log and ``status`` say so, and it is taken again once the disk has room."""
    state = tmp_path / "state"

    async def body() -> None:
        with small_tmpfs(state, 16):
            (tmp_path / "store").mkdir()
            store = LocalStore(tmp_path / "store")
            reserve = RoomReserve(state / "reserve")
            async with open_core(state, store, Config(durability=durability),
                                 reserve=reserve) as fs:
                assert reserve.arm()
                await closed_file(fs, b"kept", b"k" * 5000)
                handle, _ = await fs.create(ROOT_INO, b"new", 0o644,
                                            os.O_WRONLY | os.O_CREAT, 0, 0,
                                            Opener.from_tid(os.getpid()))
                fill_file_system(state)
                with pytest.raises(FsError) as info:
                    await fs.write(handle.fh, 0, b"x" * (1 << 20))
                assert info.value.errno == errno.ENOSPC, info.value
                # Whether LMDB finds free pages for the removal on a full disk depends
                # on its free list: here it finds none while the reserve is held.
                with commit_fails(fs.ns, "unlink", when=lambda *args: reserve.held(),
                                  error=DISK_FULL), pytest.raises(FsError) as info:
                    await fs.flush(handle.fh)
                assert info.value.errno == errno.ENOSPC, info.value
                await fs.release(handle.fh)

                assert fs.ns.lookup(ROOT_INO, b"new") is None
                assert b"new" not in [n for n, _ in await fs.listdir(ROOT_INO)]
                assert fs.stats()["state_dir_reserve"] == "given up: the disk was full"

                os.unlink(state / "filler")
                handle, _ = await fs.create(ROOT_INO, b"after", 0o644,
                                            os.O_WRONLY | os.O_CREAT, 0, 0,
                                            Opener.from_tid(os.getpid()))
                await fs.write(handle.fh, 0, b"after")
                await fs.flush(handle.fh)
                await fs.release(handle.fh)
                await fs.wait_idle()
                assert fs.stats()["state_dir_reserve"] == "held"
                assert (state / "reserve").stat().st_size == reserve.size

    trio.run(body)


def test_a_removal_whose_commit_fails_leaves_the_callers_inode_named(tmp_path):
    """The caller's inode object keeps its names when an unlink or a move fails to
    commit: they are still on disk, and a removal tried again must find them."""
    ns = Namespace(tmp_path / "meta")
    root = ns.get(ROOT_INO)
    inode = ns.reserve_inode("file", 0o644, 0, 0)
    ns.attach(inode, root, b"f")
    for method, call in (("unlink", lambda: ns.unlink(inode, all_names=True)),
                         ("move", lambda: ns.move(inode, ROOT_INO, b"g"))):
        with commit_fails(ns, method), pytest.raises(FsError):
            call()
        assert (inode.parent, inode.name) == (ROOT_INO, b"f"), method
        assert ns.lookup(ROOT_INO, b"f") == inode.ino
    ns.unlink(inode, all_names=True)
    assert ns.lookup(ROOT_INO, b"f") is None and inode.parent == 0
    ns.close()
