"""A version taken in place from another node's save must reach the kernel's
attributes before any reply can serve it (DESIGN.md promise 1: never a torn read).

Found by hostile run E (3 of 14 runs) and reproduced without frameworks: node B read
a file A kept saving in place, alternating two sizes; B's listing took A's new
version on the same inode, and the kernel's cached size of the version before was
only forgotten by the invalidation queue's thread.  An open and ``fstat`` that came
first got the old size and read the new bytes: a zip reader found no central
directory at the size it was given.  With the queue's thread held 30 ms per call
(``/tmp/torn``, note of stop 47), 26 of 2 926 reads were torn; after the fix, 0 of
3 433.  The take now forgets the kernel's attributes at once
(``InodeInvalidations.attributes_now``, attribute-only: it takes no lock a request
holds); the pages are still left to the queue (an open of another version drops them:
no ``keep_cache``).

Here the queue never delivers anything (the slowest thread there is) and the
``attributes_now`` hook records what the kernel was told at once."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, open_core
from support.kernel import KernelCore

pytestmark = pytest.mark.trio


@asynccontextmanager
async def _b_recording(tmp_path: Path, durability: str, ttl: float
                       ) -> AsyncIterator[tuple[Core, Core, list[int]]]:
    """Nodes A and B; B's invalidation queue never delivers, and what B tells the
    kernel to forget at once is recorded (the list yielded)."""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=ttl)
    queued: list[int] = []
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config, invalidate=queued.append) as b_fs:
        a, b = Core(a_fs, store), Core(b_fs, store)
        forgotten: list[int] = []
        b.fs.invalidate_attributes = forgotten.append
        yield a, b, forgotten


@pytest.mark.parametrize("durability", ["sync", "async"])
@pytest.mark.parametrize("how", ["listing", "lookup"])
async def test_a_version_taken_in_place_reaches_the_kernels_size_before_an_open(
        tmp_path: Path, durability: str, how: str):
    async with _b_recording(tmp_path, durability, 0.0) as (a, b, forgotten):
        await a.save(ROOT_INO, b"f", b"x" * 1048593)
        await a.fs.wait_idle()
        ino = await b.resolve("f")
        kernel_size = b.fs.getattr(ino).size        # what the kernel caches
        assert kernel_size == 1048593
        await a.save(ROOT_INO, b"f", b"y" * 1048576)
        await a.fs.wait_idle()
        if how == "listing":
            await b.names()
        else:
            assert await b.resolve("f") == ino     # taken on the same inode (no reader)
        handle = await b.fs.open(ino, os.O_RDONLY, b.me())
        try:
            served = await b.fs.read(handle.fh, 0, 2 << 20)
        finally:
            await b.fs.release(handle.fh)
        assert served == b"y" * 1048576
        assert ino in forgotten, \
            "the open serves the new version while the kernel may still hold the old size"


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_reader_through_the_kernels_caches_reads_by_the_size_of_what_it_is_served(
        tmp_path: Path, durability: str):
    """The hostile run's timeline, through the kernel stand-in's dentry and attribute
    caches (``support/kernel.py``; TTL 1 s): B looks ``b`` up half a TTL after its last
    listing; A saves a smaller ``b``; past the listing's TTL, B's lookup of *another*
    name lists again and takes ``b``'s new version in place, while ``b``'s dentry and
    size are still valid in the kernel and the invalidation queue has not got there.
    B then opens ``b`` and reads it by the kernel's size.  (A stall of the machine over
    the margins only makes the caches expire: then the test finds nothing, never a
    false failure.)"""
    store = MemoryStore()
    config = Config(durability=durability, upload_hold=0.0, metadata_ttl=1.0)
    async with open_core(tmp_path / "a", store, config) as a_fs, \
            open_core(tmp_path / "b", store, config) as b_fs:
        a, b = KernelCore(a_fs, store), KernelCore(b_fs, store)
        await a.save(ROOT_INO, b"a", b"a" * 10)
        await a.save(ROOT_INO, b"b", b"x" * 100)
        await a.fs.wait_idle()
        await b.names()
        await trio.sleep(0.5)
        assert await b.load(await b.resolve("b")) == b"x" * 100
        await a.save(ROOT_INO, b"b", b"y" * 50)
        await a.fs.wait_idle()
        await trio.sleep(0.55)
        await b.resolve("a")            # lists again: takes b's new version in place
        assert await b.load(await b.resolve("b")) == b"y" * 50


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_newer_save_found_by_a_rewrite_here_reaches_the_kernels_size(
        tmp_path: Path, durability: str):
    """A rewrite of the entry here (a setxattr: its reply carries no attributes) that
    finds another node's newer save takes it in place too (``EntryIO``): the kernel
    must forget the size it holds before the next open is served."""
    async with _b_recording(tmp_path, durability, 60.0) as (a, b, forgotten):
        await a.save(ROOT_INO, b"f", b"x" * 100)
        await a.fs.wait_idle()
        ino = await b.resolve("f")
        await a.save(ROOT_INO, b"f", b"y" * 50)
        await a.fs.wait_idle()
        # (TTL 60 s: no listing takes it first)
        await b.fs.setxattr(ino, b"user.step", b"7")
        await b.fs.wait_idle()
        assert b.fs.getattr(ino).size == 50, "the rewrite did not take the newer save"
        assert ino in forgotten, \
            "the newer save is served here while the kernel may hold the old size"
