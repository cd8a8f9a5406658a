"""A listing must never drop a name whose first publish landed while it listed (async
mode, one node).

Found by the lone-node test at a TTL of 0 in CI (``test_core_renames_alone.py``, with
hard links: "a/z: ENOENT", the name gone here and in the store).  A hard-linked file's
first publish writes its inode object, then the link entry of each of its names, one
PUT after another, holding the inode's lock.  A listing of one of those directories
that LISTed before its name's PUT, and applied after the publish had finished, found
the name missing from the store, the inode published, clean and unlocked, and forgot it
as a name another node removed.  Nothing else was left to write that name: it was lost
here and never reached the store.  A plain file's first publish has the same window
(its one entry PUT), only narrower."""

from __future__ import annotations

import pytest
import trio

from ckptfs.format.remote import dir_prefix, entry_key
from ckptfs.meta.namespace import ROOT_INO
from support.core import reached

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "upload_hold": 0.0, "metadata_ttl": 0.0}


@pytest.mark.parametrize("linked", [False, True], ids=["plain", "hard-linked"])
async def test_a_name_published_while_a_listing_ran_stays(core, linked):
    fs, store = core.fs, core.store
    d = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    await fs.wait_idle()
    await fs.listdir(d.ino)
    name = b"y" if linked else b"x"
    publishing = store.gate("put" if linked else "put_if_absent",   # (a new name: created)
                            prefix=entry_key(d.dir_id, name))
    uploading = store.gate("put", prefix="chunks/")
    ino = await core.save(d.ino, b"x", b"data")
    await reached(uploading)
    if linked:
        await fs.link(ino, d.ino, b"y")             # its entry: the first publish writes it
    uploading.release()
    await reached(publishing)
    # The listing's LIST acts now, without the name, and returns only when released.
    listed = store.gate("list", prefix=dir_prefix(d.dir_id), when="after")
    shown: list[dict[bytes, int]] = []

    async def list_d() -> None:
        shown.append({n: inode.ino for n, inode in await fs.listdir(d.ino)})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(list_d)
        await reached(listed)
        publishing.release()
        with trio.fail_after(30):
            await fs.wait_idle()                    # the publish has finished
        assert store.exists(entry_key(d.dir_id, name))
        listed.release()                            # the listing applies now
    want = {b"x": ino, b"y": ino} if linked else {b"x": ino}
    assert shown == [want], "the listing that ran during the publish lost the name"
    await fs.wait_idle()
    assert {n: inode.ino for n, inode in await fs.listdir(d.ino)} == want
    assert await core.load(ino) == b"data"
    assert store.exists(entry_key(d.dir_id, name))
