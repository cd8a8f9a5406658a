"""A writer meeting a lingering passthrough reader moves the name to a fresh inode and
answers ESTALE (decision 0019, "Built (stop 42)"); what reaches the old inode through a
dentry the kernel kept answers ESTALE too, and the VFS retries it on the fresh one.
Found by a review of the first version, each failed before its fix.  The core without
FUSE: passthrough is faked as in test_passthrough_opens.py (the kernel's writes are
``pwrite`` on the backing descriptor); a retry by the VFS is the same call again by
name."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO as ROOT
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached, two_cores

pytestmark = pytest.mark.trio

TRUNC = os.O_WRONLY | os.O_TRUNC


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async"}


async def _lingering(core, name: bytes = b"latest.pt", data: bytes = b"b" * 5000,
                     wait: bool = True):
    """A passthrough save of ``name`` with a reader that joined it and stays open."""
    core.fs.st.passthrough_available = lambda: True
    writer, inode = await core.fs.create(ROOT, name, 0o644, WRITE_NEW, 0, 0, core.me())
    assert writer.passthrough
    os.pwrite(core.fs.backing_fd(writer), data, 0)
    reader = await core.fs.open(inode.ino, os.O_RDONLY, core.me())
    assert reader.passthrough
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    if wait:
        with trio.fail_after(10):
            await core.fs.wait_idle()
    return inode.ino, reader


async def _estale(core, ino: int, flags: int = TRUNC) -> None:
    with pytest.raises(FsError) as exc:
        await core.fs.open(ino, flags, core.me())
    assert exc.value.errno == errno.ESTALE, exc.value


async def test_baseline_the_name_moves_and_the_reader_keeps_its_version(core):
    old, reader = await _lingering(core)
    await _estale(core, old)
    fresh = (await core.fs.lookup(ROOT, b"latest.pt")).ino
    assert fresh != old
    writer = await core.fs.open(fresh, TRUNC, core.me())
    await core.fs.write(writer.fh, 0, b"c" * 100)
    await core.fs.flush(writer.fh)
    await core.fs.release(writer.fh)
    await core.fs.release(reader.fh)
    assert core.fs.st.ns.maybe_get(old) is None
    assert core.fs.st.staging.versions_of(old) == []
    assert await core.load(fresh) == b"c" * 100


async def test_a_writer_through_a_stale_dentry_after_the_reader_closed_gets_estale(core):
    """The kernel may still hold a dentry of the name for the old inode (a lookup
    racing the move): once the reader has closed, the old inode is deleted.  The
    writer's open answered ENOENT then, which the VFS does not retry -- a trainer's save
    failed.  Now ESTALE, whatever became of the old inode."""
    old, reader = await _lingering(core)
    await _estale(core, old)
    await core.fs.release(reader.fh)
    await _estale(core, old)


async def test_a_reader_through_a_stale_dentry_gets_estale(core):
    """A reader that reaches the old (nameless) inode through a dentry the kernel still
    holds for it got ENOENT ("removed while opening") for a name that was never
    removed: now ESTALE, as a writer."""
    old, reader = await _lingering(core)
    await _estale(core, old)
    try:
        with pytest.raises(FsError) as exc:
            handle = await core.fs.open(old, os.O_RDONLY, core.me())
            await core.fs.release(handle.fh)
        assert exc.value.errno == errno.ESTALE, exc.value
    finally:
        await core.fs.release(reader.fh)


async def test_two_writers_waiting_for_the_upload_both_get_estale(tmp_path):
    """Two writers wait in the drain loop while the version before uploads.  The first
    poll after the upload lands moves the name (ESTALE, retried by the VFS); the other
    writer's next poll found the inode nameless and polled on until PASSTHROUGH_DRAIN:
    EBUSY, although the name had a fresh inode with no reader at all.  Both ESTALE."""
    store = MemoryStore(gate_limit=30)
    async with open_core(tmp_path, store, _config()) as fs:
        core = Core(fs, store)
        gate = store.gate("put", times=1)
        old, reader = await _lingering(core, wait=False)
        await reached(gate)
        results: dict[str, object] = {}

        async def writer(tag: str) -> None:
            try:
                h = await fs.open(old, TRUNC, core.me())
                results[tag] = "opened"
                await fs.release(h.fh)
            except FsError as exc:
                results[tag] = errno.errorcode[exc.errno]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer, "a")
            nursery.start_soon(writer, "b")
            await trio.sleep(0.05)
            gate.release()
        await fs.release(reader.fh)
        assert results == {"a": "ESTALE", "b": "ESTALE"}, results


def _config():
    from ckptfs.core import Config
    return Config(durability="async")


async def test_a_daemon_restart_with_the_nameless_inode_open_drops_it(tmp_path):
    """The daemon dies while the reader holds the old inode (its release never comes).
    At the next start the nameless inode -- published, with a local copy -- was kept
    for good: its record and staging file, reachable by no name and no handle.  Now
    recovery drops a nameless file that owes the store nothing."""
    store = MemoryStore(gate_limit=30)
    async with open_core(tmp_path, store, _config()) as fs:
        core = Core(fs, store)
        old, reader = await _lingering(core)
        await _estale(core, old)
        fresh = (await fs.lookup(ROOT, b"latest.pt")).ino
        # the daemon dies here: no release for ``reader``
    async with open_core(tmp_path, store, _config()) as fs:
        assert (await fs.lookup(ROOT, b"latest.pt")).ino == fresh
        leftovers = {"inode": fs.st.ns.maybe_get(old) is not None,
                     "staging": fs.st.staging.versions_of(old)}
        assert leftovers == {"inode": False, "staging": []}, leftovers


async def test_truncate_through_a_stale_dentry_answers_estale(core):
    """``truncate(path, 0)`` (a SETATTR without a handle) through a dentry still naming
    the old inode truncated the nameless inode and answered success; the name kept its
    bytes.  Now ESTALE (the VFS retries it by name); through the reader's own handle
    (``fh``) it stays the old inode's step."""
    old, reader = await _lingering(core)
    await _estale(core, old)
    fresh = (await core.fs.lookup(ROOT, b"latest.pt")).ino
    try:
        with pytest.raises(FsError) as exc:
            await core.fs.setattr(old, size=0)
        assert exc.value.errno == errno.ESTALE, exc.value
        await core.fs.setattr(fresh, size=0)          # the retry, by name
        assert core.fs.getattr(fresh).size == 0
        await core.fs.setattr(old, mode=0o600, fh=reader.fh)
    finally:
        await core.fs.release(reader.fh)


async def test_an_unlinked_open_file_is_dropped_at_the_next_start(tmp_path):
    """The same, older than the fresh inodes: a plain unlink of a published file with a
    local copy while a reader holds it, then a crash, left the same leftovers."""
    store = MemoryStore(gate_limit=30)
    async with open_core(tmp_path, store, _config()) as fs:
        core = Core(fs, store)
        ino = await core.save(ROOT, b"x.pt", b"x" * 5000)
        with trio.fail_after(10):
            await fs.wait_idle()
        reader = await fs.open(ino, os.O_RDONLY, core.me())
        await fs.unlink(ROOT, b"x.pt")
        with trio.fail_after(10):
            await fs.wait_idle()
    async with open_core(tmp_path, store, _config()) as fs:
        leftovers = {"inode": fs.st.ns.maybe_get(ino) is not None,
                     "staging": fs.st.staging.versions_of(ino)}
        assert leftovers == {"inode": False, "staging": []}, leftovers


async def test_a_rename_of_the_name_racing_the_move_answers_estale(tmp_path):
    """``mv latest.pt keep/latest.pt`` while the next save opens latest.pt: the rename
    resolved the name to the old inode, then waits for a listing of the target
    directory (metadata TTL passed); meanwhile the save moves the name to a fresh inode.
    The rename then found its inode nameless and answered ENOENT ("removed while
    renaming") for an existing name.  Now ESTALE, and the VFS's retry moves it."""
    from ckptfs.core import Config
    from ckptfs.format.remote import dir_prefix
    store = MemoryStore(gate_limit=30)
    async with open_core(tmp_path, store, Config(durability="async", metadata_ttl=0.0,
                                                 stale_wait=5.0)) as fs:
        core = Core(fs, store)
        keep = await fs.mkdir(ROOT, b"keep", 0o755, 0, 0)
        old, reader = await _lingering(core)
        gate = store.gate("list", prefix=dir_prefix(keep.dir_id), times=1)
        outcome: dict[str, object] = {}

        async def rename() -> None:
            try:
                await fs.rename(ROOT, b"latest.pt", keep.ino, b"latest.pt", 0)
                outcome["rename"] = "ok"
            except FsError as exc:
                outcome["rename"] = errno.errorcode[exc.errno]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rename)
            await reached(gate)                       # the rename waits for the listing
            await _estale(core, old)                  # the save moves the name
            gate.release()
        assert outcome == {"rename": "ESTALE"}, outcome
        await rename()                                # the VFS's retry, by name
        await fs.release(reader.fh)
        names = (await core.names(), await core.names(keep.ino))
        assert (outcome, names) == ({"rename": "ok"}, (["keep"], ["latest.pt"])), \
            (outcome, names)


def _kernel_refuses(fs, handle) -> bool:
    """The kernel's rule (fs/fuse/iomode.c): while an open of an inode is passthrough,
    every open of it that is not fails with EIO."""
    rt = fs.st.runtime.get(handle.ino)
    return not handle.passthrough and rt is not None and rt.passthrough > 0


@pytest.mark.parametrize("flags", [os.O_RDONLY, TRUNC], ids=["reader", "writer"])
async def test_an_open_of_another_nodes_save_beside_a_lingering_reader_moves_the_name(
        tmp_path, flags):
    """A's reader joined A's passthrough save and stays open; B saves the name anew and
    A's listing takes B's version.  A reader opening it on A got the daemon's path on
    the inode the kernel reads through A's staging file: EIO from the kernel (soak seed
    1215430).  Now the open moves the name to a fresh inode (ESTALE, retried by the VFS)
    and reads B's bytes; the lingering reader keeps A's."""
    from ckptfs.core import Config
    ours, theirs = b"a" * 7000, b"b" * 3000
    async with two_cores(tmp_path, MemoryStore(),
                         Config(durability="async", upload_hold=0.0)) as (a, b):
        old, reader = await _lingering(a, data=ours)
        backing = os.dup(a.fs.backing_fd(reader))     # the kernel's own reference
        await b.fs.refresh_dir(ROOT, force=True)
        writer = await b.fs.open(await b.resolve("latest.pt"), TRUNC, b.me())
        await b.fs.write(writer.fh, 0, theirs)
        await b.fs.flush(writer.fh)
        await b.fs.release(writer.fh)
        await b.fs.wait_idle()
        await a.fs.refresh_dir(ROOT, force=True)

        await _estale(a, old, flags)
        fresh = (await a.fs.lookup(ROOT, b"latest.pt")).ino
        assert fresh != old
        handle = await a.fs.open(fresh, flags, a.me())
        assert not _kernel_refuses(a.fs, handle)
        await a.fs.release(handle.fh)
        if flags == os.O_RDONLY:
            assert await a.load(fresh) == theirs
        assert os.pread(backing, len(ours) + 1, 0) == ours
        os.close(backing)
        await a.fs.release(reader.fh)
        assert a.fs.st.ns.maybe_get(old) is None


async def test_a_truncate_by_name_beside_a_lingering_reader_leaves_its_bytes(core):
    """``truncate(path, 10)`` with a passthrough reader of the (uploaded) version still
    open: the new version took over that version's staging file -- the very file the
    kernel reads for the reader -- and truncated it in place: the reader read 10 bytes
    of its 100 000 (a real mount showed it).  Now the truncate moves the name to a fresh
    inode first (ESTALE, retried by the VFS), as an open for writing does."""
    data = os.urandom(100_000)
    old, reader = await _lingering(core, data=data)
    backing = os.dup(core.fs.backing_fd(reader))     # the kernel's own reference
    try:
        with pytest.raises(FsError) as exc:
            await core.fs.setattr(old, size=10)
        assert exc.value.errno == errno.ESTALE, exc.value
        fresh = (await core.fs.lookup(ROOT, b"latest.pt")).ino
        await core.fs.setattr(fresh, size=10)          # the retry, by name
        assert os.pread(backing, len(data) + 1, 0) == data, "the reader's bytes"
        assert await core.load(fresh) == data[:10]
    finally:
        os.close(backing)
        await core.fs.release(reader.fh)
    await core.fs.wait_idle()
    assert await core.load((await core.fs.lookup(ROOT, b"latest.pt")).ino) == data[:10]


async def test_a_linked_file_moves_with_all_its_names(core):
    """A hard-linked file with a lingering reader: its names could not move (only a
    file with one name did), so every save of it -- and every open of a newer version
    from another node -- was refused with EBUSY for as long as the reader stayed open,
    although its version was long in the store (a hostile run).  Now all its names move
    to the fresh inode together, still one linked file."""
    old, reader = await _lingering(core, data=b"a" * 5000)
    backing = os.dup(core.fs.backing_fd(reader))
    await core.fs.link(old, ROOT, b"latest.lnk")
    with trio.fail_after(10):
        await core.fs.wait_idle()
    try:
        await _estale(core, old)
        fresh = (await core.fs.lookup(ROOT, b"latest.pt")).ino
        assert fresh != old and (await core.fs.lookup(ROOT, b"latest.lnk")).ino == fresh
        assert core.fs.getattr(fresh).nlink == 2
        writer = await core.fs.open(fresh, TRUNC, core.me())
        await core.fs.write(writer.fh, 0, b"c" * 100)
        await core.fs.flush(writer.fh)
        await core.fs.release(writer.fh)
        assert os.pread(backing, 6000, 0) == b"a" * 5000, "the reader keeps its version"
    finally:
        os.close(backing)
        await core.fs.release(reader.fh)
    with trio.fail_after(10):
        await core.fs.wait_idle()
    assert core.fs.st.ns.maybe_get(old) is None
    for name in ("latest.pt", "latest.lnk"):
        assert await core.load((await core.fs.lookup(ROOT, name.encode())).ino) == b"c" * 100
    async with open_core(core.fs.st.staging.root.parent / "other", core.store,
                         _config()) as fs:
        other = Core(fs, core.store)
        assert await other.load(await other.resolve("latest.lnk")) == b"c" * 100
        assert fs.getattr(await other.resolve("latest.pt")).nlink == 2
