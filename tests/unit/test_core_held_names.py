"""DESIGN.md promise 2 for renames of files never closed: a name changes in the store
only when a closed version lands there.  A file being written (no closed version yet)
renamed over a published name leaves that name's entry in the store ("held") until its
own closed version lands; moved away or unlinked first, it takes the entry with it.  A
second unclosed file renamed over the first takes the hold over: otherwise moving it
away left the held entry behind, and the name this node removed came back (here and on
every other node) with the old version."""

from __future__ import annotations

import pytest

from ckptfs.format.remote import Entry, entry_key
from ckptfs.meta.namespace import ROOT_INO
from support.core import WRITE_NEW, me

pytestmark = pytest.mark.trio


@pytest.fixture(params=["sync", "async"])
def core_config(request) -> dict:
    return {"durability": request.param, "upload_hold": 0.0}


async def test_an_unclosed_file_renamed_over_a_held_name_takes_the_hold_with_it(core):
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"t", b"v1")
    await fs.wait_idle()
    key = entry_key("root", b"t")
    assert store.exists(key)
    first, _ = await fs.create(ROOT_INO, b"f1", 0o644, WRITE_NEW, 0, 0, me())
    await fs.rename(ROOT_INO, b"f1", ROOT_INO, b"t", 0)
    await fs.wait_idle()
    assert store.exists(key)                 # held: t shows v1 until f1 closes
    second, _ = await fs.create(ROOT_INO, b"f2", 0o644, WRITE_NEW, 0, 0, me())
    await fs.rename(ROOT_INO, b"f2", ROOT_INO, b"t", 0)
    await fs.wait_idle()
    assert store.exists(key)                 # still held, now by f2
    await fs.rename(ROOT_INO, b"t", ROOT_INO, b"u", 0)
    await fs.wait_idle()
    assert not store.exists(key), "t was moved away here but stays in the store"
    assert not store.exists(entry_key("root", b"u")), "u has an entry before any close"
    assert "t" not in await core.names()
    for handle in (first, second):     # closed with nothing written: empty versions
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
    await fs.wait_idle()
    assert not store.exists(key)
    assert Entry.from_json(store.get(entry_key("root", b"u"))[0]).size == 0
    assert await core.names() == ["u"]


async def test_a_published_file_renamed_over_a_held_name_replaces_the_held_entry(core):
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"t", b"v1")
    await core.save(ROOT_INO, b"other", b"v2" * 10)
    await fs.wait_idle()
    held, _ = await fs.create(ROOT_INO, b"f1", 0o644, WRITE_NEW, 0, 0, me())
    await fs.rename(ROOT_INO, b"f1", ROOT_INO, b"t", 0)          # t held: shows v1
    await fs.rename(ROOT_INO, b"other", ROOT_INO, b"t", 0)       # a closed file over it
    await fs.wait_idle()
    entry = Entry.from_json(store.get(entry_key("root", b"t"))[0])
    assert entry.size == 20                                        # other's version
    assert not store.exists(entry_key("root", b"other"))
    await fs.flush(held.fh)
    await fs.release(held.fh)            # the unclosed file, now nameless, closes
    await fs.wait_idle()
    assert Entry.from_json(store.get(entry_key("root", b"t"))[0]).size == 20
    assert await core.names() == ["t"]
    assert await core.load(await core.resolve("t")) == b"v2" * 10


async def test_a_killed_writer_s_held_name_shows_its_old_version_while_the_store_is_away(core):
    """The name it held shows the version it held again at once, from what this node
    knew: it waited for the next listing, and while the store refused connections the
    name was gone here (the model test, soak seed 1203002: "mount A does not show its own
    step: 'f2': expected 0 bytes = v3, shows nothing")."""
    from ckptfs.store import TransientStoreError
    fs, store = core.fs, core.store
    await core.save(ROOT_INO, b"t", b"v1")
    await fs.wait_idle()
    handle, _ = await fs.create(ROOT_INO, b"f1", 0o644, WRITE_NEW, 0, 0, me())
    await fs.rename(ROOT_INO, b"f1", ROOT_INO, b"t", 0)
    await fs.wait_idle()
    for op in ("list", "get", "exists"):
        store.fail(op, TransientStoreError("connection refused"), times=10_000)
    fs.died_unclean = lambda opener: True       # injected: its writer "was killed"
    await fs.flush(handle.fh)
    await fs.release(handle.fh)
    assert await core.names() == ["t"]
    inode = await fs.lookup(ROOT_INO, b"t")
    assert inode.size == 2 and inode.published
