"""A sparse file reopened for writing keeps its holes on the staging disk.  Found by
fsstress (copy_file_range makes 1-2 GB sparse files; their staging copies filled the
state dir with 24 GB where ext4 held 82 MB): a reopen copied the previous version
(``copy_file_range`` writes the holes as zeros) or materialized it from its chunks
(zero chunks written out)."""

from __future__ import annotations

import os

import pytest

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, Core, me, open_core

pytestmark = pytest.mark.trio
CS = 64 << 10
HOLE = 8 << 20              # 128 chunks of zeros before the data


@pytest.fixture(params=["sync", "async"])
def core_config(request) -> dict:
    return {"durability": request.param, "chunk_size": CS, "upload_hold": 0.0}


async def save_sparse(core: Core) -> int:
    handle, inode = await core.fs.create(ROOT_INO, b"sparse", 0o644, WRITE_NEW, 0, 0, me())
    await core.fs.write(handle.fh, HOLE, b"x" * 4096)
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    await core.fs.wait_idle()
    return inode.ino


async def reopen_and_write(core: Core) -> int:
    """Open ``sparse`` for writing, change one byte, and return the working version's
    512-byte blocks on the staging disk before its close.  (Beside a reader of the
    version before, the name moves to a fresh inode for it: ``Core.open_by_name``.)"""
    handle = await core.open_by_name("sparse", os.O_RDWR)
    await core.fs.write(handle.fh, 0, b"y")
    blocks = core.fs.blocks(core.fs.getattr(handle.ino))
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    await core.fs.wait_idle()
    return blocks


def assert_sparse(blocks: int) -> None:
    assert blocks * 512 < HOLE // 4, f"{blocks * 512} bytes allocated for 4 KiB of data"


@pytest.mark.parametrize("reader", [True, False], ids=["beside a reader", "alone"])
async def test_a_sparse_file_copied_from_its_previous_version_stays_sparse(core, reader):
    """Alone, the new version is a copy of the staged one before; beside a reader of
    that one, the name moves to a fresh inode, whose new version comes from the
    chunks."""
    ino = await save_sparse(core)
    held = await core.fs.open(ino, os.O_RDONLY, me()) if reader else None
    try:
        assert_sparse(await reopen_and_write(core))
    finally:
        if held is not None:
            await core.fs.release(held.fh)
    data = await core.load(await core.resolve("sparse"))
    assert data[:1] == b"y" and data[HOLE:] == b"x" * 4096 and not any(data[1:HOLE])


async def test_a_sparse_file_from_the_store_stays_sparse(core, core_config, tmp_path):
    await save_sparse(core)
    async with open_core(tmp_path / "fresh", core.store, Config(**core_config)) as fs:
        fresh = Core(fs, core.store)
        assert_sparse(await reopen_and_write(fresh))
        data = await fresh.load(await fresh.resolve("sparse"))
        assert len(data) == HOLE + 4096
        assert data[:1] == b"y" and data[HOLE:] == b"x" * 4096 and not any(data[1:HOLE])
