"""Reading behind a passthrough writer (core/readbehind.py, issue 23): the daemon sees no
writes, yet a writer's complete chunks reach the store while it still writes; a chunk
changed after its early upload (a header patched in place) is hashed again at publish,
sent again under its new id, and the entry names only ids of the bytes it publishes."""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.format.chunkid import chunk_id
from ckptfs.format.remote import chunk_key
from ckptfs.meta.namespace import ROOT_INO as ROOT
from support.core import WRITE_NEW

pytestmark = pytest.mark.trio

CHUNK = 64 << 10


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "chunk_size": CHUNK, "upload_hold": 0.0}


async def _until(predicate, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


def _ids(data: bytes) -> list[str]:
    return [chunk_id(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]


async def test_complete_chunks_upload_before_close_and_a_changed_one_again_at_publish(core):
    core.fs.st.passthrough_available = lambda: True
    handle, inode = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    assert handle.passthrough
    fd = core.fs.backing_fd(handle)
    data = bytearray(os.urandom(4 * CHUNK + 100))
    os.pwrite(fd, data, 0)                  # the kernel writes; the daemon never sees it
    early = _ids(bytes(data[:4 * CHUNK]))
    # The store has a chunk a moment before its uploader counts it (the PUT's thread
    # returns first): wait for both.
    await _until(lambda: all(chunk_key(c) in core.store.keys() for c in early)
                 and core.fs.st.uploader.stats.chunks_uploaded >= 4)
    assert core.fs.st.uploader.stats.chunks_uploaded == 4    # the partial tail waits
    # Patched in place after its upload, as torch's zip writer patches a header.
    data[CHUNK + 10:CHUNK + 20] = b"P" * 10
    os.pwrite(fd, b"P" * 10, CHUNK + 10)
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    await core.fs.wait_idle()
    published = [sha for sha, _ in core.fs.st.ns.get(inode.ino).chunks]
    assert published == _ids(bytes(data))
    assert chunk_key(published[1]) in core.store.keys()
    stats = core.fs.st.uploader.stats
    assert (stats.chunks_reverified, stats.chunks_changed_after_upload) == (4, 1)
    assert await core.load(inode.ino) == bytes(data)


async def test_chunks_held_until_the_close_are_read_once(core):
    """Early uploads the gate held while the writer wrote (the default upload_hold) read
    the closed bytes: nothing to hash again at publish."""
    core.fs.st.passthrough_available = lambda: True
    core.fs.st.upload_gate.hold = 3600.0
    handle, inode = await core.fs.create(ROOT, b"held.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    fd = core.fs.backing_fd(handle)
    data = bytearray(os.urandom(3 * CHUNK))
    os.pwrite(fd, data, 0)
    await _until(lambda: len(core.fs.st.runtime[inode.ino].session.tracker.pending) == 3)
    data[5:9] = b"late"
    os.pwrite(fd, b"late", 5)
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    await core.fs.wait_idle()
    assert [sha for sha, _ in core.fs.st.ns.get(inode.ino).chunks] == _ids(bytes(data))
    stats = core.fs.st.uploader.stats
    assert (stats.chunks_uploaded, stats.chunks_reverified) == (3, 0)
