"""A file held open in a directory that another node removes (its listing showed the
directory empty: the file had no entry yet) is published at its close under that
directory's id.  Its close answered success, and then no node showed it (and gc collects
entries under no directory).  Now the publish finds the directory gone and brings it
back, with its parents, under the same id: the saved file is never lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core

pytestmark = pytest.mark.trio

DATA = b"saved while its directory went " * 100


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("depth", [1, 2])
async def test_a_file_closed_in_a_directory_another_node_removed_is_kept(
        tmp_path: Path, durability: str, depth: int):
    store = MemoryStore(gate_limit=30)
    config = Config(durability=durability, upload_hold=0.0)
    names = [b"d1", b"d2"][:depth]
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        parent = ROOT_INO
        for name in names:
            parent = (await a_fs.mkdir(parent, name, 0o755, 0, 0)).ino
        handle, _ = await a_fs.create(parent, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        await a_fs.write(handle.fh, 0, DATA)
        await a_fs.wait_idle()
        # B removes the tree, deepest first (rm -r): every directory lists empty there.
        await b_fs.refresh_dir(ROOT_INO, force=True)
        path = "/".join(n.decode() for n in names)
        for cut in range(depth, 0, -1):
            d = "/".join(path.split("/")[:cut])
            head, _, last = d.rpartition("/")
            await b_fs.rmdir(await b.resolve(head) if head else ROOT_INO, last.encode())
        await b_fs.wait_idle()
        await a_fs.flush(handle.fh)
        await a_fs.release(handle.fh)
        await a_fs.wait_idle()
        for core in (a, b):
            await core.fs.refresh_dir(ROOT_INO, force=True)
            assert await core.load(await core.resolve(f"{path}/f")) == DATA
