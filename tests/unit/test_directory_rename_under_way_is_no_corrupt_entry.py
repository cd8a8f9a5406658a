"""A directory renamed by another node is, for a moment, under both names in the store:
the rename writes the new entry, then deletes the old one, which carries its claim
(``moving_to``: the new key; decision 0006: "a reader may briefly see both names, never
neither").  A listing in that moment must show the directory once, under its new name,
without calling anything corrupt.

Found by hostile run F (node B's log: ``corrupt entry b'tmp-step-100110' ... has the
same directory id as b'step-100110' (EIO for that name)``, an ERROR for a rename of
A's; 3 more in run E's logs): a program listing then got EIO for the old name, and
the log said the store was corrupt.  The old name sorts after the new one there; the
test takes both orders."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import reached, two_cores

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("old, new", [(b"tmp-step-1", b"step-1"), (b"a-tmp", b"b-final")])
@pytest.mark.parametrize("known", [False, True], ids=["new-to-b", "known-to-b"])
async def test_a_listing_during_another_nodes_directory_rename_shows_it_once(
        tmp_path: Path, caplog, old: bytes, new: bytes, known: bool):
    store = MemoryStore(gate_limit=30)
    config = Config(durability="sync", upload_hold=0.0, metadata_ttl=0.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        made = await a.fs.mkdir(ROOT_INO, old, 0o755, 0, 0)
        await a.save(made.ino, b"model.pt", b"weights")
        await a.fs.wait_idle()
        if known:
            assert await b.names() == [old.decode()]
        # A's rename stops after writing the new entry, before deleting the old one.
        deleting = store.gate("delete", prefix=entry_key("root", old))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.fs.rename, ROOT_INO, old, ROOT_INO, new, 0)
            await reached(deleting)
            caplog.clear()
            try:
                names = await b.names()
                listed = [r.getMessage() for r in caplog.records
                          if r.levelno >= logging.ERROR]
                inside = await b.names(await b.resolve(new.decode()))
            finally:
                deleting.release()
        assert not listed, listed
        assert names == [new.decode()], names
        assert inside == ["model.pt"]
        assert await b.names() == [new.decode()]


async def test_a_listing_that_finds_the_old_name_gone_when_it_reads_it_moves_the_directory(
        tmp_path: Path, caplog):
    """Hostile run G (3 a minute): the LIST still had the old name (its entry changed:
    the claim), and by the time the listing read it the rename was done and it was
    gone.  The node, which knew the directory under the old name, called the *new*
    name corrupt (EIO for it)."""
    store = MemoryStore(gate_limit=30)
    config = Config(durability="sync", upload_hold=0.0, metadata_ttl=0.0)
    old, new = b"tmp-step-1", b"step-1"
    async with two_cores(tmp_path, store, config) as (a, b):
        made = await a.fs.mkdir(ROOT_INO, old, 0o755, 0, 0)
        await a.save(made.ino, b"model.pt", b"weights")
        await a.fs.wait_idle()
        assert await b.names() == [old.decode()]
        deleting = store.gate("delete", prefix=entry_key("root", old))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.fs.rename, ROOT_INO, old, ROOT_INO, new, 0)
            await reached(deleting)
            reading = store.gate("get", prefix=entry_key("root", old))    # B's read of it
            caplog.clear()
            listing: list[list[str]] = []

            async def b_lists() -> None:
                listing.append(await b.names())
            nursery.start_soon(b_lists)
            try:
                await reached(reading)
            finally:
                deleting.release()          # the rename finishes: the old name is gone
            await trio.sleep(0.2)
            reading.release()
        listed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not listed, listed
        assert listing == [[new.decode()]], listing
        assert await b.names(await b.resolve(new.decode())) == ["model.pt"]
