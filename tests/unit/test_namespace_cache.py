"""Namespace (LMDB) and the chunk cache's single flight and verification, no mount."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO, Namespace
from ckptfs.format.remote import chunk_key
from ckptfs.data.cache import ChunkCache
from ckptfs.store import CountingStore, LocalStore, StoreStats


def test_reads_inside_a_batch_see_its_writes_and_other_threads_see_only_commits(tmp_path):
    """A lookup, listing or link-id read inside a ``batch`` reads through the batch's
    transaction: a read transaction of its own saw only what was committed, so a name
    the batch had just removed was still found (``take_names_of`` then never gave it
    back: test_a_save_through_a_link_keeps_the_holders_names.py).  Another thread's
    read meanwhile sees the last commit, as before."""
    import threading
    ns = Namespace(tmp_path / "meta")
    f = ns.new_inode(ROOT_INO, b"f", "file", 0o644, 0, 0)
    g = ns.new_inode(ROOT_INO, b"g", "file", 0o644, 0, 0, link_id="c" * 32)
    seen_elsewhere: list = []
    with ns.batch():
        ns.unlink(f)
        ns.add_name(g, ROOT_INO, b"h")
        assert ns.lookup(ROOT_INO, b"f") is None
        assert ns.lookup(ROOT_INO, b"h") == g.ino
        assert sorted(name for name, _ in ns.children(ROOT_INO)) == [b"g", b"h"]
        assert ns.ino_of_link_id("c" * 32) == g.ino
        other = threading.Thread(target=lambda: seen_elsewhere.append(
            (ns.lookup(ROOT_INO, b"f"), ns.lookup(ROOT_INO, b"h"))))
        other.start()
        other.join()
    assert seen_elsewhere == [(f.ino, None)]
    assert (ns.lookup(ROOT_INO, b"f"), ns.lookup(ROOT_INO, b"h")) == (None, g.ino)
    ns.close()


def test_every_call_after_a_commit_runs_though_one_raises(tmp_path):
    """What a batch promised for after its commit all runs: one call that fails (a
    write of its own on a full disk) no longer skips the calls after it (a publish
    submitted to the queue, a record made pending); its error still reaches the
    caller."""
    ns = Namespace(tmp_path / "meta")
    ran: list[str] = []

    def fails() -> None:
        ran.append("first")
        raise FsError(28, "no room")
    with pytest.raises(FsError):
        with ns.batch():
            ns.new_inode(ROOT_INO, b"f", "file", 0o644, 0, 0)
            ns.after_commit(fails)
            ns.after_commit(lambda: ran.append("second"))
    assert ran == ["first", "second"]
    assert ns.lookup(ROOT_INO, b"f") is not None, "the batch itself committed"
    ns.close()


def test_namespace_persists_inodes_dentries_and_journal(tmp_path):
    ns = Namespace(tmp_path / "meta")
    d = ns.new_inode(ROOT_INO, b"dir", "dir", 0o755, 0, 0, dir_id="a" * 32, published=True)
    f = ns.new_inode(d.ino, b"f\xff", "file", 0o644, 1, 2, size=3, chunks=[("b" * 64, 3)])
    seq = ns.journal_add({"op": "publish", "ino": f.ino})
    ns.move(f, ROOT_INO, b"moved")
    ns.close()
    ns = Namespace(tmp_path / "meta")
    assert ns.lookup(ROOT_INO, b"moved") == f.ino
    assert ns.lookup(d.ino, b"f\xff") is None
    again = ns.get(f.ino)
    assert (again.name, again.parent, again.chunks, again.uid) == (b"moved", ROOT_INO,
                                                                   [("b" * 64, 3)], 1)
    assert sorted(name for name, _ in ns.children(ROOT_INO)) == [b"dir", b"moved"]
    assert ns.path_of(f.ino) == b"/moved"
    assert ns.journal() == [(seq, {"op": "publish", "ino": f.ino})]
    ns.journal_done(seq)
    assert ns.journal() == []
    ns.unlink(again)
    assert ns.lookup(ROOT_INO, b"moved") is None
    ns.delete_inode(f.ino)
    with pytest.raises(FsError):
        ns.get(f.ino)
    ns.close()


def make_store(tmp_path, chunks: dict[str, bytes]):
    root = tmp_path / "store"
    root.mkdir()
    raw = LocalStore(root)
    for sha, body in chunks.items():
        raw.put(chunk_key(sha), body)
    stats = StoreStats()
    return raw, CountingStore(raw, stats), stats


def test_single_flight_many_waiters_one_get(tmp_path):
    body = os.urandom(1 << 20)
    sha = hashlib.sha256(body).hexdigest()
    _, store, stats = make_store(tmp_path, {sha: body})
    cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(4))
    paths = []

    async def main():
        async def reader():
            paths.append(await cache.ensure(sha, len(body)))
        async with trio.open_nursery() as nursery:
            for _ in range(16):
                nursery.start_soon(reader)

    trio.run(main)
    assert stats.gets == 1 and stats.chunk_bytes_got == len(body)
    assert len(set(paths)) == 1 and paths[0].read_bytes() == body


def test_corrupt_chunk_never_served(tmp_path):
    body = os.urandom(4096)
    sha = hashlib.sha256(body).hexdigest()
    raw, store, stats = make_store(tmp_path, {sha: body[:-1] + bytes([body[-1] ^ 1])})
    cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(4))

    async def main():
        with pytest.raises(FsError) as info:
            await cache.ensure(sha, len(body))
        assert info.value.errno == 5
        assert not cache.has(sha)
        raw.put(chunk_key(sha), body)          # the store heals: the next read succeeds
        assert (await cache.ensure(sha, len(body))).read_bytes() == body

    trio.run(main)
    assert cache.corrupt_events == 3


def test_lru_eviction_respects_pins(tmp_path):
    bodies = [os.urandom(1000) for _ in range(4)]
    shas = [hashlib.sha256(b).hexdigest() for b in bodies]
    _, store, _ = make_store(tmp_path, dict(zip(shas, bodies)))
    cache = ChunkCache(tmp_path / "cache", store, 2500, trio.CapacityLimiter(4))

    async def main():
        cache.pin(shas[0])
        for sha in shas:
            await cache.ensure(sha, 1000)
        assert cache.has(shas[0])              # pinned: kept although least recent
        assert not cache.has(shas[1]) and not cache.has(shas[2])
        assert cache.has(shas[3])
        assert cache.total == 2000
        cache.unpin(shas[0])

    trio.run(main)


def test_pending_publishes_are_indexed_by_inode(tmp_path):
    ns = Namespace(tmp_path / "meta")
    for ino in range(100, 1100):
        ns.publish_pending_add(ino)
    ns.publish_pending_done(500)
    ns.publish_pending_add(100)          # idempotent
    pending = ns.publish_pending()
    assert len(pending) == 999 and 500 not in pending and min(pending) == 100
    ns.close()
    assert Namespace(tmp_path / "meta").publish_pending() == pending
