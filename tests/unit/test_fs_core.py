"""The FUSE-agnostic core driven directly (no mount), over a LocalStore."""

from __future__ import annotations

import os

import trio

from ckptfs.core import Filesystem
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import LocalStore
from support.core import me, open_core


async def with_fs(tmp_path, body) -> None:
    """The core over a LocalStore, without its background tasks."""
    (tmp_path / "store").mkdir()
    async with open_core(tmp_path, LocalStore(tmp_path / "store"), run=False) as fs:
        await body(fs)


def test_create_of_a_name_that_exists_does_not_truncate_without_o_trunc(tmp_path):
    """create() may find the name already there (another node made it since the kernel's
    lookup); without O_TRUNC the existing content must survive."""
    async def body(fs: Filesystem) -> None:
        handle, inode = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                                        me())
        await fs.write(handle.fh, 0, b"0123456789")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        handle, _ = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
        await fs.write(handle.fh, 0, b"ab")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        reader = await fs.open(inode.ino, os.O_RDONLY, me())
        assert await fs.read(reader.fh, 0, 100) == b"ab23456789"
        await fs.release(reader.fh)
        handle, _ = await fs.create(ROOT_INO, b"f", 0o644,
                                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0, me())
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        assert fs.getattr(inode.ino).size == 0

    trio.run(with_fs, tmp_path, body)
