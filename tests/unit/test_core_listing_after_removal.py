"""A listing must never bring back a name this node removed (async mode, one node).

The model test found it twice in soaks ("after rename X -> Y on a node, X is still there";
kept once as: save f0, save f1, unlink f1 -> f1 still listed, the store without it).  A
lookup in a directory this node changed within the TTL starts a listing in the background
and does not wait for it.  The listing task begins only at trio's next checkpoint: after
the unlink (or rename) it was started for has journaled its record and counted its change.
It then counted "no change since I began", listed the store before the record's delete
ran, and adopted the removed name as another node's.  A listing that begins while this
node's records for the directory are pending must gain nothing and lose nothing."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from ckptfs.errors import FsError
from ckptfs.format.remote import entry_key
from ckptfs.meta.namespace import ROOT_INO

pytestmark = pytest.mark.trio
TTL = 0.3


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "upload_hold": 0.0, "metadata_ttl": TTL}


async def listing_out_of_date(core) -> None:
    """The root's listing is older than the TTL, and this node changed the root within
    it (a save): the next lookup lists again in the background without waiting."""
    await core.fs.listdir(ROOT_INO)
    listed = trio.current_time()
    await trio.sleep(TTL * 0.6)
    await core.save(ROOT_INO, b"f0", b"")
    await core.fs.wait_idle()
    await trio.sleep_until(listed + TTL * 1.2)


async def settle() -> None:
    """Until every task of the core is blocked (the background listing has applied)."""
    with trio.fail_after(10):
        await trio.testing.wait_all_tasks_blocked(cushion=0.2)


@pytest.mark.parametrize("data", [b"", b"data"], ids=["empty", "4B"])
@pytest.mark.parametrize("removal", ["unlink", "rename"])
async def test_a_removed_name_stays_gone_while_its_record_is_pending(core, removal, data):
    """The unlink's delete, or the rename's move, is held in the store until checked."""
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"x", data)
    await fs.wait_idle()
    await listing_out_of_date(core)
    pending = store.gate("delete", prefix=entry_key("root", b"x"))
    if removal == "unlink":
        await fs.unlink(ROOT_INO, b"x")
    else:
        await fs.rename(ROOT_INO, b"x", ROOT_INO, b"y", 0)
    left = ["f0"] if removal == "unlink" else ["f0", "y"]
    await settle()
    assert await core.names() == left, f"a listing brought back the name ({removal})"
    with pytest.raises(FsError) as caught:
        await fs.lookup(ROOT_INO, b"x")
    assert caught.value.errno == errno.ENOENT
    pending.release()
    await fs.wait_idle()
    assert not store.exists(entry_key("root", b"x"))
    assert await core.names() == left
    if removal == "rename":
        assert await core.load(await core.resolve("y")) == data


async def test_a_name_another_node_removed_leaves_the_kernel_s_dentry_cache(tmp_path):
    """When a listing finds a name gone from the store (another node removed it), the
    kernel is told to forget that dentry at once: it kept answering lookups by path with
    the dead name for up to its entry timeout after the daemon had dropped it."""
    from ckptfs.core import Config
    from ckptfs.store.memory import MemoryStore
    from support.core import Core, open_core
    store = MemoryStore(gate_limit=30)
    forgotten: list[tuple[int, bytes]] = []

    async def invalidate_entry(parent: int, name: bytes) -> None:
        forgotten.append((parent, name))

    config = Config(durability="async", upload_hold=0.0, metadata_ttl=0.0)
    async with open_core(tmp_path, store, config, invalidate_entry=invalidate_entry) as fs:
        core = Core(fs, store)
        await core.save(ROOT_INO, b"gone", b"x")
        await core.save(ROOT_INO, b"kept", b"y")
        await fs.wait_idle()
        store.delete(entry_key("root", b"gone"))        # another node's unlink
        assert await core.names() == ["kept"]
        await settle()
        assert forgotten == [(ROOT_INO, b"gone")]
