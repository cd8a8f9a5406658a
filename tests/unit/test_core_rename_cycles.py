"""Two nodes renaming two names onto each other at once (A: f0 -> f1 while B: f1 -> f0)
end with one serial order's result: one name, never both.  Each rename claimed its own
source (decision 0006 step 2) and wrote its target over the other's claim, so both
conditional deletes found a newer entry and kept it: both names stayed, on every node (the
soak found it, seed 1214002, local-sync: "'f0': expected nothing, shows v1").

The interleaving is forced: a rename's write of its target waits (up to a few seconds)
until both sources are claimed.  Knows the façade and the in-memory store's hooks."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.remote import entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.memory import Call
from support.core import Core, crash_image, open_core

pytestmark = pytest.mark.trio

V0, V1 = b"version of f0 " * 300, b"version of f1 " * 200


def hold_target_writes_until_both_claimed(store: MemoryStore, keys: tuple[str, str]):
    """Before each of the first two PUTs of an entry that is not a claim onto one of
    ``keys``: wait until both keys carry a claim (the crossing the bug needs), at most
    3 s."""
    held: list[Call] = []

    def hold(call: Call) -> None:
        if call.key not in keys or b"moving_to" in (call.data or b"") or len(held) >= 2:
            return
        held.append(call)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            bodies = [store._objects.get(k) for k in keys]
            if all(b is not None and b"moving_to" in b.body for b in bodies):
                return
            time.sleep(0.005)
    return store.before(hold, "put")


async def shown(core: Core) -> dict[str, bytes]:
    await core.fs.refresh_dir(ROOT_INO, force=True)
    return {n: await core.load(await core.resolve(n)) for n in await core.names()}


# B's rename, and the trees one serial order or the other leaves.
CROSSINGS = {
    # A then B: f0 holds A's file (V0); B then A: f1 holds B's file (V1).
    "swap": (b"f0", ({"f0": V0}, {"f1": V1})),
    # A then B: f2 = V0; B then A: f1 = V0, f2 = V1 (passed before the change too).
    "chain": (b"f2", ({"f2": V0}, {"f1": V0, "f2": V1})),
}


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("crossing", sorted(CROSSINGS))
async def test_two_nodes_renaming_across_each_other_end_in_one_serial_order(
        tmp_path: Path, durability: str, crossing: str):
    """A: f0 -> f1 while B: f1 -> f0 (swap) or f1 -> f2 (chain)."""
    b_target, serial = CROSSINGS[crossing]
    store = MemoryStore(gate_limit=30)
    config = Config(durability=durability, upload_hold=0.0, store_timeout=5.0)
    keys = (entry_key("root", b"f0"), entry_key("root", b"f1"))
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        await a.save(ROOT_INO, b"f0", V0)
        await a.save(ROOT_INO, b"f1", V1)
        await a_fs.wait_idle()
        assert await shown(b) == {"f0": V0, "f1": V1}
        assert await shown(a) == {"f0": V0, "f1": V1}
        hook = hold_target_writes_until_both_claimed(store, keys)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a_fs.rename, ROOT_INO, b"f0", ROOT_INO, b"f1", 0)
                nursery.start_soon(b_fs.rename, ROOT_INO, b"f1", ROOT_INO, b_target, 0)
            await a_fs.wait_idle()
            await b_fs.wait_idle()
        hook.remove()
        seen_a, seen_b = await shown(a), await shown(b)
        assert seen_a in serial, sorted(seen_a)
        assert seen_b == seen_a, (sorted(seen_a), sorted(seen_b))


async def test_a_rename_cut_short_whose_target_changed_meanwhile_is_not_done(
        tmp_path: Path):
    """Sync: the daemon dies after journaling a rename t -> u, before writing u (its state
    dir is copied while that write is held: a crash image); another node then saves u.
    The daemon restarted from the image must not write over that save (the target is no
    longer what the rename read): the rename is not done, t keeps its file and loses its
    claim at once, u keeps the other node's save."""
    store = MemoryStore(gate_limit=30)
    config = Config(durability="sync", upload_hold=0.0, store_timeout=1.0)
    old, new = entry_key("root", b"t"), entry_key("root", b"u")
    async with open_core(tmp_path / "a", store, config) as fs:
        await Core(fs, store).save(ROOT_INO, b"t", V0)
        # The write of u, whichever call makes it, is held, then fails.
        gates = [store.gate(op, prefix=new) for op in ("put", "put_if_absent")]
        never = [store.fail(op, TransientStoreError("never written"), prefix=new,
                            times=1000) for op in ("put", "put_if_absent")]
        async with trio.open_nursery() as nursery:
            async def rename() -> None:
                with pytest.raises(FsError):
                    await fs.rename(ROOT_INO, b"t", ROOT_INO, b"u", 0)
            nursery.start_soon(rename)
            await crash_image(gates, tmp_path / "a", tmp_path / "crashed")
    for hook in never:
        hook.remove()
    async with open_core(tmp_path / "b", store, config) as other:
        await Core(other, store).save(ROOT_INO, b"u", V1)
    async with open_core(tmp_path / "crashed", store, config) as fs:
        core = Core(fs, store)
        with trio.fail_after(20):
            await fs.wait_idle()
        assert await shown(core) == {"t": V0, "u": V1}
        assert b"moving_to" not in store.get(old)[0]     # free to rename at once
        async with open_core(tmp_path / "c", store, config) as third:
            await third.rename(ROOT_INO, b"t", ROOT_INO, b"w", 0)
            assert await shown(Core(third, store)) == {"u": V1, "w": V0}


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_file_renamed_into_a_directory_another_node_removes_is_never_lost(
        tmp_path: Path, durability: str):
    """A: f0 -> d1/f0 while B: rmdir d1.  The rmdir listed d1 empty and deleted it; the
    rename then wrote f0's entry under d1's id and deleted f0: the file was under no
    directory, on no node (and gc collects such entries).  Found by the racing core
    model.  Either order is fine; losing the file is not."""
    store = MemoryStore(gate_limit=30)
    config = Config(durability=durability, upload_hold=0.0, store_timeout=5.0)
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        await a.save(ROOT_INO, b"f0", V0)
        d1 = (await a_fs.mkdir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        await a_fs.wait_idle()
        assert await shown_names(b) == ["d1", "f0"]
        b_d1 = await b.resolve("d1")
        await b_fs.refresh_dir(b_d1, force=True)

        async def rmdir() -> None:
            try:
                await b_fs.rmdir(ROOT_INO, b"d1")
            except FsError as exc:
                assert exc.errno == errno.ENOTEMPTY

        async def rename() -> None:
            try:
                await a_fs.rename(ROOT_INO, b"f0", d1, b"f0", 0)
            except FsError as exc:
                assert exc.errno == errno.ENOENT

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rename)
                nursery.start_soon(rmdir)
            await a_fs.wait_idle()
            await b_fs.wait_idle()
        for core in (a, b):
            top = await shown_names(core)
            if "d1" in top:       # the rename came first: the rmdir found d1 not empty
                d = await core.resolve("d1")
                await core.fs.refresh_dir(d, force=True)
                assert await core.names(d) == ["f0"]
                assert await core.load(await core.resolve("d1/f0")) == V0
            else:                 # the rmdir came first: the rename found no d1
                assert top == ["f0"]
                assert await core.load(await core.resolve("f0")) == V0


async def shown_names(core: Core) -> list[str]:
    await core.fs.refresh_dir(ROOT_INO, force=True)
    return await core.names()
