"""A node answering from its own metadata while the store is slow to list says so once
per outage, not once per listing.  Seen in a soak's logs: "the store is slow to list /:
answering from this node's metadata (said once)" every 0.27 s, because any listing that
did answer meanwhile (another directory's) counted as the end of the outage."""

from __future__ import annotations

import logging

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core, reached

pytestmark = pytest.mark.trio


async def test_a_slow_listing_is_said_once_while_other_listings_answer(tmp_path, caplog):
    store = MemoryStore(gate_limit=30)
    config = Config(durability="sync", metadata_ttl=0.0, stale_wait=0.1)
    async with open_core(tmp_path, store, config) as fs:
        core = Core(fs, store)
        d1 = await fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)
        assert await core.names() == ["d1"]             # the root was listed once
        slow = store.gate("list", prefix="dirs/root/", times=1)
        with caplog.at_level(logging.WARNING, logger="ckptfs.core.refresh"):
            assert await core.names() == ["d1"]         # stale: the store is slow
            await reached(slow)
            for _ in range(5):
                assert await core.names(d1.ino) == []   # another listing answers
                await trio.sleep(0.15)
                assert await core.names() == ["d1"]     # the root's is still slow
            said = [r.getMessage() for r in caplog.records if "slow to list" in r.getMessage()]
            slow.release()
        assert len(said) == 1, said
