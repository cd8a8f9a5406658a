"""Async mode: a save closed while the background publish of the file's previous version
is still in flight must be published in its turn -- the node never takes the older
version's entry for the newer one (found by tests/integration/test_passthrough.py's
reader test: a fresh read after the second save returned the first save's bytes)."""

from __future__ import annotations

import pytest

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import Entry, chunk_key, entry_key
from support.core import reached

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "chunk_size": 64 << 10, "upload_hold": 0.0}


async def test_a_save_closed_during_the_previous_versions_entry_put_is_published(core):
    fs, store = core.fs, core.store
    gate = store.gate("put", prefix=entry_key("root", b"latest.pt"))
    ino = await core.save(ROOT_INO, b"latest.pt", b"c" * 100_000)
    await reached(gate)                   # the first version's entry PUT is in flight
    await core.save(ROOT_INO, b"latest.pt", b"d" * 100_000)   # the second save closes
    gate.release()
    await fs.wait_idle()
    assert await core.load(ino) == b"d" * 100_000          # this node reads the second
    inode = fs.getattr(ino)
    assert not inode.dirty and not fs.pending_uploads()    # ... and it is in the store
    entry = Entry.from_json(store.get(entry_key("root", b"latest.pt"))[0])
    assert entry.chunks == inode.chunks
    assert b"".join(store.get(chunk_key(cid))[0] for cid, _ in entry.chunks) == \
        b"d" * 100_000
