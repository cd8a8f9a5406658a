"""A save on the node where a reader holds a version that is not in the store yet.

A save beside readers moves the name to a fresh inode, so that the kernel's size of the
readers' inode stays theirs (``Opening.leave_readers_their_inode``).  A version still
owed to the store could not move: the writer waited up to ``PASSTHROUGH_DRAIN`` for its
upload, then went on in place, and the reader read its version cut at the new size
(DESIGN.md promise 2: an open reader reads the version it opened until it closes) --
an async trainer saving ``latest.pt`` again before the last save's upload landed,
beside an evaluator reading it.  Now the fresh inode takes the owed version over (a
hard link of its staging file, and the pending publish with its place in the log), and
the reader's inode, nameless, owes the store nothing."""

from __future__ import annotations

import logging
import os

import pytest
import trio

from ckptfs.core import Config, Handle
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import Core, kill_image, open_core, reached
from test_save_beside_a_reader_on_its_node import NEW, OLD, save_over, step_by_name

pytestmark = pytest.mark.trio

ASYNC = Config(durability="async", upload_hold=0.0)


async def owed_beside_a_reader(core: Core, store: MemoryStore) -> tuple:
    """``f0`` saved, its upload held (the gate), and a reader holding that version:
    (the gate, the inode, the reader's handle)."""
    uploading = store.gate("put", prefix="chunks/", times=1000)
    old = await core.save(ROOT_INO, b"f0", OLD)
    await reached(uploading)
    return uploading, old, await core.fs.open(old, os.O_RDONLY, core.me())


async def open_a_save_beside(core: Core, old: int, flags: int) -> tuple[int, Handle]:
    """The next save's open of ``f0`` beside the reader of ``old``: (the inode it
    opened -- never ``old`` -- and its handle)."""
    handles = []

    async def open_for_a_save(ino: int) -> None:
        handles.append(await core.fs.open(ino, flags, core.me()))
    acted = await step_by_name(core, open_for_a_save)
    assert acted != old, "the save opened the reader's inode"
    return acted, handles[0]


async def test_the_save_moves_the_name_without_waiting_and_the_reader_keeps_its_version(
        tmp_path, caplog):
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await owed_beside_a_reader(core, store)
        with caplog.at_level(logging.WARNING, logger="ckptfs"), trio.fail_after(1.5):
            acted = await step_by_name(core, lambda ino: save_over(core, ino))
        assert acted != old, "the new version went into the reader's inode"
        assert not [r for r in caplog.records if "saved over while a reader" in r.getMessage()]
        assert fs.getattr(old).size == len(OLD)
        assert await fs.read(reader.fh, 0, len(OLD) + 1) == OLD
        assert await core.load(await core.resolve("f0")) == NEW
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        assert await fs.read(reader.fh, 0, len(OLD) + 1) == OLD
        await fs.release(reader.fh)
        assert fs.ns.maybe_get(old) is None, "the reader's inode outlived its last reader"
        assert not fs.staging.versions_of(old)
    async with open_core(tmp_path / "b", store, ASYNC) as fs:
        other = Core(fs, store)
        assert await other.load(await other.resolve("f0")) == NEW


async def test_the_version_taken_over_lands_when_the_next_save_never_closes(tmp_path):
    """The daemon dies while the next save is under way: the owed version is the
    name's closed version, and its publish, now the fresh inode's, still lands."""
    store = MemoryStore()
    async with open_core(tmp_path / "a", store, ASYNC) as fs:
        core = Core(fs, store)
        uploading, old, reader = await owed_beside_a_reader(core, store)
        _, writer = await open_a_save_beside(core, old, os.O_WRONLY | os.O_TRUNC)
        await fs.write(writer.fh, 0, b"half of the next sa")
        kill_image(tmp_path / "a", tmp_path / "killed")    # the daemon dies here
        await fs.release(reader.fh)
        uploading.release()
    async with open_core(tmp_path / "killed", store, ASYNC) as fs:
        restarted = Core(fs, store)
        assert await restarted.load(await restarted.resolve("f0")) == OLD
        with trio.fail_after(30):
            await fs.wait_idle()
    async with open_core(tmp_path / "b", store, ASYNC) as fs:
        other = Core(fs, store)
        assert await other.load(await other.resolve("f0")) == OLD
