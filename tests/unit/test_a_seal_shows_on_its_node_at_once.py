"""Async mode: a checkpoint directory sealed on this node shows in this node's listings
once its seal is decided here -- journaled, and no other node writing below it (their
leases) -- not only once every upload below it has landed and the store has the seal.

A hostile run of HF Trainer (stop 44): ``save_total_limit=2`` rotated by listing
``checkpoint-*`` right after the save; the newest checkpoint did not show yet while its
uploads lagged, so each rotation deleted one directory too few (3 kept, 4 under a slow
store), and ``get_last_checkpoint`` on that node named the one before.  Other nodes
still see it once the store has the seal (the seal is a cluster decision), and a
directory another node still writes in stays hidden here too: its files from that node
are not in the store yet.
"""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from ckptfs.format.remote import CHUNKS_PREFIX
from support.core import WRITE_NEW, two_cores

pytestmark = pytest.mark.trio

CONFIG = Config(durability="async", metadata_ttl=0.0, upload_hold=0.0)


async def test_a_checkpoint_sealed_here_shows_here_before_its_uploads_land(tmp_path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, CONFIG) as (a, b):
        gate = store.gate("put", prefix=CHUNKS_PREFIX)          # the uploads lag
        ck = await a.fs.mkdir(ROOT_INO, b"checkpoint-2", 0o755, 0, 0)
        await a.save(ck.ino, b"model.safetensors", os.urandom(50_000))
        await a.save(ck.ino, b"trainer_state.json", b'{"global_step": 2}')   # the mark
        # (its close waited for the seal's first look: listed at once, as the HF
        # Trainer's rotation lists right after it)
        assert a.fs.st.oplog.pending_of("seal", ck.ino)
        assert gate.wait_reached(5), "(an upload is held)"
        assert "checkpoint-2" in await a.names(), \
            "sealed here, not shown here until its uploads landed"
        assert await b.names() == [], "another node sees it only once the store has it"
        gate.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        assert await b.names() == ["checkpoint-2"]
        assert await b.names(await b.resolve("checkpoint-2")) == \
            ["model.safetensors", "trainer_state.json"]


async def test_a_checkpoint_another_node_still_writes_in_stays_hidden(tmp_path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, CONFIG) as (a, b):
        for node in (a, b):     # (the daemon runs them: renewals, pending seals)
            await node.fs.st.nursery.start(node.fs.leases.run)
        ck = await a.fs.mkdir(ROOT_INO, b"checkpoint-3", 0o755, 0, 0)
        await a.fs.wait_idle()
        ck_b = await b.resolve("checkpoint-3")
        shard, _ = await b.fs.create(ck_b, b"shard-1.bin", 0o644, WRITE_NEW, 0, 0, b.me())
        await b.fs.write(shard.fh, 0, b"rank 1's shard")
        with trio.fail_after(10):
            while not any(k.startswith("leases/") for k in store.keys()):
                await trio.sleep(0.01)
        await a.save(ck.ino, b"trainer_state.json", b'{"global_step": 3}')
        assert await a.names() == [], "shown while another node still writes in it"
        await b.fs.flush(shard.fh)
        await b.fs.release(shard.fh)
        with trio.fail_after(60):
            while "checkpoint-3" not in await a.names():
                await b.fs.wait_idle()
                await a.fs.wait_idle()
                await trio.sleep(0.1)
        assert await a.names(ck.ino) == ["shard-1.bin", "trainer_state.json"]
