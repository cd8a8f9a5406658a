"""The core without FUSE: a ``Filesystem`` over a store in a trio nursery, and the
calls a user's program makes through the kernel (create/write/close, read, ls) made
directly on its façade.

Knows the ``Filesystem`` façade's public methods (the ones ``ckptfs/fuse/ops.py``
calls) and the stores; nothing of the concern classes behind the façade or their
private attributes, so it survives rewrites of ``ckptfs/core/`` internals.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ckptfs.core import Config, Filesystem, Handle
from ckptfs.errors import FsError
from ckptfs.data.cache import ChunkCache
from ckptfs.data.staging import Staging
from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.meta.reserve import RoomReserve
from ckptfs.procstat import Opener
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.base import ObjectStore

WRITE_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def me() -> Opener:
    """This process as the opener of a file (a live writer that means its close)."""
    return Opener.from_tid(os.getpid())


async def reached(gate: Any, count: int = 1) -> None:
    """Until ``count`` store calls are held at ``gate`` (``MemoryStore.gate``); the
    calls arrive from worker threads."""
    with trio.fail_after(30):
        await trio.to_thread.run_sync(gate.wait_reached, 30)
        while len(gate.calls) < count:
            await trio.sleep(0.01)


def kill_image(state_dir: Path, image: Path) -> None:
    """Copy ``state_dir`` to ``image``: what a daemon killed now leaves on disk.  Hard
    links stay links (``cp -a``): ``shutil.copytree`` would make each name of a staging
    file a file of its own, which no kill does."""
    subprocess.run(["cp", "-a", "--", str(state_dir), str(image)], check=True)


async def crash_image(gates: list[Any], state_dir: Path, image: Path,
                      then: Callable[[], object] = lambda: None) -> None:
    """Once a store call is held at one of ``gates``: copy ``state_dir`` to ``image``
    (what a daemon that died at that call had on disk), call ``then`` (e.g. make the
    store fail the live daemon's later calls, as a dead one makes none), release."""
    with trio.fail_after(30):
        while not any(g.calls for g in gates):
            await trio.sleep(0.01)
    kill_image(state_dir, image)
    then()
    for gate in gates:
        gate.release()


async def die_during(store: MemoryStore, step: Callable[[], Awaitable[object]],
                     gates: list[Any], state_dir: Path, image: Path) -> list[Any]:
    """Run ``step`` until a store call is held at one of ``gates``: the daemon dies
    there.  ``image`` is what it left on disk (``crash_image``), the live core's later
    writes to the store fail from then on (a dead daemon makes none), and ``step`` is
    cancelled.  Returns the failures' hooks: remove them once the live core is closed."""
    dead: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(step)
        await crash_image(gates, state_dir, image,
                          then=lambda: dead.extend(
                              store.fail(op, TransientStoreError("the daemon is dead"),
                                         times=10_000)
                              for op in ("put", "put_if_absent", "delete")))
        nursery.cancel_scope.cancel()
    return dead


@asynccontextmanager
async def two_cores(base: Path, store: ObjectStore, config: Config
                    ) -> AsyncIterator[tuple[Core, Core]]:
    """Two nodes over one store: ``base/a`` and ``base/b``."""
    async with open_core(base / "a", store, config) as a_fs, \
            open_core(base / "b", store, config) as b_fs:
        yield Core(a_fs, store), Core(b_fs, store)


@asynccontextmanager
async def open_core(base: Path, store: ObjectStore, config: Config | None = None,
                    map_size: int | None = None, run: bool = True,
                    reserve: RoomReserve | None = None, **fs_kwargs: Any
                    ) -> AsyncIterator[Filesystem]:
    """A started ``Filesystem`` with its own namespace, staging and cache under
    ``base``, over ``store``; its background tasks (publishing, the metadata log) run
    in a nursery of its own when ``run``; ``fs_kwargs`` go to the ``Filesystem``
    constructor (e.g. ``check_complete``); ``reserve``: the state dir's room for removals
on a full disk (none by default).  Closed on exit."""
    ns = Namespace(base / "meta", reserve=reserve) if map_size is None else \
        Namespace(base / "meta", map_size=map_size, reserve=reserve)
    staging = Staging(base / "staging", base / "abandoned")
    cache = ChunkCache(base / "cache", store, 1 << 30, trio.CapacityLimiter(4))
    try:
        async with trio.open_nursery() as nursery:
            fs = Filesystem(ns, store, staging, cache, config or Config(), nursery,
                            **fs_kwargs)
            if run:
                await nursery.start(fs.run)
            await fs.start()
            yield fs
            nursery.cancel_scope.cancel()
    finally:
        staging.close_all()
        ns.close()


@dataclass
class Core:
    """A ``Filesystem`` and the store under it, with the calls of a user's program."""

    fs: Filesystem
    store: Any

    @staticmethod
    def me() -> Opener:
        return me()

    async def save(self, parent: int, name: bytes, data: bytes) -> int:
        """create, write, close: like ``open(name, "wb").write(data)``."""
        handle, inode = await self.fs.create(parent, name, 0o644, WRITE_NEW, 0, 0, me())
        await self.fs.write(handle.fh, 0, data)
        await self.fs.flush(handle.fh)
        await self.fs.release(handle.fh)
        return inode.ino

    async def load(self, ino: int) -> bytes:
        """open, read all, close."""
        handle = await self.fs.open(ino, os.O_RDONLY, me())
        try:
            size = self.fs.getattr(ino).size
            return await self.fs.read(handle.fh, 0, max(size, 1))
        finally:
            await self.fs.release(handle.fh)

    async def open_by_name(self, path: str, flags: int) -> Handle:
        """``os.open(path, flags)`` as the kernel does it: the inode the name has, and
        once more by name where that open answers ESTALE (the name moved to a fresh
        inode: a new version beside readers of the one before)."""
        ino = await self.resolve(path)
        try:
            return await self._open_ino(ino, flags)
        except FsError as exc:
            if exc.errno != errno.ESTALE:
                raise
        return await self._open_ino(await self.resolve(path), flags)

    async def _open_ino(self, ino: int, flags: int) -> Handle:
        return await self.fs.open(ino, flags, me())

    async def resolve(self, path: str) -> int:
        """The inode of ``a/b/c`` under the root, looked up name by name."""
        ino = ROOT_INO
        for part in [p for p in path.split("/") if p]:
            ino = (await self.fs.lookup(ino, part.encode())).ino
        return ino

    async def names(self, ino: int = ROOT_INO) -> list[str]:
        """What a listing of ``ino`` shows, sorted (``.`` and ``..`` left out)."""
        return sorted(name.decode() for name, _ in await self.fs.listdir(ino))


class HeldCheck:
    """A completeness check (``Filesystem(check_complete=...)``) that holds each file
    it checks until ``go_on`` is set: a close decision kept under way, in its thread
    (files above the inline check's size).  ``checking`` is set once one is held."""

    def __init__(self) -> None:
        self.checking, self.go_on = threading.Event(), threading.Event()

    def __call__(self, fd: int, size: int, name: bytes = b"") -> None:
        self.checking.set()
        self.go_on.wait(30)
        return None

    async def reached(self) -> None:
        with trio.fail_after(30):
            await trio.to_thread.run_sync(self.checking.wait, 30)
