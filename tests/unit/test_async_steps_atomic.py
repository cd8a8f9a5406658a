"""Async mode: a rename or an unlink is its local change and its metadata-log record in
ONE commit.  They were two: on a full state dir the second could fail after the first
landed -- an unlink answered ENOSPC while its log record went on to delete the file in
the store, a rename answered ENOSPC while the name had moved here and the store was
never told (found by a review of the reload fix)."""

from __future__ import annotations

import errno
import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.core.state import RENAME_EXCHANGE
from ckptfs.procstat import Opener
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from ckptfs.store.faults import FaultInjectingStore, FaultPlan, FaultRule
from support.core import open_core
from test_state_dir_full import DISK_FULL, closed_file, commit_fails
from test_state_dir_reserve import read_all


def run(tmp_path, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "state", store, Config(durability="async")) as fs:
            await body(fs, store)
    trio.run(main)


@pytest.mark.parametrize("failing", ["journal_add", "move"])
def test_a_rename_that_fails_to_commit_happens_nowhere(tmp_path, failing):
    async def body(fs, store) -> None:
        await closed_file(fs, b"f0", b"checkpoint")
        with commit_fails(fs.ns, failing, error=DISK_FULL), pytest.raises(FsError):
            await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
        await fs.wait_idle()
        assert fs.ns.lookup(ROOT_INO, b"f1") is None
        assert fs.ns.lookup(ROOT_INO, b"f0") is not None
        assert store.get("dirs/root/f0")[0]
        with pytest.raises(NotFound):
            store.get("dirs/root/f1")
        await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)     # and then it can
        await fs.wait_idle()
        assert store.get("dirs/root/f1")[0]
        with pytest.raises(NotFound):
            store.get("dirs/root/f0")
    run(tmp_path, body)


@pytest.mark.parametrize("failing", ["journal_add", "unlink"])
def test_an_unlink_that_fails_to_commit_removes_nothing(tmp_path, failing):
    async def body(fs, store) -> None:
        ino = await closed_file(fs, b"f0", b"checkpoint")
        with commit_fails(fs.ns, failing, error=DISK_FULL), pytest.raises(FsError):
            await fs.unlink(ROOT_INO, b"f0")
        await fs.wait_idle()
        assert fs.ns.lookup(ROOT_INO, b"f0") == ino
        assert store.get("dirs/root/f0")[0]
        await fs.unlink(ROOT_INO, b"f0")                         # and then it can
        await fs.wait_idle()
        with pytest.raises(NotFound):
            store.get("dirs/root/f0")
    run(tmp_path, body)


def test_a_chmod_that_fails_to_commit_changes_nothing(tmp_path):
    async def body(fs, store) -> None:
        ino = await closed_file(fs, b"f0", b"checkpoint")
        mode = fs.getattr(ino).mode
        with commit_fails(fs.ns, "journal_add", error=DISK_FULL), pytest.raises(FsError):
            await fs.setattr(ino, mode=0o600)
        assert fs.getattr(ino).mode == mode
        await fs.wait_idle()
        assert json.loads(store.get("dirs/root/f0")[0])["mode"] == mode
        await fs.setattr(ino, mode=0o600)                        # and then it can
        await fs.wait_idle()
        assert json.loads(store.get("dirs/root/f0")[0])["mode"] == 0o600
    run(tmp_path, body)


# symlink, mknod and link were audited after the fixes above (stop 39): each made its
# local change, its log record and its parent's times in separate commits.


def _absent(store, key: str) -> bool:
    try:
        store.get(key)
    except NotFound:
        return True
    return False


async def _make(fs, kind: str, name: bytes) -> None:
    if kind == "symlink":
        await fs.symlink(ROOT_INO, name, b"target", 0, 0)
    else:
        await fs.mknod(ROOT_INO, name, 0o010644, 0, 0, 0)       # a FIFO


@pytest.mark.parametrize("failing", ["journal_add", "save"])
@pytest.mark.parametrize("kind", ["symlink", "mknod"])
def test_a_new_name_that_fails_to_commit_is_made_nowhere(tmp_path, kind, failing):
    async def body(fs, store) -> None:
        # "save": the parent's new times are the failing write.
        with commit_fails(fs.ns, failing, lambda *a: failing != "save" or a[0].ino == ROOT_INO,
                          error=DISK_FULL), pytest.raises(FsError):
            await _make(fs, kind, b"n0")
        assert fs.ns.lookup(ROOT_INO, b"n0") is None
        await fs.wait_idle()
        assert _absent(store, "dirs/root/n0")
        await _make(fs, kind, b"n0")                             # and then it can
        await fs.wait_idle()
        assert store.get("dirs/root/n0")[0]
    run(tmp_path, body)


@pytest.mark.parametrize("failing", ["add_name", "save"])
@pytest.mark.parametrize("published", [True, False])
def test_a_hard_link_that_fails_to_commit_is_made_nowhere(tmp_path, published, failing):
    async def body(fs, store) -> None:
        if published:
            ino = await closed_file(fs, b"f0", b"checkpoint")
            handle = None
        else:
            handle, inode = await fs.create(ROOT_INO, b"f0", 0o644, os.O_WRONLY | os.O_CREAT,
                                            0, 0, Opener.from_tid(os.getpid()))
            ino = inode.ino
            await fs.write(handle.fh, 0, b"checkpoint")
        with commit_fails(fs.ns, failing, lambda *a: failing != "save" or a[0].ino == ROOT_INO,
                          error=DISK_FULL), pytest.raises(FsError):
            await fs.link(ino, ROOT_INO, b"f1")
        assert fs.ns.lookup(ROOT_INO, b"f1") is None
        assert fs.getattr(ino).nlink == 1
        if handle is not None:
            await fs.flush(handle.fh)
            await fs.release(handle.fh)
        await fs.wait_idle()
        assert _absent(store, "dirs/root/f1")
        await fs.link(ino, ROOT_INO, b"f1")                      # and then it can
        await fs.wait_idle()
        assert store.get("dirs/root/f1")[0]
        assert fs.getattr(ino).nlink == 2
    run(tmp_path, body)


@pytest.mark.parametrize("failing", ["store", "save"])
@pytest.mark.parametrize("kind", ["symlink", "mknod"])
def test_a_sync_new_name_that_fails_is_made_nowhere(tmp_path, kind, failing):
    """Sync mode: the name is here before its PUT; a refused PUT takes it and the
    parent's new times back; so does a PUT that landed but could not be recorded here
    (its entry is deleted again)."""
    async def main() -> None:
        plan = FaultPlan(rules=[FaultRule(op="put", prefix="dirs/root/n0", kind="denied")]
                         if failing == "store" else [])
        store = FaultInjectingStore(MemoryStore(), plan)
        async with open_core(tmp_path / "state", store, Config(durability="sync")) as fs:
            before = fs.getattr(ROOT_INO).mtime_ns
            with commit_fails(fs.ns, "save", lambda inode, *a: failing == "save" and
                              inode.name == b"n0", error=DISK_FULL), pytest.raises(FsError):
                await _make(fs, kind, b"n0")
            assert fs.ns.lookup(ROOT_INO, b"n0") is None
            assert fs.getattr(ROOT_INO).mtime_ns == before
            assert _absent(store, "dirs/root/n0")
            plan.rules.clear()
            await _make(fs, kind, b"n0")                         # and then it can
            assert store.get("dirs/root/n0")[0]
            assert fs.getattr(ROOT_INO).mtime_ns > before
    trio.run(main)


@pytest.mark.parametrize("op", ["unlink", "rmdir", "rename", "exchange"])
def test_a_sync_change_the_store_made_stands_when_it_fails_to_commit_here(tmp_path, op):
    """Sync mode: once the store has removed or moved the name, the change has happened
    (the store holds the truth): a local record that fails to commit (a full disk) must
    not answer ENOSPC -- the caller would believe a removed checkpoint is still there --
    and the node shows the store's state at its next lookup.  Before: ENOSPC, the name
    still here, gone from the store."""
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "state", store, Config(durability="sync")) as fs:
            if op == "rmdir":
                await fs.mkdir(ROOT_INO, b"f0", 0o755, 0, 0)
            else:
                await closed_file(fs, b"f0", b"checkpoint")
            if op == "exchange":
                await closed_file(fs, b"f1", b"other")
            failing = {"rename": "move", "exchange": "exchange"}.get(op, "unlink")
            with commit_fails(fs.ns, failing, error=DISK_FULL):
                if op == "exchange":
                    await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", RENAME_EXCHANGE)
                elif op == "rename":
                    await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
                elif op == "rmdir":
                    await fs.rmdir(ROOT_INO, b"f0")
                else:
                    await fs.unlink(ROOT_INO, b"f0")
            if op == "exchange":
                for name, data in ((b"f0", b"other"), (b"f1", b"checkpoint")):
                    inode = await fs.lookup(ROOT_INO, name)
                    assert await read_all(fs, inode.ino) == data
                return
            assert _absent(store, "dirs/root/f0")
            with pytest.raises(FsError) as gone:
                await fs.lookup(ROOT_INO, b"f0")
            assert gone.value.errno == errno.ENOENT
            if op == "rename":
                assert store.get("dirs/root/f1")[0]
                moved = await fs.lookup(ROOT_INO, b"f1")
                assert await read_all(fs, moved.ino) == b"checkpoint"
    trio.run(main)
