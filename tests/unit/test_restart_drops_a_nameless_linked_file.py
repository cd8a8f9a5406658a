"""A hard-linked file left under no name on this node when the daemon stopped -- its
last name here replaced by a rename while a reader held it (``linger.py``) -- is
dropped at the next start, with its local copy, like any file under no name that
owes nothing.  Found by a review: recovery skipped files with a link id, and their
records and staging files stayed for good."""

from __future__ import annotations

import os

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, kill_image, open_core

pytestmark = pytest.mark.trio


async def test_a_nameless_linked_file_is_dropped_at_the_restart(tmp_path):
    store = MemoryStore()
    config = Config(durability="async")
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT_INO, b"f0", b"linked " * 100)
        await fs.link(ino, ROOT_INO, b"f1")
        await fs.wait_idle()
        reader = await fs.open(ino, os.O_RDONLY, core.me())
        await fs.unlink(ROOT_INO, b"f1")
        await core.save(ROOT_INO, b"tmp", b"new " * 100)
        await fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"f0", 0)
        await fs.wait_idle()
        gone = fs.ns.get(ino)
        assert not gone.names and gone.link_id
        kill_image(tmp_path / "a", tmp_path / "killed")     # the daemon dies here
        await fs.release(reader.fh)
    async with open_core(tmp_path / "killed", store, config) as fs:
        assert fs.ns.maybe_get(ino) is None, "its record stayed for good"
        assert not fs.staging.versions_of(ino), "its local copy stayed for good"
        assert await Core(fs, store).load(await Core(fs, store).resolve("f0")) == \
            b"new " * 100
