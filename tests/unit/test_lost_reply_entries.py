"""An entry PUT that landed while its answer was lost, and then the name moved away or
went before the node wrote again: the landed entry must not stay behind.

Found by the soak (seed 1215253, s3, async, a ``refuse`` outage): ``f0`` saved as v1,
saved again as v2 (0 B), renamed to ``f2``, truncated, unlinked -- and afterwards both
nodes showed ``f0`` with v1's 40 000 bytes, a removed file back from the dead.  v1's
entry PUT had landed with its answer lost, so the node still counted ``f0`` as never
published.  The rename and the unlink then only removed from the store what the node
knew it had written there (an entry with the identity of what it had published --
nothing), and v1's entry stayed.
"""

from __future__ import annotations

import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.core.state import RENAME_EXCHANGE
from support.core import WRITE_NEW, me, open_core

ENTRY = "dirs/root/"


def run(tmp_path, durability: str, body) -> None:
    async def main() -> None:
        store = MemoryStore()
        async with open_core(tmp_path / "a", store, Config(durability=durability,
                                                           metadata_ttl=0.05)) as fs:
            await body(fs, store)
    trio.run(main)


async def save(fs, name: bytes, data: bytes, ino: int | None = None) -> int:
    if ino is None:
        handle, inode = await fs.create(ROOT_INO, name, 0o644, WRITE_NEW, 0, 0, me())
        ino = inode.ino
    else:
        handle = await fs.open(ino, os.O_WRONLY | os.O_TRUNC, me())
    await fs.write(handle.fh, 0, data)
    try:
        await fs.flush(handle.fh)
    finally:
        await fs.release(handle.fh)
    return ino


def lose_answers_then_refuse(store, key: str):
    """Every write of ``key`` from now on fails; the first one lands before it does."""
    landed: list[str] = []

    def after(call) -> None:
        if call.error is None:
            landed.append(call.op)
        raise TransientStoreError("connection reset (answer lost)")

    def before(call) -> None:
        if landed:
            raise TransientStoreError("connection refused")
    hooks = [store.after(after, op, prefix=key, times=1) for op in ("put", "put_if_absent")]
    hooks += [store.before(before, op, prefix=key) for op in ("put", "put_if_absent")]
    return landed, hooks


async def store_back(fs, store, hooks) -> list[str]:
    """The store answers again (``hooks`` removed); once the node is idle, the entries
    under the root that the store holds."""
    for hook in hooks:
        hook.remove()
    with trio.fail_after(60):
        await fs.wait_idle()
    return sorted(o.key for o in store.list(ENTRY))


async def until(predicate, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while not predicate():
            await trio.sleep(0.01)


@pytest.mark.parametrize("then", ["rename+unlink", "unlink"])
def test_a_landed_entry_whose_answer_was_lost_goes_with_its_name_async(tmp_path, then):
    async def body(fs, store) -> None:
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "f0")
        ino = await save(fs, b"f0", b"v1" * 20_000)
        await until(lambda: landed)                          # v1's entry is in the store
        assert store.exists(ENTRY + "f0")
        await save(fs, b"f0", b"", ino)                      # v2 closes, not sent yet
        if then == "rename+unlink":
            await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
            await fs.unlink(ROOT_INO, b"f2")
        else:
            await fs.unlink(ROOT_INO, b"f0")
        names = await store_back(fs, store, hooks)
        assert names == [], f"a removed file came back in the store: {names}"
    run(tmp_path, "async", body)


@pytest.mark.parametrize("then", ["rename+unlink", "rename", "unlink"])
def test_a_landed_entry_whose_answer_was_lost_goes_with_its_name_sync(tmp_path, then):
    """Sync mode: the close that sent it answered EIO (the store stayed away), so the
    file is still to be published; its name then moves or goes."""
    async def body(fs, store) -> None:
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "f0")
        with pytest.raises(Exception):
            await save(fs, b"f0", b"v1" * 20_000)            # EIO: the answer was lost
        assert landed and store.exists(ENTRY + "f0")
        ino = fs.ns.lookup(ROOT_INO, b"f0")
        if then.startswith("rename"):
            await fs.rename(ROOT_INO, b"f0", ROOT_INO, b"f2", 0)
        if then.endswith("unlink"):
            await fs.unlink(ROOT_INO, b"f2" if then.startswith("rename") else b"f0")
        names = await store_back(fs, store, hooks)
        expected = [ENTRY + "f2"] if then == "rename" else []
        assert names == expected, f"the store has {names}"
        if then == "rename":
            assert fs.getattr(ino).size == 40_000
    run(tmp_path, "sync", body)


def test_a_daemon_that_died_waiting_for_the_answer_still_removes_what_landed(tmp_path):
    """The daemon dies while v1's entry PUT is answered (it landed); the next run
    starts from what the dead one had on disk, and the name goes before its publish
    is sent again.  The PUT was recorded before it went, so the removal finds it."""
    from support.core import crash_image

    async def main() -> None:
        store = MemoryStore()
        config = Config(durability="async", metadata_ttl=0.05)
        async with open_core(tmp_path / "a", store, config) as fs:
            gate = store.gate("put_if_absent", prefix=ENTRY + "f0", when="after")
            await save(fs, b"f0", b"v1" * 20_000)
            dead: list = []
            await crash_image([gate], tmp_path / "a", tmp_path / "crashed", then=lambda: dead.extend(
                store.fail(op, TransientStoreError("the daemon is dead"), times=1000)
                for op in ("put", "delete", "put_if_absent")))
        for hook in dead:
            hook.remove()
        assert store.exists(ENTRY + "f0")
        refused = [store.fail(op, TransientStoreError("refused"), prefix=ENTRY + "f0",
                              times=-1) for op in ("put", "put_if_absent")]
        async with open_core(tmp_path / "crashed", store, config) as fs:
            await fs.unlink(ROOT_INO, b"f0")
            for hook in refused:
                hook.remove()
            with trio.fail_after(60):
                await fs.wait_idle()
        names = sorted(o.key for o in store.list(ENTRY))
        assert names == [], f"a removed file came back in the store: {names}"
    trio.run(main)


def test_a_hard_links_entry_that_landed_unanswered_goes_with_its_name(tmp_path):
    """Async: a file linked before its first publish gets its names' link entries at
    that publish; one landed with its answer lost, then that name was unlinked before
    the publish was sent again.  The link entry stayed: the name came back."""
    async def body(fs, store) -> None:
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "g")
        ino = await save(fs, b"f", b"v1" * 20_000)
        await fs.link(ino, ROOT_INO, b"g")
        await until(lambda: landed)                          # g's link entry is there
        await fs.unlink(ROOT_INO, b"g")
        names = await store_back(fs, store, hooks)
        assert names == [ENTRY + "f"], f"the store has {names}"
    run(tmp_path, "async", body)


# A review's findings: notes follow the name they are under.

@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_replaced_files_landed_entry_goes_when_the_name_goes(tmp_path, durability):
    """g's first publish landed unanswered; a never-closed f is renamed over g, then g
    is unlinked.  The landed g entry (the replaced inode's unsure note) is never taken."""
    async def body(fs, store) -> None:
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "g")
        try:
            await save(fs, b"g", b"G" * 1000)
        except Exception:
            pass                                           # sync: EIO
        await until(lambda: landed)
        handle, _ = await fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, me())
        await fs.write(handle.fh, 0, b"F")
        await fs.rename(ROOT_INO, b"f", ROOT_INO, b"g", 0)
        await fs.unlink(ROOT_INO, b"g")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        names = await store_back(fs, store, hooks)
        assert names == [], f"a removed file came back in the store: {names}"
    run(tmp_path, durability, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_an_exchanged_files_landed_entry_goes_when_the_name_goes(tmp_path, durability):
    """f's first publish landed unanswered; f and a never-closed g are exchanged, then
    f (now g's inode) is unlinked.  The note under f stays with the inode now at g."""
    async def body(fs, store) -> None:
        landed, hooks = lose_answers_then_refuse(store, ENTRY + "f")
        try:
            await save(fs, b"f", b"X" * 1000)
        except Exception:
            pass
        await until(lambda: landed)
        handle, _ = await fs.create(ROOT_INO, b"g", 0o644, WRITE_NEW, 0, 0, me())
        await fs.rename(ROOT_INO, b"f", ROOT_INO, b"g", RENAME_EXCHANGE)
        for hook in hooks:
            hook.remove()
        await fs.unlink(ROOT_INO, b"f")
        await fs.write(handle.fh, 0, b"B")
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        with trio.fail_after(60):
            await fs.wait_idle()
        names = sorted(o.key for o in store.list(ENTRY))
        assert names == [ENTRY + "g"], f"the store has {names}"
    run(tmp_path, durability, body)
