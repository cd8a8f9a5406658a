"""The daemon dies while a file is being written in a directory that has no name left
here (another node moved it away and this node keeps it for the work in it,
``Refresh._forget_subtree``).  Recovery records the path of each writer the stop cut
off (``CoreState.cut_off``, stop 50) -- and a path through a nameless directory raised
ENOENT out of recovery: the daemon would not start.  Found rereading the change."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, kill_image, open_core

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("saved_before", [False, True], ids=["new file", "saved before"])
async def test_a_restart_with_a_cut_off_writer_below_a_nameless_directory_starts(
        tmp_path, saved_before: bool):
    store = MemoryStore()
    config = Config(durability="async")
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        if saved_before:
            ino = await core.save(d.ino, b"f", b"the version before")
            writer = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
        else:
            writer, _ = await fs.create(d.ino, b"f", 0o644, WRITE_NEW, 0, 0, core.me())
        await fs.write(writer.fh, 0, b"half of a save")
        fs.ns.unlink(fs.ns.get(d.ino))      # (moved away by another node: kept nameless)
        kill_image(tmp_path / "a", tmp_path / "killed")    # the daemon dies here
    with trio.fail_after(30):
        async with open_core(tmp_path / "killed", store, config) as fs:
            fs.restore_leases()
            assert fs.st.cut_off, "the writer the stop cut off is recorded"
