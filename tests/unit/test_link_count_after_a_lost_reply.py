"""A link count-out tried again after its reply was lost counts once.

Found by a review: ``_move_over_link``'s count-out (``count_out`` in the move record) was
made again by the record's retry when the count-out's own PUT had landed and only its
answer was lost (a timeout after the store acted, on every try of the call).  The link
was counted out twice: the shared object's count fell below the names that still link
it, and the object went with the next unlink while another name still linked it (that
name then answered EIO).  Each count-out now has an id, kept in the record, and the
object keeps the ids of the latest count-outs made on it (``Entry.counted``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import Entry, inode_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore, NotFound
from ckptfs.store.base import StoreTimeout
from support.core import Core, reached, two_cores

pytestmark = pytest.mark.trio

A_DATA = b"A's renamed file " * 300
LINKED = b"the hard-linked file's bytes " * 100


def nlink_of(store: MemoryStore, link_id: str) -> int:
    try:
        body, _ = store.get(inode_key(link_id))
    except NotFound:
        return 0
    return Entry.from_json(body, 1 << 30).nlink


async def a_late_rename_over_a_link(a: Core, b: Core, store: MemoryStore) -> tuple:
    """``f1``, ``lnk``, ``lnk2``: three names of one file (count 3), and ``tmp``, a
    plain file; A's rename ``tmp -> dst`` is made first and held at its claim, and B's
    ``lnk -> dst`` lands before it: (the link id, the claim's gate, to release)."""
    ino = await a.save(ROOT_INO, b"f1", LINKED)
    await a.fs.link(ino, ROOT_INO, b"lnk")
    await a.fs.link(ino, ROOT_INO, b"lnk2")
    await a.save(ROOT_INO, b"tmp", A_DATA)
    with trio.fail_after(30):
        await a.fs.wait_idle()
    await b.fs.refresh_dir(ROOT_INO, force=True)
    link_id = a.fs.getattr(ino).link_id
    assert nlink_of(store, link_id) == 3
    claim = store.gate("put", prefix="dirs/root/tmp")
    await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"dst", 0)
    await reached(claim)
    await b.fs.rename(ROOT_INO, b"lnk", ROOT_INO, b"dst", 0)
    return link_id, claim


async def test_a_count_out_whose_answer_was_lost_counts_out_once(tmp_path: Path):
    store = MemoryStore()
    config = Config(durability="async", metadata_ttl=3600.0, upload_hold=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        link_id, claim = await a_late_rename_over_a_link(a, b, store)

        # A's count-out lands, its answer is lost once.
        lost = []

        def lose_answer(call) -> None:
            if call.error is None and not lost:
                lost.append(call.key)
                raise StoreTimeout("answer lost after the store acted")
        store.after(lose_answer, "put", prefix="inodes/", times=1)
        claim.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
            await b.fs.wait_idle()
        assert lost, "the count-out PUT was not made"
        counted = nlink_of(store, link_id)
        # The consequence: removing f1 must leave lnk2 readable.
        await b.fs.unlink(ROOT_INO, b"f1")
        with trio.fail_after(30):
            await b.fs.wait_idle()
        assert nlink_of(store, link_id) >= 1, \
            f"the shared object went while lnk2 still links it (count after the " \
            f"count-out: {counted}, want 2)"
        assert counted == 2, "the link was counted out twice"
