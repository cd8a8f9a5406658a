"""The daemon dies while a reader holds the version a fresh inode took over (decision
0031, stop 49: the fresh inode's staging file is a hard link of the reader's).  The
restart keeps a version that belongs to no inode under ``abandoned/`` for ``ckptfs gc``
-- but this one is a second name of bytes still staged for the fresh inode: it kept
nothing a name could lose, and once the fresh inode's version was replaced it held those
bytes on disk until gc's grace ran out (7-19 MB per kill in hostile run H).  A version
whose staging file has another name is dropped; one with no other name is still kept
(``test_restart_after_a_replaced_version_was_held``)."""

from __future__ import annotations

import logging
import os

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, kill_image, open_core
from test_save_beside_a_reader_of_a_version_not_uploaded import (ASYNC, open_a_save_beside,
                                                                 owed_beside_a_reader)
from test_save_beside_a_reader_on_its_node import OLD

pytestmark = pytest.mark.trio


async def test_a_version_whose_bytes_have_another_staged_name_is_dropped(tmp_path, caplog):
    """The next save is under way (opened without ``O_TRUNC``: its own copy), and the
    reader has gone while the old inode's upload, in flight, still holds its staging
    file -- one file with two names, the fresh inode's closed version and the old
    inode's.  Then the daemon dies."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await owed_beside_a_reader(core, store)
        acted, writer = await open_a_save_beside(core, old, os.O_WRONLY)   # no O_TRUNC
        await fs.release(reader.fh)
        assert fs.ns.maybe_get(old) is None, "the reader's inode went with its reader"
        assert fs.staging.versions_of(old), "(the upload in flight holds its version)"
        kill_image(tmp_path / "a", tmp_path / "killed")    # the daemon dies here
        await fs.release(writer.fh)
        uploading.release()
    killed = tmp_path / "killed"
    linked = [p for p in (killed / "staging").rglob("*") if p.is_file()
              and p.stat().st_nlink > 1]
    assert linked, "the hand-over shares the staging file (the case this test is about)"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ckptfs"):
        async with open_core(killed, store, ASYNC) as fs:
            restarted = Core(fs, store)
            assert await restarted.load(await restarted.resolve("f0")) == OLD
            with trio.fail_after(30):
                await fs.wait_idle()
    kept = [(p.name, p.stat().st_nlink) for p in (killed / "abandoned").iterdir()]
    assert [name for name, _ in kept if f"-{acted}." in name], \
        "the unclosed save's own copy is kept (as any write the daemon died in)"
    assert not [k for k in kept if k[1] > 1], \
        f"a second name of staged bytes kept under abandoned/: {kept}"
    assert any("another name" in r.getMessage() for r in caplog.records), \
        "the drop is not said"
