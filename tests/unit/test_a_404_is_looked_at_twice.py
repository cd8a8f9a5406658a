"""A store's 404 for an entry this node knows is there (a hostile run, stop 44).

The metadata log read one 404 on a GET as "another node moved or removed it first" and
finished the record: a rename the writer was told had happened was undone, here and in
the store (``mv tmp-1 ckpt-1``: both showed ``tmp-1``); a rename that sealed a
checkpoint left it unlisted everywhere, for gc; a seal whose conditional PUT got a 412
and whose re-read got a 404 was dropped.  Worse, with the store's marker known to be
gone (the bucket emptied; the log said so) the 404s of an emptied store were trusted
the same way, and after the operator restored the bucket the node and the store
disagreed for good.  Now a 404 of an entry is looked at twice, and while the store has
lost its marker no entry read or listing counts as an answer: the records wait."""

from __future__ import annotations

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import FORMAT_KEY
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.base import NotFound
from support.core import Core, open_core

pytestmark = pytest.mark.trio

DATA = b"weights " * 2000


async def _saved_tree(core: Core) -> None:
    run = await core.fs.mkdir(ROOT_INO, b"run", 0o755, 0, 0)
    tmp = await core.fs.mkdir(run.ino, b"tmp-1", 0o755, 0, 0)
    await core.save(tmp.ino, b"model.bin", DATA)
    with trio.fail_after(30):
        await core.fs.wait_idle()


async def _fresh_view(tmp_path, store) -> list[str]:
    async with open_core(tmp_path / "fresh", store, Config(durability="async")) as fs:
        fresh = Core(fs, store)
        names = await fresh.names(await fresh.resolve("run"))
        for name in names:
            assert await fresh.load(await fresh.resolve(f"run/{name}/model.bin")) == DATA
        return names


async def test_one_404_does_not_undo_a_rename(tmp_path):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="async")) as fs:
        core = Core(fs, store)
        await _saved_tree(core)
        run = await core.resolve("run")
        old_key = next(k for k in store.keys() if k.startswith("dirs/") and
                       k.endswith("/tmp-1"))
        store.fail("get", NotFound(old_key), prefix=old_key, times=1)
        await fs.rename(run, b"tmp-1", run, b"ckpt-1", 0)
        with trio.fail_after(30):
            await fs.wait_idle()
        assert await core.names(run) == ["ckpt-1"]
    assert await _fresh_view(tmp_path, store) == ["ckpt-1"]


async def test_records_wait_while_the_store_has_lost_its_marker(tmp_path):
    """The bucket is emptied while a rename waits for the store, and restored later
    (the log's own advice): the rename is applied after the restore."""
    store = MemoryStore()
    store.put(FORMAT_KEY, b"{}")
    async with open_core(tmp_path / "a", store, Config(durability="async")) as fs:
        core = Core(fs, store)
        await _saved_tree(core)
        run = await core.resolve("run")
        outage = [store.fail(op, TransientStoreError("store unreachable"), times=10_000)
                  for op in ("get", "put", "put_if_absent", "delete", "list")]
        await fs.rename(run, b"tmp-1", run, b"ckpt-1", 0)
        await trio.sleep(0.3)                       # the record is tried, and fails
        for hook in outage:
            hook.remove()
        saved = {k: store.get(k)[0] for k in store.keys()}
        for key in list(saved):
            store.delete(key)                       # the bucket emptied
        with trio.fail_after(30):
            while not fs.st.store_health.marker_lost:
                await trio.sleep(0.05)
        await trio.sleep(0.5)                       # the record is tried meanwhile
        assert fs.st.oplog.pending, "the rename is still journaled"
        for key, body in saved.items():             # restored
            store.put(key, body)
        with trio.fail_after(60):
            await fs.wait_idle()
        assert await core.names(run) == ["ckpt-1"]
    assert await _fresh_view(tmp_path, store) == ["ckpt-1"]


async def test_a_seal_whose_412_is_followed_by_one_404_is_applied(tmp_path):
    """A checkpoint is written in place and sealed by its mark file; the conditional
    PUT that seals its entry gets a 412 and the re-read a 404: the seal was dropped
    ("nothing left to apply") and the checkpoint stayed unlisted everywhere."""
    from ckptfs.store.base import PreconditionFailed
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, Config(durability="async")) as fs:
        core = Core(fs, store)
        ck = await fs.mkdir(ROOT_INO, b"checkpoint-5", 0o755, 0, 0)
        await core.save(ck.ino, b"model.bin", DATA)
        with trio.fail_after(30):
            await fs.wait_idle()
        key = next(k for k in store.keys() if k.startswith("dirs/") and
                   k.endswith("/checkpoint-5"))
        refused: list[str] = []

        def once(call) -> None:
            if not refused and call.if_match:
                refused.append(call.op)
                store.fail("get", NotFound(key), prefix=key, times=1)
                raise PreconditionFailed(key)
        store.before(once, "put", prefix=key)
        await core.save(ck.ino, b"trainer_state.json", b'{"global_step": 5}')   # the mark
        with trio.fail_after(30):
            await fs.wait_idle()
        assert refused, "the seal's conditional PUT was refused once"
        assert await core.names() == ["checkpoint-5"]
    async with open_core(tmp_path / "fresh", store, Config(durability="async")) as fs:
        assert await Core(fs, store).names() == ["checkpoint-5"]
