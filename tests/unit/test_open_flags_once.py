"""Opening for read answers the kernel in one call: the core's ``open`` decides the
page-cache flags (keep_cache, direct_io; see test_page_cache_flags.py for which) and
the FUSE adapter passes them on without asking again."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from ckptfs.core.state import Handle
from ckptfs.fuse.ops import FuseOps
from ckptfs.meta.namespace import ROOT_INO as ROOT
from ckptfs.procstat import Opener

pytestmark = pytest.mark.trio


async def test_open_decides_the_cache_flags(core):
    ino = await core.save(ROOT, b"model.pt", b"a" * 10000)
    first = await core.fs.open(ino, os.O_RDONLY, core.me())
    await core.fs.release(first.fh)
    again = await core.fs.open(ino, os.O_RDONLY, core.me())
    assert (again.keep_cache, again.direct_io) == (True, False)
    # A save beside it moves the name to a fresh inode (decision 0031): its first
    # reader keeps no pages (none are the fresh inode's yet), and `again` keeps its own.
    await core.save(ROOT, b"model.pt", b"b" * 10000)
    newer = await core.open_by_name("model.pt", os.O_RDONLY)
    assert newer.ino != ino and (newer.keep_cache, newer.direct_io) == (False, False)
    await core.fs.release(again.fh)
    await core.fs.release(newer.fh)


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "upload_hold": 0.0}


async def test_a_reader_beside_a_save_in_place_and_a_later_one_read_one_version(
        core, monkeypatch):
    """The save could not move the name (its version before, of a hard-linked file,
    was not uploaded yet: it went on in place past the wait).  The reader beside it
    reads the file as it is, as on a disk -- kept on its version, its reads were cut
    at the kernel's size of the new one (stop 50) -- so it and a reader opened after
    read one version, and share the page cache."""
    from ckptfs.core import opening
    monkeypatch.setattr(opening, "PASSTHROUGH_DRAIN", 0.1)
    ino = await core.save(ROOT, b"model.pt", b"first")
    await core.fs.link(ino, ROOT, b"also.pt")
    await core.fs.wait_idle()
    uploading = core.store.gate("put", prefix="chunks/")
    assert await core.save(ROOT, b"model.pt", b"a" * 10000) == ino
    old = await core.fs.open(ino, os.O_RDONLY, core.me())
    await core.save(ROOT, b"model.pt", b"b" * 10000)
    newer = await core.fs.open(ino, os.O_RDONLY, core.me())
    assert not newer.direct_io, "one version: no reader needs direct I/O"
    assert await core.fs.read(old.fh, 0, 20000) == b"b" * 10000
    assert await core.fs.read(newer.fh, 0, 20000) == b"b" * 10000
    await core.fs.release(old.fh)
    await core.fs.release(newer.fh)
    uploading.release()


class _OneCallCore:
    """A core that only answers ``open``: any second question is an error."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def open(self, ino: int, flags: int, opener: Opener) -> Handle:
        self.calls.append("open")
        handle = Handle(fh=7, ino=ino, opener=opener, writable=False)
        handle.keep_cache, handle.direct_io = True, False
        return handle


async def test_the_adapter_opens_with_one_call():
    fs = _OneCallCore()
    ops = FuseOps(fs, "/control", ttl=1.0)    # type: ignore[arg-type]
    info = await ops.open(5, os.O_RDONLY, SimpleNamespace(pid=os.getpid()))
    assert (info.fh, info.keep_cache, info.direct_io) == (7, True, False)
    assert fs.calls == ["open"]
