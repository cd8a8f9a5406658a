"""The daemon dies while an upload holds the staged version of a file a rename replaced
(hostile run G: after each daemon kill, the restart logged 8-10 WARNINGs that a staging
version "was open for writing when the daemon stopped", for files nobody had open for
writing: the replaced ``latest.pt`` versions whose uploads were under way).  Such
a version belongs to no inode: the restart keeps it under ``abandoned/`` and says so at
INFO, in words that fit; the WARNING stays for a version that was open for writing."""

from __future__ import annotations

import logging
import os

import pytest
import trio

from ckptfs.core import Config, linger
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, kill_image, open_core, reached

pytestmark = pytest.mark.trio


async def test_a_replaced_version_an_upload_held_is_no_unclosed_write(tmp_path, caplog,
                                                                     monkeypatch):
    monkeypatch.setattr(linger, "REPLACED_LINGER", 0.0)    # (it goes at once)
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0)
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        uploading = store.gate("put", prefix="chunks/")
        ino = await core.save(ROOT_INO, b"latest.pt", b"the version before " * 300)
        await reached(uploading)
        await core.save(ROOT_INO, b"tmp", b"the new version " * 300)
        await fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"latest.pt", 0)
        with trio.fail_after(10):
            while fs.ns.maybe_get(ino) is not None:
                await trio.sleep(0.01)       # the replaced inode goes
        assert fs.staging.versions_of(ino), "its upload holds its staged version"
        kill_image(tmp_path / "a", tmp_path / "killed")    # the daemon dies here
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptfs"):
        async with open_core(tmp_path / "killed", store, config) as fs:
            restarted = Core(fs, store)
            assert await restarted.load(await restarted.resolve("latest.pt")) == \
                b"the new version " * 300
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "open for writing" in w], warnings
    assert any(f"staging version {ino}." in r.getMessage() and "belongs to no inode"
               in r.getMessage() for r in caplog.records), "the kept version is not said"
    assert list((tmp_path / "killed" / "abandoned").iterdir()), "kept under abandoned/"
