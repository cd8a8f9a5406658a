"""What the kernel may keep of a file's page cache across opens (``open_flags``): the
pages of an unchanged version survive the close of the last handle (a checkpoint read
twice is read from memory the second time, not through the daemon and the cache files
again); any new version drops them."""

from __future__ import annotations

import os

import pytest

from ckptfs.meta.namespace import ROOT_INO as ROOT

pytestmark = pytest.mark.trio


async def _open_read_close(core, ino: int) -> tuple[bool, bool]:
    handle = await core.fs.open(ino, os.O_RDONLY, core.me())
    flags = core.fs.open_flags(handle)
    await core.fs.read(handle.fh, 0, 4096)
    await core.fs.release(handle.fh)
    return flags


async def test_an_unchanged_file_keeps_its_page_cache_after_the_last_close(core):
    ino = await core.save(ROOT, b"model.pt", b"a" * 10000)
    await _open_read_close(core, ino)
    assert await _open_read_close(core, ino) == (True, False)
    assert await _open_read_close(core, ino) == (True, False)


async def test_a_new_version_drops_the_page_cache(core):
    ino = await core.save(ROOT, b"model.pt", b"a" * 10000)
    await _open_read_close(core, ino)
    await core.save(ROOT, b"model.pt", b"b" * 10000)
    assert await _open_read_close(core, ino) == (False, False)
    assert await _open_read_close(core, ino) == (True, False)
