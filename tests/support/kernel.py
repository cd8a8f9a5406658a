"""The kernel's side of FUSE passthrough for tests without FUSE: a ``Core`` whose
passthrough handles behave as the kernel's do.

A handle the core opened for passthrough (``Handle.passthrough``) gets the staging file
the core names for it (``Filesystem.backing_fd``), and from then on its reads and
writes go to that file and never reach the core, as the kernel sends them straight to
the backing file; the kernel's rules are checked at every open: while an inode has a
backing file, an open that is not passthrough, or one with another backing file, fails
(fs/fuse/iomode.c: EIO to the program) -- here an AssertionError naming it.

The kernel's attribute and dentry caches too: sizes from lookup and getattr replies, valid for the
metadata TTL (the daemon's ``attr_timeout``), forgotten at once by
``invalidate_attributes`` and by the invalidation queue only when its thread gets there
(``deliver``: the model calls it between steps, the slowest a thread can be).  ``load``
reads by the size the kernel holds, as a zip reader seeks by ``fstat``: it must be the
size of the version the daemon serves (hostile run E's torn reads).  This node's own
changes make the kernel ask again (conservative: the kernel knows them, the stand-in
does not model how).

Knows the façade's public methods, its shared state and hooks, and ``Handle``'s fields;
nothing behind the façade."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ckptfs.errors import FsError
from ckptfs.procstat import Opener

from ckptfs.meta.namespace import ROOT_INO

from .core import Core, me


@dataclass
class KernelCore(Core):
    backing: dict[int, tuple[int, int]] = field(default_factory=dict)   # fh: (ino, fd)
    sizes: dict[int, tuple[int, float]] = field(default_factory=dict)   # ino: (size, until)
    queued: list[int] = field(default_factory=list)     # invalidations not delivered yet
    dentries: dict[tuple[int, bytes], tuple[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fs.invalidate = self.queued.append
        self.fs.invalidate_attributes = self.forget

    def forget(self, ino: int) -> None:
        self.sizes.pop(ino, None)

    def deliver(self) -> None:
        """The invalidation queue's thread gets there."""
        for ino in self.queued:
            self.forget(ino)
        self.queued.clear()

    def _cache(self, ino: int, size: int) -> None:
        ttl = self.fs.config.metadata_ttl
        if ttl > 0:
            self.sizes[ino] = (size, time.monotonic() + ttl)

    def i_size(self, ino: int) -> int:
        """The size ``fstat`` gives: the kernel's while valid, else a getattr's."""
        cached = self.sizes.get(ino)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        size = self.fs.getattr(ino).size
        self._cache(ino, size)
        return size

    async def resolve(self, path: str) -> int:
        """As ``Core.resolve``, through the kernel's dentry cache: a name looked up within
        the TTL is not looked up again (so no listing starts, and no attributes come
        with it) -- where the dentry still names what the daemon has there (a dentry
        left behind by another node's rename is the TTL's accepted lag, not modelled).
        Each lookup reply's attributes go to the kernel's cache."""
        ino = ROOT_INO
        for part in [p for p in path.split("/") if p]:
            name = part.encode()
            cached = self.dentries.get((ino, name))
            if cached is not None and cached[1] > time.monotonic() and \
                    self.fs.ns.lookup(ino, name) == cached[0]:
                ino = cached[0]
                continue
            parent = ino
            ino = (await self.fs.lookup(parent, name)).ino
            self._cache(ino, self.fs.getattr(ino).size)
            ttl = self.fs.config.metadata_ttl
            if ttl > 0:
                self.dentries[(parent, name)] = (ino, time.monotonic() + ttl)
        return ino

    def use_passthrough(self) -> None:
        """The kernel, library and capability allow passthrough (as on this machine)."""
        self.fs.passthrough_available = lambda: True

    def _backing_of(self, ino: int) -> int | None:
        return next((fd for i, fd in self.backing.values() if i == ino), None)

    def _opened(self, handle, had: int | None) -> None:
        if not handle.passthrough:
            assert had is None, (f"inode {handle.ino} has a backing file and this open is "
                                 "not passthrough: the kernel fails it (EIO)")
            return
        fd = self.fs.backing_fd(handle)
        assert fd >= 0, "a passthrough open without a backing file"
        mine = os.dup(fd)
        if had is not None:
            a, b = os.fstat(had), os.fstat(mine)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                os.close(mine)
                raise AssertionError(f"inode {handle.ino}: a passthrough open with another "
                                     "backing file than the open ones': the kernel fails it")
        self.backing[handle.fh] = (handle.ino, mine)

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     opener: Opener | None = None):
        handle, inode = await self.fs.create(parent, name, mode, flags, 0, 0, opener or me())
        self.forget(inode.ino)
        self._opened(handle, self._backing_of(inode.ino))
        return handle, inode

    async def open(self, ino: int, flags: int, opener: Opener | None = None):
        had = self._backing_of(ino)
        handle = await self.fs.open(ino, flags, opener or me())
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self.forget(ino)
        self._opened(handle, had)
        return handle

    async def _open_ino(self, ino: int, flags: int):
        return await self.open(ino, flags)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        self.forget(self.fs.handles[fh].ino)
        if fh in self.backing:
            return os.pwrite(self.backing[fh][1], data, offset)
        return await self.fs.write(fh, offset, data)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        if fh in self.backing:
            return os.pread(self.backing[fh][1], size, offset)
        return await self.fs.read(fh, offset, size)

    async def release(self, fh: int) -> None:
        """The kernel's release; right after the last passthrough handle of a writer goes,
        the kernel may ask for the file's attributes before anything else happens (a
        lookup from another process): the size must be the bytes it wrote (its i_size),
        whether the close is decided yet or not (soak seed 1215482)."""
        writable = fh in self.backing and self.fs.handles[fh].writable
        if self.fs.handles[fh].writable:
            self.forget(self.fs.handles[fh].ino)
        await self.fs.release(fh)
        held = self.backing.pop(fh, None)
        if held is None:
            return
        ino, fd = held
        try:
            last = self._backing_of(ino) is None    # (asking earlier would hide it)
            try:
                attrs = self.fs.getattr(ino) if writable and last else None
            except FsError:
                attrs = None    # (a nameless inode went with its last handle)
            if attrs is not None and attrs.nlink:
                size = attrs.size
                assert size == os.fstat(fd).st_size, \
                    (f"inode {ino}: the daemon answers size {size} right after its "
                     f"passthrough writer's release; the kernel wrote {os.fstat(fd).st_size}")
        finally:
            os.close(fd)

    def close_all(self) -> None:
        """The kernel drops its files when the node stops."""
        for _, fd in self.backing.values():
            os.close(fd)
        self.backing.clear()

    async def save(self, parent: int, name: bytes, data: bytes) -> int:
        handle, inode = await self.create(parent, name, 0o644,
                                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await self.write(handle.fh, 0, data)
        await self.fs.flush(handle.fh)
        await self.release(handle.fh)
        return inode.ino

    async def load(self, ino: int) -> bytes:
        handle = await self.open(ino, os.O_RDONLY)
        try:
            size = self.i_size(ino)
            data = await self.read(handle.fh, 0, size + 1)
        finally:
            await self.release(handle.fh)
        assert len(data) == size, \
            (f"inode {ino}: the kernel's size is {size} and the version served has "
             f"{len(data)} bytes (a reader seeking by fstat reads it torn)")
        return data
