"""A new name's entry write (``EntryIO.put_new``) after a store answer went missing or a
torn write left an empty object (decision 0016, addendum of stop 38): the node's own
write is taken for its own, and a name whose entry another node may still hold is
never taken over.  Cases a review of the first version found."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from ckptfs.store.retry import RetryingStore, RetryPolicy
from support.core import Core, open_core


def fast_retries(inner: MemoryStore) -> RetryingStore:
    return RetryingStore(inner, RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01,
                                            jitter=False, deadline=5.0))


def lose_the_reply_once(store: MemoryStore, op: str, key: str, conditional: bool) -> None:
    """The next matching call acts, then fails as if its answer never came."""
    def lose(call) -> None:
        if call.error is None and (call.if_match is not None) == conditional:
            raise TransientStoreError(f"injected: the answer to {call.op} {call.key} was lost")
    store.after(lose, op=op, prefix=key, times=1)


def run(tmp_path, body, durability: str = "sync") -> None:
    async def main() -> None:
        inner = MemoryStore()
        async with open_core(tmp_path / "a", fast_retries(inner),
                             Config(durability=durability, metadata_ttl=0.0)) as fs:
            await body(Core(fs, inner), inner)
    trio.run(main)


@pytest.mark.parametrize("op,empty_first", [("put_if_absent", False), ("put", True)])
def test_a_mkdir_whose_own_entry_write_lost_its_answer_is_made(tmp_path, op, empty_first):
    async def body(core: Core, inner: MemoryStore) -> None:
        if empty_first:      # the first try is torn: an empty object, a dropped answer
            def tear(call) -> None:
                inner.put(call.key, b"")
                raise TransientStoreError(f"injected: {call.key} torn")
            inner.before(tear, op="put_if_absent", prefix="dirs/root/d", times=1)
        lose_the_reply_once(inner, op, "dirs/root/d", conditional=(op == "put"))
        d = await core.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        assert (await core.fs.lookup(ROOT_INO, b"d")).ino == d.ino
        assert b'"dir"' in inner.get("dirs/root/d")[0]
    run(tmp_path, body)


def test_a_link_whose_entry_write_lost_its_answer_is_made_not_left_dangling(tmp_path):
    async def body(core: Core, inner: MemoryStore) -> None:
        ino = await core.save(ROOT_INO, b"x", b"shared")
        lose_the_reply_once(inner, "put_if_absent", "dirs/root/y", conditional=False)
        await core.fs.link(ino, ROOT_INO, b"y")
        assert core.fs.nlink(core.fs.getattr(ino)) == 2
        await core.fs.unlink(ROOT_INO, b"x")
        assert await core.load((await core.fs.lookup(ROOT_INO, b"y")).ino) == b"shared"
    run(tmp_path, body)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_name_whose_entry_is_empty_is_not_taken_over_by_another_nodes_mkdir(
        tmp_path, durability):
    """An entry an older release emptied (a torn PUT without a checksum) while its node
    still holds the file: another node's mkdir of that name is refused (EIO, as its
    lookup), and the holder keeps its file."""
    async def main() -> None:
        inner = MemoryStore()
        config = Config(durability=durability, metadata_ttl=0.0)
        async with open_core(tmp_path / "n", inner, Config(metadata_ttl=0.0)) as n_fs:
            n = Core(n_fs, inner)
            await n.save(ROOT_INO, b"f", b"N's checkpoint")
            inner.put("dirs/root/f", b"")
            async with open_core(tmp_path / "m", inner, config) as m_fs:
                with pytest.raises(FsError) as info:
                    await m_fs.mkdir(ROOT_INO, b"f", 0o755, 0, 0)
                assert info.value.errno == errno.EIO
                await m_fs.wait_idle()
            assert inner.get("dirs/root/f")[0] == b""
            assert await n.names() == ["f"]
            f = await n_fs.lookup(ROOT_INO, b"f")
            assert await n.load(f.ino) == b"N's checkpoint"
    trio.run(main)
