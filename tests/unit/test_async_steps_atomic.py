"""Async mode: a rename or an unlink is its local change and its metadata-log record in
ONE commit.  They were two: on a full state dir the second could fail after the first
landed -- an unlink answered ENOSPC while its log record went on to delete the file in
the store, a rename answered ENOSPC while the name had moved here and the store was
never told (found by a review of the reload fix)."""

from __future__ import annotations

import json
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from support.core import open_core
from test_state_dir_full import DISK_FULL, closed_file, commit_fails


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
