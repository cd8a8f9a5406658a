"""Found by a review (stop 50): a read inside a batch of state the batch changed but
that is updated only after the commit (the metadata log's ``pending``, filled by an
``after_commit``).

``Rename._move_and_log`` (async) adds the move record, then, when the renamed file
took the replaced file's unlanded closed version (``take_closed_version``), journals
its publish "(after the move, in log order)": ``Publish._journal_publish`` takes the
epoch from ``oplog.epoch()`` -- the newest record in ``oplog.pending`` -- which does not
hold the move record yet (it is added to ``pending`` after the commit).  So the publish
is ready at once and goes to the store before the move record that must precede it;
the move record then finds the file published and clean and logs a false "lost a race:
another node moved or removed ... first".  ``MetaLog.epoch`` now counts a record
added in the open batch."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX, Entry, entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, TransientStoreError
from support.core import WRITE_NEW, Core, open_core, reached

pytestmark = pytest.mark.trio

OLD, SAVED = b"v1" * 20, b"B's save " * 12
KEY = entry_key("root", b"f0")


def _stored(store: MemoryStore) -> int:
    return Entry.from_json(store.get(KEY)[0]).size


async def test_the_publish_of_a_taken_version_waits_for_its_move_record(
        tmp_path: Path, caplog):
    store = MemoryStore(gate_limit=30)
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=3600.0)
    async with open_core(tmp_path / "b", store, config) as fs:
        b = Core(fs, store)
        f0 = await b.save(ROOT_INO, b"f0", OLD)
        with trio.fail_after(30):
            await fs.wait_idle()
        # A save of f0 that has not landed (its upload held).
        uploading = store.gate("put", prefix=CHUNKS_PREFIX)
        h = await fs.open(f0, os.O_WRONLY | os.O_TRUNC, b.me())
        await fs.write(h.fh, 0, SAVED)
        await fs.flush(h.fh)
        await fs.release(h.fh)
        await reached(uploading)
        # A file not closed yet renamed over it: it takes that save (``took``).
        t1, inode = await fs.create(ROOT_INO, b"t1", 0o644, WRITE_NEW, 0, 0, b.me())
        # The move record's first store step meets a store hiccup (retried, backoff).
        hiccup = store.fail("get", TransientStoreError("a store hiccup"),
                            prefix=entry_key("root", b"t1"), times=10_000)
        await fs.rename(ROOT_INO, b"t1", ROOT_INO, b"f0", 0)
        move_seq = next(s for s, r in fs.oplog.pending.items()
                        if r.get("kind") == "move" and r.get("ino") == inode.ino)
        epoch = fs.st._publish_epoch.get(inode.ino)
        uploading.release()
        with trio.move_on_after(3):
            while _stored(store) == len(OLD):
                await trio.sleep(0.02)
        early = _stored(store)
        still_pending = move_seq in fs.oplog.pending
        hiccup.remove()
        with trio.fail_after(30):
            await fs.wait_idle()
        await fs.release(t1.fh)
        with trio.fail_after(30):
            await fs.wait_idle()
        false_race = [r.getMessage() for r in caplog.records
                      if r.levelno >= logging.WARNING and "lost a race" in r.getMessage()]
        assert still_pending
        assert (epoch, early, false_race) == (move_seq, len(OLD), []), \
            f"the taken version's publish has epoch {epoch} (its move record is " \
            f"{move_seq}); the store's f0 had {early} bytes while the move record was " \
            f"still pending (published before it); warnings: {false_race}"
