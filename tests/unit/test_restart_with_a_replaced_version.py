"""A closed version that a later save replaced, still on disk when the daemon stopped
(a reader or an upload held it): the next start called it "open for writing when the
daemon stopped" and kept a copy of it under abandoned/ for good -- a hostile run found
24 MB per replaced save of a torch checkpoint piling up, each with that WARNING.  Now a
version older than the file's closed one is dropped at the start (nothing can read it
after a restart), and only a version newer than it -- a save that never closed -- is
kept aside."""

from __future__ import annotations

import logging
import os

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, me, open_core

pytestmark = pytest.mark.trio


async def test_a_replaced_version_is_dropped_and_an_unclosed_one_kept(tmp_path, caplog,
                                                                     monkeypatch):
    """(A hard-linked file's save beside a reader of a version not uploaded yet goes on
    in place: any other file's moves to a fresh inode, decision 0031.)"""
    from ckptfs.core import opening
    monkeypatch.setattr(opening, "PASSTHROUGH_DRAIN", 0.1)
    store = MemoryStore()
    config = Config(durability="async")
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT_INO, b"latest.pt", b"0")
        await fs.link(ino, ROOT_INO, b"also.pt")
        await fs.wait_idle()
        uploading = store.gate("put", prefix="chunks/", times=1000)
        assert await core.save(ROOT_INO, b"latest.pt", b"1" * 5000) == ino
        reader = await fs.open(ino, os.O_RDONLY, me())          # holds version 1
        await core.save(ROOT_INO, b"latest.pt", b"2" * 5000)    # replaces it
        other = await core.save(ROOT_INO, b"other.pt", b"o" * 100)
        writer = await fs.open(other, os.O_WRONLY | os.O_TRUNC, me())
        await fs.write(writer.fh, 0, b"never closed")
        before = {i: fs.st.staging.versions_of(i) for i in (ino, other)}
        assert len(before[ino]) == 2 and len(before[other]) == 2, before
        assert reader.fh and writer.fh        # the daemon stops with both open
        uploading.release()
    caplog.clear()
    caplog.set_level(logging.INFO)
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        assert await core.load(ino) == b"2" * 5000
        assert await core.load(other) == b"o" * 100
        assert len(fs.st.staging.versions_of(ino)) == 1, "the replaced version went"
        kept = os.listdir(tmp_path / "a" / "abandoned")
        assert [k.rpartition("-")[2].partition(".")[0] for k in kept] == [str(other)], kept
        said = [r.getMessage() for r in caplog.records if "open for writing" in
                r.getMessage()]
        assert len(said) == 1 and f"{other}." in said[0], said
