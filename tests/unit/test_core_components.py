"""The core's components, each driven through the ``Filesystem`` façade over the
in-memory store (no FUSE): names, attributes and xattrs, the write and read paths, the
close and its publish, renames, seals, the refresh of another node's changes, recovery
at restart, status.  Every test runs in sync and async durability unless it names one.

Knows the façade's public methods (those ``fuse/ops.py`` and the control socket call)
and the tests/support helpers; nothing of the concern classes behind the façade, so it
holds through rewrites of ``ckptfs/core/`` internals.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.checkpoints import check_complete
from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, Core, me, open_core

pytestmark = pytest.mark.trio
CS = 64 << 10                       # small chunks: a few hundred KiB spans many
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


@pytest.fixture(params=["sync", "async"])
def core_config(request) -> dict:
    return {"durability": request.param, "chunk_size": CS, "metadata_ttl": 0.0,
            "stale_wait": 0.5}


def config_of(core: Core) -> Config:
    return Config(durability=core.fs.config.durability, chunk_size=CS, metadata_ttl=0.0,
                  stale_wait=0.5)


async def errno_of(call) -> int:
    with pytest.raises(FsError) as info:
        await call
    return info.value.errno


async def other_node(core: Core, tmp_path, name: str = "other"):
    """Another node over the same store (after this node's work reached it), with the
    daemon's structural check of closed checkpoints."""
    await core.fs.wait_idle()
    return open_core(tmp_path / name, core.store, config_of(core),
                     check_complete=check_complete)


# --------------------------------------------------------------------------- names


async def test_names_lookup_mkdir_rmdir_unlink_and_their_errors(core):
    fs = core.fs
    d = await fs.mkdir(ROOT_INO, b"dir", 0o755, 0, 0)
    assert (await fs.lookup(ROOT_INO, b"dir")).ino == d.ino
    assert (await fs.lookup(d.ino, b".")).ino == d.ino
    assert (await fs.lookup(d.ino, b"..")).ino == ROOT_INO
    assert await errno_of(fs.lookup(ROOT_INO, b"x" * 256)) == errno.ENAMETOOLONG
    assert await errno_of(fs.lookup(ROOT_INO, b"missing")) == errno.ENOENT
    assert await errno_of(fs.mkdir(ROOT_INO, b"dir", 0o755, 0, 0)) == errno.EEXIST
    f = await core.save(d.ino, b"f", b"data")
    assert await errno_of(fs.rmdir(ROOT_INO, b"dir")) == errno.ENOTEMPTY
    assert await errno_of(fs.rmdir(d.ino, b"f")) == errno.ENOTDIR
    assert await errno_of(fs.unlink(ROOT_INO, b"dir")) == errno.EISDIR
    assert await core.names(d.ino) == ["f"]
    assert fs.nlink(fs.getattr(f)) == 1
    await fs.unlink(d.ino, b"f")
    assert await core.names(d.ino) == []
    await fs.rmdir(ROOT_INO, b"dir")
    assert await core.names() == []
    assert fs.statvfs().f_bsize > 0


async def test_symlinks_special_files_and_hard_links(core, tmp_path):
    fs = core.fs
    link = await fs.symlink(ROOT_INO, b"latest", b"checkpoint-9", 0, 0)
    assert fs.readlink(link.ino) == b"checkpoint-9"
    fifo = await fs.mknod(ROOT_INO, b"fifo", stat.S_IFIFO | 0o640, 0, 0, 0)
    assert stat.S_ISFIFO(fs.getattr(fifo.ino).mode | stat.S_IFIFO)
    empty = await fs.mknod(ROOT_INO, b"empty", stat.S_IFREG | 0o644, 0, 0, 0)
    assert fs.getattr(empty.ino).size == 0
    ino = await core.save(ROOT_INO, b"a", b"shared bytes")
    await fs.link(ino, ROOT_INO, b"b")
    assert fs.nlink(fs.getattr(ino)) == 2
    assert await core.load((await fs.lookup(ROOT_INO, b"b")).ino) == b"shared bytes"
    assert await core.names() == ["a", "b", "empty", "fifo", "latest"]
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        assert await other.names() == ["a", "b", "empty", "fifo", "latest"]
        assert fs2.readlink(await other.resolve("latest")) == b"checkpoint-9"
        assert await other.load(await other.resolve("b")) == b"shared bytes"
    await fs.unlink(ROOT_INO, b"a")
    assert await core.load((await fs.lookup(ROOT_INO, b"b")).ino) == b"shared bytes"


# --------------------------------------------------------------------------- attributes


async def test_setattr_chmod_chown_utimens_truncate_and_xattrs(core, tmp_path):
    fs = core.fs
    ino = await core.save(ROOT_INO, b"f", b"0123456789")
    await fs.setattr(ino, mode=0o600, uid=7, gid=8, mtime_ns=1_000_000_000,
                     atime_ns=2_000_000_000)
    attrs = fs.getattr(ino)
    assert (attrs.mode & 0o777, attrs.uid, attrs.gid) == (0o600, 7, 8)
    await fs.setattr(ino, size=4)
    assert await core.load(ino) == b"0123"
    await fs.setattr(ino, size=8)
    assert await core.load(ino) == b"0123\0\0\0\0"
    await fs.setxattr(ino, b"user.step", b"42")
    assert fs.getxattr(ino, b"user.step") == b"42"
    assert b"user.step" in fs.listxattr(ino)
    await fs.setxattr(ino, b"user.step", None)
    assert await errno_of(_sync(fs.getxattr, ino, b"user.step")) == errno.ENODATA
    await fs.setxattr(ino, b"user.kept", b"yes")
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        seen = await other.resolve("f")
        assert await other.load(seen) == b"0123\0\0\0\0"
        assert fs2.getattr(seen).mode & 0o777 == 0o600
        assert fs2.getxattr(seen, b"user.kept") == b"yes"


async def _sync(fn, *args):
    return fn(*args)


async def test_truncate_through_an_open_handle(core):
    fs = core.fs
    handle, inode = await fs.create(ROOT_INO, b"t", 0o644, WRITE_NEW, 0, 0, me())
    await fs.write(handle.fh, 0, b"x" * (3 * CS))
    await fs.setattr(inode.ino, size=CS + 5, fh=handle.fh)
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    assert await core.load(inode.ino) == b"x" * (CS + 5)


# --------------------------------------------------------------------------- write, read


async def test_writes_at_offsets_sparse_and_appending_over_many_chunks(core, tmp_path):
    fs = core.fs
    data = bytearray(os.urandom(5 * CS + 123))
    handle, inode = await fs.create(ROOT_INO, b"w", 0o644, WRITE_NEW, 0, 0, me())
    for off in range(0, len(data), 10_000):                  # sequential pieces
        await fs.write(handle.fh, off, bytes(data[off:off + 10_000]))
    await fs.write(handle.fh, 7 * CS, b"tail")                # a hole before it
    data += bytes(7 * CS - len(data)) + b"tail"
    await fs.fsync(handle.fh, False)
    assert await fs.read(handle.fh, CS - 2, 4) == bytes(data[CS - 2:CS + 2])
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    appender = await fs.open(inode.ino, os.O_WRONLY | os.O_APPEND, me())
    await fs.write(appender.fh, len(data), b"!")
    data += b"!"
    await fs.flush(appender.fh)
    await fs.release(appender.fh)
    assert await core.load(inode.ino) == bytes(data)
    await fs.wait_idle()
    assert fs.state_of(inode.ino) == "published"
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        ino2 = await other.resolve("w")
        reader = await fs2.open(ino2, os.O_RDONLY, me())
        assert isinstance(fs2.open_flags(reader), tuple)
        got = b"".join([await fs2.read(reader.fh, off, 4096)
                        for off in range(0, len(data), 4096)])   # a sequential reader
        assert got == bytes(data)
        assert await fs2.read(reader.fh, 3 * CS + 7, 100) == bytes(data[3 * CS + 7:3 * CS + 107])
        assert await fs2.read(reader.fh, len(data) + 10, 10) == b""
        await fs2.release(reader.fh)
        warmed: list[int] = []
        await fs2.warm(fs2.getattr(ino2), warmed.append)
        assert sum(warmed) > 0
        assert fs2.stats()


async def test_a_reader_keeps_the_version_it_opened(core):
    fs = core.fs
    ino = await core.save(ROOT_INO, b"v", b"A" * (2 * CS))
    reader = await fs.open(ino, os.O_RDONLY, me())
    await core.save(ROOT_INO, b"v", b"B" * (3 * CS))
    assert await fs.read(reader.fh, 0, 4 * CS) == b"A" * (2 * CS)
    await fs.release(reader.fh)
    assert await core.load(await core.resolve("v")) == b"B" * (3 * CS)


async def test_overwrite_without_trunc_keeps_the_rest_and_a_rewrite_keeps_the_inode(core):
    fs = core.fs
    ino = await core.save(ROOT_INO, b"f", b"0123456789")
    handle = await fs.open(ino, os.O_WRONLY, me())
    await fs.write(handle.fh, 2, b"ab")
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    assert await core.load(ino) == b"01ab456789"
    assert await core.save(ROOT_INO, b"f", b"new") == ino
    assert await core.load(ino) == b"new"


async def test_a_failed_close_check_keeps_the_previous_version(core, tmp_path):
    """A structurally incomplete checkpoint (a safetensors file cut short) is EIO at
    close and never replaces the version before it (the daemon's format check, given
    to this node's constructor)."""
    await core.save(ROOT_INO, b"model.safetensors", b"plain bytes v1")
    async with await other_node(core, tmp_path, "checked") as fs:
        node = Core(fs, core.store)
        ino = await node.resolve("model.safetensors")
        handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, me())
        await fs.write(handle.fh, 0, struct.pack("<Q", 1000) + b'{"a": ')  # cut short
        assert await errno_of(fs.flush(handle.fh)) == errno.EIO
        await fs.release(handle.fh)
        await fs.wait_idle()
        assert await node.load(ino) == b"plain bytes v1"
    await core.fs.refresh_dir(ROOT_INO, force=True)
    assert await core.load(await core.resolve("model.safetensors")) == b"plain bytes v1"


async def test_the_close_check_takes_a_pickle_by_its_name_too(core, tmp_path):
    """Bytes that merely begin like a pickle (0x80, 2, an opcode; here random-looking
    data, as ``os.urandom`` gives 1 time in 61 000) close fine under a name no pickle
    writer uses; under ``.pkl`` they are a pickle cut short: EIO (found by CI)."""
    data = b"\x80\x02}" + bytes(range(1, 200)) * 20 + b"\x01"
    async with await other_node(core, tmp_path, "checked") as fs:
        node = Core(fs, core.store)
        ino = await node.save(ROOT_INO, b"g", data)
        assert await node.load(ino) == data
        handle, _ = await fs.create(ROOT_INO, b"state.pkl", 0o644, WRITE_NEW, 0, 0, me())
        await fs.write(handle.fh, 0, data)
        assert await errno_of(fs.flush(handle.fh)) == errno.EIO
        await fs.release(handle.fh)


# --------------------------------------------------------------------------- renames


async def test_renames_of_files_and_directories_with_their_flags(core, tmp_path):
    fs = core.fs
    tmp = await fs.mkdir(ROOT_INO, b"tmp-3", 0o755, 0, 0)
    await core.save(tmp.ino, b"model.bin", b"weights")
    await core.save(ROOT_INO, b"a", b"A")
    await core.save(ROOT_INO, b"b", b"B")
    assert await errno_of(fs.rename(ROOT_INO, b"a", ROOT_INO, b"b",
                                    RENAME_NOREPLACE)) == errno.EEXIST
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", RENAME_EXCHANGE)
    assert await core.load(await core.resolve("a")) == b"B"
    await fs.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)                  # over a file
    assert await core.names() == ["b", "tmp-3"]
    assert await core.load(await core.resolve("b")) == b"B"
    await fs.rename(ROOT_INO, b"tmp-3", ROOT_INO, b"step-3", 0)        # a directory
    d = await fs.mkdir(ROOT_INO, b"sub", 0o755, 0, 0)
    await fs.rename(ROOT_INO, b"b", d.ino, b"b2", 0)                   # across dirs
    assert await errno_of(fs.rename(ROOT_INO, b"nope", ROOT_INO, b"x", 0)) == errno.ENOENT
    assert await core.names() == ["step-3", "sub"]
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        assert await other.names() == ["step-3", "sub"]
        assert await other.load(await other.resolve("step-3/model.bin")) == b"weights"
        assert await other.load(await other.resolve("sub/b2")) == b"B"


# --------------------------------------------------------------------------- seals


async def test_a_checkpoint_directory_is_hidden_until_sealed(core, tmp_path):
    fs = core.fs
    ck = await fs.mkdir(ROOT_INO, b"checkpoint-1", 0o755, 0, 0)
    await core.save(ck.ino, b"model.bin", b"w" * 1000)
    assert await core.names() == []                                    # staged
    assert (await fs.lookup(ROOT_INO, b"checkpoint-1")).ino == ck.ino   # by its name
    assert fs.state_of(ck.ino)
    assert await fs.seal(ck.ino)
    await fs.wait_idle()
    assert await core.names() == ["checkpoint-1"]
    ck2 = await fs.mkdir(ROOT_INO, b"checkpoint-2", 0o755, 0, 0)
    await core.save(ck2.ino, b"model.bin", b"v" * 1000)
    await core.save(ck2.ino, b"trainer_state.json", b'{"global_step": 2}')  # the mark
    await fs.wait_idle()
    assert await core.names() == ["checkpoint-1", "checkpoint-2"]
    files, _ = await fs.files_under(fs.getattr(ROOT_INO))
    assert len(files) == 3
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        assert await other.names() == ["checkpoint-1", "checkpoint-2"]
        assert await other.names(await other.resolve("checkpoint-2")) == [
            "model.bin", "trainer_state.json"]


# --------------------------------------------------------------------------- refresh


async def test_another_nodes_changes_arrive_by_refresh(core, tmp_path):
    fs = core.fs
    await core.save(ROOT_INO, b"keep", b"1")
    await core.save(ROOT_INO, b"gone", b"2")
    d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    await core.save(d.ino, b"inner", b"3")
    async with await other_node(core, tmp_path) as fs2:
        other = Core(fs2, core.store)
        assert await other.names() == ["d", "gone", "keep"]
        assert await other.load(await other.resolve("d/inner")) == b"3"
        await fs.unlink(ROOT_INO, b"gone")
        await core.save(ROOT_INO, b"keep", b"one")
        await core.save(ROOT_INO, b"new", b"4")
        await fs.rename(ROOT_INO, b"d", ROOT_INO, b"e", 0)
        await fs.wait_idle()
        await fs2.refresh_dir(ROOT_INO, force=True)
        assert await other.names() == ["e", "keep", "new"]
        assert await other.load(await other.resolve("keep")) == b"one"
        assert await other.load(await other.resolve("e/inner")) == b"3"


# --------------------------------------------------------------------------- recovery


async def test_a_restarted_node_keeps_what_it_closed_while_the_store_was_away(tmp_path):
    """Async mode: files closed while every PUT fails stay staged across a restart,
    and the restarted node publishes them."""
    from ckptfs.store import MemoryStore
    store = MemoryStore(gate_limit=30)
    config = Config(durability="async", chunk_size=CS, metadata_ttl=0.0, stale_wait=0.5)
    broken = store.fail("put", ConnectionError("store away"), times=-1)
    with trio.move_on_after(5):
        async with open_core(tmp_path / "a", store, config) as fs:
            node = Core(fs, store)
            d = await fs.mkdir(ROOT_INO, b"run", 0o755, 0, 0)
            await node.save(d.ino, b"step.bin", b"s" * (2 * CS + 1))
            assert fs.pending_uploads() >= 1
            assert fs.unfinished() >= 1
            assert fs.state_of(await node.resolve("run/step.bin")) != "published"
    broken.remove()
    async with open_core(tmp_path / "a", store, config) as fs:
        await fs.wait_idle()
        node = Core(fs, store)
        assert await node.load(await node.resolve("run/step.bin")) == b"s" * (2 * CS + 1)
        assert fs.pending_uploads() == 0 and fs.store_unavailable() is None
    async with open_core(tmp_path / "b", store, config) as fs2:
        other = Core(fs2, store)
        assert await other.load(await other.resolve("run/step.bin")) == b"s" * (2 * CS + 1)
