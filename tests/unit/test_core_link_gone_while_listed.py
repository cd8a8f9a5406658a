"""A hard-linked file whose names all go while a listing reads them is gone, not
corrupt.

Found by the lone-node race test (``test_core_concurrent_alone.py``, seed 1005, async at
a 20 ms TTL): "link b'y' names a missing inode object (EIO for that name)" logged as an
ERROR, with nothing wrong in the store.  A listing LISTs a directory, GETs the link
entry of a name, then GETs the inode object it names; when the file's last name is
removed in between (its entry first, then its object), the object is missing because
the name is gone, not because the store is damaged.  The name must then answer ENOENT,
not EIO, and nothing may be logged as corruption."""

from __future__ import annotations

import errno
import logging

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.remote import INODES_PREFIX
from ckptfs.meta.namespace import ROOT_INO
from support.core import Core, open_core, reached

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "sync", "metadata_ttl": 0.0}


async def test_a_link_whose_names_go_while_listed_is_gone_not_corrupt(core, tmp_path,
                                                                        caplog):
    store = core.store
    ino = await core.save(ROOT_INO, b"x", b"data")
    await core.fs.link(ino, ROOT_INO, b"y")
    # The lister answers from that one listing afterwards (a long TTL).
    async with open_core(tmp_path / "lister", store,
                         Config(durability="sync", metadata_ttl=60.0)) as lister:
        resolving = store.gate("get", prefix=INODES_PREFIX)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lister.listdir, ROOT_INO)   # a node that never saw them
            await reached(resolving)                        # link entries read
            await core.fs.unlink(ROOT_INO, b"x")
            await core.fs.unlink(ROOT_INO, b"y")            # the object goes too
            resolving.release()
        for name in (b"x", b"y"):
            with pytest.raises(FsError) as caught:
                await lister.lookup(ROOT_INO, name)
            assert caught.value.errno == errno.ENOENT, name
    assert not list(store.list(INODES_PREFIX))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


async def test_a_link_whose_object_is_missing_for_good_answers_eio(core, tmp_path, caplog):
    """The store lost the object (its names' entries still link to it): EIO for those
    names, said in the log -- the re-read above must not hide real damage."""
    store = core.store
    ino = await core.save(ROOT_INO, b"x", b"data")
    await core.fs.link(ino, ROOT_INO, b"y")
    for obj in list(store.list(INODES_PREFIX)):
        store.delete(obj.key)
    async with open_core(tmp_path / "lister", store,
                         Config(durability="sync", metadata_ttl=60.0)) as lister:
        await lister.listdir(ROOT_INO)
        for name in (b"x", b"y"):
            with pytest.raises(FsError) as caught:
                await lister.lookup(ROOT_INO, name)
            assert caught.value.errno == errno.EIO, name
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("names a missing inode object" in e for e in errors), errors
