"""Which opens the kernel serves by passthrough (core/opening.py ``decide_passthrough``):
a writer of a new working version, in async mode, under --max-staged, alone on its inode
(one backing file per inode; a cached open and a passthrough open of one inode exclude
each other in the kernel, so every other open of it meanwhile is direct I/O); and what the
core reports of a file whose bytes it never sees (the staging file's size)."""

from __future__ import annotations

import errno
import os

import pytest

from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO as ROOT
from support.core import WRITE_NEW

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async"}


def _kernel_passthrough(core) -> None:
    core.fs.st.passthrough_available = lambda: True


async def test_a_new_file_is_written_by_passthrough_and_its_size_is_the_staging_files(core):
    _kernel_passthrough(core)
    handle, inode = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    assert handle.passthrough
    fd = core.fs.backing_fd(handle)
    os.pwrite(fd, b"x" * 5000, 0)           # what the kernel does, the daemon unaware
    assert core.fs.getattr(inode.ino).size == 5000
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    assert core.fs.getattr(inode.ino).size == 5000
    reader = await core.fs.open(inode.ino, os.O_RDONLY, core.me())
    assert await core.fs.read(reader.fh, 0, 10000) == b"x" * 5000
    await core.fs.release(reader.fh)


async def test_opens_beside_a_passthrough_writer_share_its_backing_file(core):
    """The kernel fails any open of an inode open for passthrough that is not
    passthrough with the same backing file: a reader of the working version and a
    second writer of the session get it too."""
    _kernel_passthrough(core)
    writer, inode = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    reader = await core.fs.open(inode.ino, os.O_RDONLY, core.me())
    second = await core.fs.open(inode.ino, os.O_WRONLY, core.me())
    assert reader.passthrough and second.passthrough
    assert core.fs.open_flags(reader) == (False, False)
    fds = {os.fstat(core.fs.backing_fd(h)).st_ino for h in (writer, reader, second)}
    assert len(fds) == 1
    for handle in (reader, second):
        await core.fs.release(handle.fh)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    assert core.fs.st.upload_gate._in_flight == 0


async def test_a_writer_beside_an_open_reader_of_the_old_version_gets_a_fresh_inode(core):
    """The reader keeps its inode (the kernel's size of it is its version's); the name
    moves to a fresh inode, whose writer is alone on it: passthrough (decision 0031)."""
    _kernel_passthrough(core)
    ino = await core.save(ROOT, b"model.pt", b"a" * 3000)
    await core.fs.wait_idle()
    reader = await core.fs.open(ino, os.O_RDONLY, core.me())
    writer = await core.open_by_name("model.pt", os.O_WRONLY | os.O_TRUNC)
    assert writer.ino != ino and writer.passthrough
    os.pwrite(core.fs.backing_fd(writer), b"b" * 2000, 0)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    assert await core.fs.read(reader.fh, 0, 10000) == b"a" * 3000
    assert core.fs.getattr(ino).size == 3000
    await core.fs.release(reader.fh)
    assert await core.load(await core.resolve("model.pt")) == b"b" * 2000


async def test_a_writer_beside_a_reader_of_a_version_not_uploaded_gets_a_fresh_inode(core):
    """The version the reader holds is not in the store yet: the name moves to a fresh
    inode that takes it over (decision 0031, addendum of stop 49), and the writer's
    open there, alone on its inode, is served by passthrough."""
    _kernel_passthrough(core)
    uploading = core.store.gate("put", prefix="chunks/")
    ino = await core.save(ROOT, b"model.pt", b"a" * 3000)
    reader = await core.fs.open(ino, os.O_RDONLY, core.me())
    with pytest.raises(FsError) as refused:
        await core.fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    assert refused.value.errno == errno.ESTALE          # the kernel opens by name again
    fresh = await core.resolve("model.pt")
    assert fresh != ino
    writer = await core.fs.open(fresh, os.O_WRONLY | os.O_TRUNC, core.me())
    assert writer.passthrough
    os.pwrite(core.fs.backing_fd(writer), b"b" * 2000, 0)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    assert await core.fs.read(reader.fh, 0, 10000) == b"a" * 3000
    await core.fs.release(reader.fh)
    uploading.release()
    await core.fs.wait_idle()
    assert await core.load(await core.resolve("model.pt")) == b"b" * 2000


async def test_a_writer_beside_a_reader_of_a_linked_version_not_uploaded_stays_on_the_daemon(
        core, monkeypatch):
    """A hard-linked file's version not in the store yet cannot move (its content is
    the shared object's): past the wait the writer goes on in place, on the daemon's
    path beside the cached reader -- which reads the file as it is from then on, as
    on a disk (its own version, through the kernel's size of the new one, was torn)."""
    from ckptfs.core import opening
    monkeypatch.setattr(opening, "PASSTHROUGH_DRAIN", 0.1)
    _kernel_passthrough(core)
    ino = await core.save(ROOT, b"model.pt", b"first")
    await core.fs.link(ino, ROOT, b"also.pt")
    await core.fs.wait_idle()
    uploading = core.store.gate("put", prefix="chunks/")
    writer = await core.fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    await core.fs.write(writer.fh, 0, b"a" * 3000)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    reader = await core.fs.open(ino, os.O_RDONLY, core.me())
    writer = await core.fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    assert writer.ino == ino and not writer.passthrough
    await core.fs.write(writer.fh, 0, b"b" * 2000)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    assert await core.fs.read(reader.fh, 0, 10000) == b"b" * 2000
    await core.fs.release(reader.fh)
    uploading.release()
    # Alone again: an O_TRUNC writer now gets passthrough.
    writer = await core.fs.open(ino, os.O_WRONLY | os.O_TRUNC, core.me())
    assert writer.passthrough
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)


async def test_a_write_open_that_keeps_the_content_stays_on_the_daemon(core):
    _kernel_passthrough(core)
    ino = await core.save(ROOT, b"model.pt", b"a" * 3000)
    handle = await core.fs.open(ino, os.O_RDWR, core.me())
    assert not handle.passthrough
    await core.fs.release(handle.fh)


async def test_past_max_staged_writers_stay_on_the_daemon_where_they_wait(core):
    _kernel_passthrough(core)
    core.fs.writes.max_staged = -1          # any staged byte is over it
    handle, _ = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    assert not handle.passthrough
    await core.fs.release(handle.fh)


async def test_without_the_kernels_passthrough_every_open_is_the_daemons(core):
    handle, _ = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    assert not handle.passthrough
    assert core.fs.backing_fd(handle) == -1
    await core.fs.release(handle.fh)


@pytest.mark.parametrize("core_config", [{"durability": "sync"}])
async def test_sync_mode_keeps_writes_on_the_daemon(core):
    """Sync mode's close and fsync upload what the write path pipelined while the
    bytes came in: with passthrough the daemon would see none of them."""
    _kernel_passthrough(core)
    handle, _ = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    assert not handle.passthrough
    await core.fs.release(handle.fh)


async def test_a_passthrough_writer_holds_background_uploads_until_it_closes(core):
    _kernel_passthrough(core)
    handle, _ = await core.fs.create(ROOT, b"model.pt", 0o644, WRITE_NEW, 0, 0, core.me())
    gate = core.fs.st.upload_gate
    assert gate.active()
    await core.fs.flush(handle.fh)
    await core.fs.release(handle.fh)
    assert gate._in_flight == 0
