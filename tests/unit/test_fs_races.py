"""Races across await points in the core, driven directly with a store whose calls are
slowed down (a delaying wrapper around the ObjectStore protocol).  Found by review;
each test failed before its fix."""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

from ckptfs.core import Config, Filesystem
from ckptfs.namespace import ROOT_INO, Namespace
from ckptfs.procstat import Opener
from ckptfs.remote import Entry, chunk_key, entry_key
from ckptfs.cache import ChunkCache
from ckptfs.staging import Staging
from ckptfs.store import LocalStore

CS = 64 << 10


class SlowStore:
    """LocalStore whose chunk PUTs sleep, with optional hooks around entry PUT/DELETE."""

    def __init__(self, inner: LocalStore, chunk_delay: float = 0.3) -> None:
        self.inner = inner
        self.url = inner.url
        self.chunk_delay = chunk_delay
        self.before_put = None
        self.after_delete = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data, sha256=None, *, if_match=None):
        if key.startswith("chunks/"):
            time.sleep(self.chunk_delay)
        if self.before_put:
            self.before_put(key)
        return self.inner.put(key, data, sha256, if_match=if_match)

    def delete(self, key, if_match=None):
        self.inner.delete(key, if_match)
        if self.after_delete:
            self.after_delete(key)


def me() -> Opener:
    return Opener.from_tid(os.getpid())


def run(tmp_path: Path, body, **cfg) -> None:
    async def main():
        (tmp_path / "store").mkdir()
        store = SlowStore(LocalStore(tmp_path / "store"))
        ns = Namespace(tmp_path / "meta")
        staging = Staging(tmp_path / "staging", tmp_path / "abandoned")
        cache = ChunkCache(tmp_path / "cache", store, 1 << 30, trio.CapacityLimiter(4))
        try:
            async with trio.open_nursery() as nursery:
                fs = Filesystem(ns, store, staging, cache, Config(**cfg), nursery)
                await nursery.start(fs.run)
                await fs.start()
                await body(fs, store)
                nursery.cancel_scope.cancel()
        finally:
            staging.close_all()
            ns.close()
    trio.run(main)


def stored(fs: Filesystem, parent_dir_id: str, name: bytes) -> bytes:
    body, _ = fs.store.inner.get(entry_key(parent_dir_id, name))
    entry = Entry.from_json(body)
    return b"".join(fs.store.inner.get(chunk_key(sha))[0] for sha, _ in entry.chunks)


async def write_file(fs, ino, data, trunc=True):
    h = await fs.open(ino, os.O_WRONLY | (os.O_TRUNC if trunc else 0), me())
    await fs.write(h.fh, 0, data)
    await fs.flush(h.fh)
    await fs.release(h.fh)


def test_rewrite_during_background_publish_ends_with_the_new_version(tmp_path):
    async def body(fs, store):
        h, inode = await fs.create(ROOT_INO, b"f", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
        await fs.write(h.fh, 0, b"A" * (3 * CS + 100))
        await trio.sleep(0.2)
        await fs.flush(h.fh)
        await fs.release(h.fh)
        await trio.sleep(0.1)                      # V1's upload is in flight
        r = await fs.open(inode.ino, os.O_RDONLY, me())   # a reader comes and goes
        await fs.release(r.fh)
        await write_file(fs, inode.ino, b"B" * (3 * CS + 100))
        await fs.queue.wait_idle()
        final = fs.ns.get(inode.ino)
        assert not final.dirty and not fs.queue.queued and fs.ns.journal() == [] \
            and fs.ns.publish_pending() == {}
        assert stored(fs, "root", b"f") == b"B" * (3 * CS + 100)

    run(tmp_path, body, durability="async", chunk_size=CS, upload_concurrency=4)


def test_refresh_during_rename_keeps_the_renamed_file_and_tree(tmp_path):
    async def body(fs, store):
        h, inode = await fs.create(ROOT_INO, b"a", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
        await fs.write(h.fh, 0, b"hello")
        await fs.flush(h.fh)
        await fs.release(h.fh)
        d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
        h, child = await fs.create(d.ino, b"x", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0, me())
        await fs.write(h.fh, 0, b"child")
        await fs.flush(h.fh)
        await fs.release(h.fh)
        store.after_delete = lambda key: time.sleep(0.3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.rename, ROOT_INO, b"a", ROOT_INO, b"b", 0)
            nursery.start_soon(fs.rename, ROOT_INO, b"d", ROOT_INO, b"e", 0)
            await trio.sleep(0.15)
            await fs.refresh_dir(ROOT_INO, force=True)
        store.after_delete = None
        b = await fs.lookup(ROOT_INO, b"b")
        r = await fs.open(b.ino, os.O_RDONLY, me())
        assert await fs.read(r.fh, 0, 10) == b"hello"
        await fs.release(r.fh)
        e = await fs.lookup(ROOT_INO, b"e")
        x = await fs.lookup(e.ino, b"x")
        r = await fs.open(x.ino, os.O_RDONLY, me())
        assert await fs.read(r.fh, 0, 10) == b"child"
        await fs.release(r.fh)

    run(tmp_path, body, chunk_size=CS)


def test_unlink_during_entry_put_does_not_resurrect(tmp_path):
    async def body(fs, store):
        store.chunk_delay = 0
        store.before_put = lambda key: time.sleep(0.3) if key.startswith("dirs/") else None
        h, _ = await fs.create(ROOT_INO, b"tmpfile", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                               me())
        await fs.write(h.fh, 0, b"scratch")
        await fs.flush(h.fh)
        await fs.release(h.fh)
        await trio.sleep(0.15)                     # the entry PUT is in flight
        await fs.unlink(ROOT_INO, b"tmpfile")
        await fs.queue.wait_idle()
        await trio.sleep(0.4)
        store.before_put = None
        assert [o.key for o in store.inner.list("dirs/")] == []
        await fs.refresh_dir(ROOT_INO, force=True)
        assert fs.ns.lookup(ROOT_INO, b"tmpfile") is None

    run(tmp_path, body, durability="async", chunk_size=CS)


def test_killed_process_that_never_wrote_does_not_abandon_a_closed_version(tmp_path):
    async def body(fs, store):
        h, inode = await fs.create(ROOT_INO, b"ckpt", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0,
                                   me())
        await fs.write(h.fh, 0, b"V0")
        await fs.flush(h.fh)
        await fs.release(h.fh)
        await fs.queue.wait_idle()
        await write_file(fs, inode.ino, b"V1-closed-cleanly")
        other = await fs.open(inode.ino, os.O_RDWR, me())   # opened, never written
        fs.died_unclean = lambda opener: True    # injected: the opener "was killed"
        await fs.flush(other.fh)
        await fs.release(other.fh)
        await fs.queue.wait_idle()
        assert stored(fs, "root", b"ckpt") == b"V1-closed-cleanly"

    run(tmp_path, body, durability="async", chunk_size=CS)
