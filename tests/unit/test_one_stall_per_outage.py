"""A store that stops answering (a hang) in async mode: a job keeps saving from this
node's metadata, and waits for the store once, not once per directory (a hostile run,
stop 44: the first ``mkdir`` of an outage took three waits of ``stale_wait``, and every
directory's next lookup after its TTL one more)."""

from __future__ import annotations

import time

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core

pytestmark = pytest.mark.trio

STALE_WAIT = 0.4


async def test_a_slow_store_is_waited_for_once_not_once_per_directory(tmp_path):
    store = MemoryStore(gate_limit=30)
    config = Config(durability="async", metadata_ttl=0.05, stale_wait=STALE_WAIT)
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        dirs = [await fs.mkdir(ROOT_INO, f"d{i}".encode(), 0o755, 0, 0) for i in range(4)]
        for d in dirs:
            await core.save(d.ino, b"f", b"x")
        with trio.fail_after(30):
            await fs.wait_idle()
        for d in dirs:
            await fs.refresh_dir(d.ino, force=True)
        await trio.sleep(0.1)                        # every listing is past its TTL
        hang = store.gate("list", times=100)         # the store stops answering
        took = []
        for d in dirs:
            started = time.monotonic()
            assert await fs.lookup(d.ino, b"f")
            took.append(time.monotonic() - started)
        started = time.monotonic()
        await fs.mkdir(dirs[0].ino, b"tmp-1", 0o755, 0, 0)
        took.append(time.monotonic() - started)
        hang.release()
        assert took[0] >= STALE_WAIT * 0.9, took       # the first waits for the store
        assert max(took[1:]) < STALE_WAIT / 2, took    # the others know it is slow
