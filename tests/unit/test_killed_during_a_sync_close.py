"""The daemon dies while a sync-mode close uploads its version (stop 44, a review of
recovery).  The close had recorded the closed version (dirty, its staging file kept)
but, in sync mode, no pending publish: the upload was the close's own.  The next start
kept the version and published it never -- the node showed the new bytes, every other
node the old ones, for good, and ``wait`` had nothing to wait for.  Now recovery
publishes every closed version that is owed to the store, journaled or not."""

from __future__ import annotations

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, die_during, open_core

pytestmark = pytest.mark.trio

OLD, NEW = b"the version before " * 500, b"the version of the killed close " * 700


@pytest.mark.parametrize("gated", ["chunk", "entry"])
@pytest.mark.parametrize("existing", [False, True], ids=["new file", "overwrite"])
async def test_a_daemon_killed_during_a_sync_close_publishes_it_at_the_next_start(
        tmp_path, existing: bool, gated: str):
    store = MemoryStore()
    config = Config(durability="sync")
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        if existing:
            await core.save(ROOT_INO, b"f", OLD)
        prefix = "chunks/" if gated == "chunk" else "dirs/"
        gates = [store.gate(op, prefix=prefix) for op in ("put", "put_if_absent")]

        async def close() -> None:
            with pytest.raises(FsError):    # the daemon is gone: no answer
                await core.save(ROOT_INO, b"f", NEW)
        dead = await die_during(store, close, gates, tmp_path / "a", tmp_path / "killed")
    for hook in dead:
        hook.remove()
    async with open_core(tmp_path / "killed", store, config) as fs:
        restarted = Core(fs, store)
        with trio.fail_after(30):
            await fs.wait_idle()
        here = await restarted.load(await restarted.resolve("f"))
    async with open_core(tmp_path / "fresh", store, config) as fs:
        fresh = Core(fs, store)
        there = await fresh.load(await fresh.resolve("f"))
    assert (here == NEW, there == NEW) == (True, True), \
        "the closed version is published at the restart, and every node shows it"
