"""The core without FUSE: a ``Filesystem`` over the in-memory store, as a pytest-trio
fixture that owns its nursery (background publishing and the metadata log run in it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import trio

from ckptfs.cache import ChunkCache
from ckptfs.core import Config, Filesystem
from ckptfs.namespace import Namespace
from ckptfs.procstat import Opener
from ckptfs.staging import Staging
from ckptfs.store import MemoryStore


@dataclass
class Core:
    fs: Filesystem
    store: MemoryStore

    @staticmethod
    def me() -> Opener:
        return Opener.from_tid(os.getpid())

    async def save(self, parent: int, name: bytes, data: bytes) -> int:
        """create, write, close: like ``open(name, "wb").write(data)``."""
        handle, inode = await self.fs.create(parent, name, 0o644,
                                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0,
                                             self.me())
        await self.fs.write(handle.fh, 0, data)
        await self.fs.flush(handle.fh)
        await self.fs.release(handle.fh)
        return inode.ino


@pytest.fixture
def core_config() -> dict:
    """Config fields for the ``core`` fixture; a test overrides it to change them."""
    return {}


@pytest.fixture
async def core(tmp_path, core_config):
    store = MemoryStore(gate_limit=30)
    ns = Namespace(tmp_path / "meta")
    staging = Staging(tmp_path / "staging", tmp_path / "abandoned")
    cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(4))
    try:
        async with trio.open_nursery() as nursery:
            fs = Filesystem(ns, store, staging, cache, Config(**core_config), nursery)
            await nursery.start(fs.run)
            await fs.start()
            yield Core(fs, store)
            nursery.cancel_scope.cancel()
    finally:
        staging.close_all()
        ns.close()
