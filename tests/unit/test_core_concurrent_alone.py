"""One node racing itself with many processes at once (the FUSE daemon serves requests
concurrently: each is a trio task, and they interleave at every ``await``).  Random
saves, overwrites, renames, unlinks, chowns, symlinks and hard links from several tasks
at once over a few names in two directories, while every store call takes a random
moment.  The kernel's own locking is kept: a request that changes or looks up names
holds its directories' locks (``i_rwsem``; both for a rename, in a fixed order), as the
VFS does before it sends the request; a file's writes and close, a chown, and the node's
background work hold none.  Which of two racing steps wins is not modelled; what must
hold whatever the interleaving: once the node is idle, the store holds exactly what the node shows (names,
types, owners, contents), a fresh node over the same store shows the same, and no step
failed with anything but the errors a racing program may get (ENOENT, EEXIST,
ENOTEMPTY, EISDIR, ENOTDIR)."""

from __future__ import annotations

import errno
import logging
import random
import stat
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, Core, me, open_core
from test_core_renames_alone import store_view, two_dirs_under_jitter

pytestmark = pytest.mark.trio
CS = 16 << 10
NAMES = [b"x", b"y", b"z"]
RACING = {errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR}


@pytest.fixture(params=["async-ttl0", "async-ttl20ms", "sync-ttl20ms"])
def core_config(request) -> dict:
    durability, _, ttl = request.param.partition("-ttl")
    return {"durability": durability, "chunk_size": CS, "stale_wait": 5.0,
            "metadata_ttl": 0.02 if ttl == "20ms" else 0.0, "upload_hold": 0.0}


async def node_view(core: Core, dirs: dict[str, int]) -> dict[str, dict[bytes, tuple]]:
    """What the node shows in each directory: name -> (type, uid, content)."""
    out: dict[str, dict[bytes, tuple]] = {}
    for dname, dino in dirs.items():
        seen: dict[bytes, tuple] = {}
        for name, inode in await core.fs.listdir(dino):
            inode = core.fs.getattr(inode.ino)
            if inode.type == "file":
                what = await core.load(inode.ino)
            elif inode.type == "symlink":
                what = core.fs.readlink(inode.ino)
            else:
                what = b""
            seen[name] = (inode.type, inode.uid, what)
        out[dname] = seen
    return out


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
async def test_a_node_racing_itself_ends_with_the_store_holding_what_it_shows(
        core, core_config, seed, tmp_path, caplog):
    fs, store = core.fs, core.store
    rnd = random.Random(seed)
    dirs = await two_dirs_under_jitter(core, rnd, 0.003)
    counter = 0
    dir_locks = {ino: trio.Lock() for ino in dirs.values()}

    def where() -> tuple[int, bytes]:
        return dirs[rnd.choice("ab")], rnd.choice(NAMES)

    @asynccontextmanager
    async def vfs(*parents: int) -> AsyncIterator[None]:
        """The directories' locks, as the kernel holds them around the request."""
        async with AsyncExitStack() as stack:
            for ino in sorted(set(parents)):
                await stack.enter_async_context(dir_locks[ino])
            yield

    async def save(parent: int, name: bytes, data: bytes) -> None:
        async with vfs(parent):
            handle, _ = await fs.create(parent, name, 0o644, WRITE_NEW, 0, 0, me())
        await fs.write(handle.fh, 0, data)
        await fs.flush(handle.fh)
        await fs.release(handle.fh)

    async def lookup(parent: int, name: bytes):
        async with vfs(parent):
            return await fs.lookup(parent, name)

    async def step(note: list[str]) -> None:
        nonlocal counter
        counter += 1
        n = counter
        op = rnd.random()
        parent, name = where()
        if op < 0.3:
            data = b"%d;" % n * rnd.choice([1, 3, 3000, 9000])     # up to 2 chunks
            note[0] = f"save {parent}/{name!r} {len(data)} B"
            await save(parent, name, data)
        elif op < 0.5:
            new_parent, new_name = where()
            note[0] = f"rename {parent}/{name!r} -> {new_parent}/{new_name!r}"
            async with vfs(parent, new_parent):
                await fs.rename(parent, name, new_parent, new_name, 0)
        elif op < 0.6:
            note[0] = f"unlink {parent}/{name!r}"
            async with vfs(parent):
                await fs.unlink(parent, name)
        elif op < 0.75:
            note[0] = f"chown {parent}/{name!r}"
            inode = await lookup(parent, name)
            await fs.setattr(inode.ino, uid=rnd.randint(1, 60000))
        elif op < 0.85:
            note[0] = f"symlink {parent}/{name!r}"
            async with vfs(parent):
                await fs.symlink(parent, name, b"t%d" % n, 0, 0)
        elif op < 0.92:
            new_parent, new_name = where()
            note[0] = f"link {parent}/{name!r} -> {new_parent}/{new_name!r}"
            inode = await lookup(parent, name)
            async with vfs(new_parent):
                await fs.link(inode.ino, new_parent, new_name)
        else:
            note[0] = f"mkfifo {parent}/{name!r}"
            async with vfs(parent):
                await fs.mknod(parent, name, stat.S_IFIFO | 0o644, 0, 0, 0)

    failures: list[str] = []

    async def worker(w: int) -> None:
        for i in range(25):
            note = ["?"]
            try:
                await step(note)
            except FsError as exc:
                # A save over a name that is now a symlink or FIFO: through FUSE the
                # kernel follows or opens those itself; the core answers EINVAL.
                special = exc.errno == errno.EINVAL and note[0].startswith("save")
                if exc.errno not in RACING and not special:
                    failures.append(f"worker {w} step {i}, {note[0]}: {exc!r}")
            if rnd.random() < 0.05:
                await fs.wait_idle()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for w in range(4):
                nursery.start_soon(worker, w)
        await fs.wait_idle()
    assert not failures, failures
    await trio.sleep(0.05)                       # past the TTL: listings are taken again
    shown = await node_view(core, dirs)
    for dname, dino in dirs.items():
        assert store_view(store, fs.ns.get(dino).dir_id) == shown[dname], \
            f"{dname}/: the store differs from what the node shows"
    store.before(lambda call: None)
    async with open_core(tmp_path / "fresh", store, Config(**core_config)) as fresh_fs:
        fresh = Core(fresh_fs, store)
        fresh_dirs = {d: await fresh.resolve(d) for d in dirs}
        assert await node_view(fresh, fresh_dirs) == shown, "a fresh node sees otherwise"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
