"""Async mode: a save closed while the background publish of the file's previous version
is still in flight must be published in its turn -- the node never takes the older
version's entry for the newer one (found by tests/integration/test_passthrough.py's
reader test: a fresh read after the second save returned the first save's bytes)."""

from __future__ import annotations

import pytest
import trio

from ckptfs.meta.namespace import ROOT_INO
from ckptfs.format.remote import Entry, chunk_key, entry_key
from support.core import reached

pytestmark = pytest.mark.trio


@pytest.fixture
def core_config() -> dict:
    return {"durability": "async", "chunk_size": 64 << 10, "upload_hold": 0.0}


async def test_a_save_closed_during_the_previous_versions_entry_put_is_published(core):
    fs, store = core.fs, core.store
    gate = store.gate("put_if_absent", prefix=entry_key("root", b"latest.pt"))
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


@pytest.mark.parametrize("core_config", [{"durability": "async", "upload_hold": 0.0,
                                          "upload_concurrency": 5}])
async def test_async_publishes_of_many_small_files_run_as_many_at_once_as_uploads(core):
    """A small file's publish is mostly waiting for the store (HEAD, PUT, entry PUT,
    removal mark GET): the queue runs ``upload_concurrency`` of them at once.  With two
    workers a copy of 1 000 small files took 11-16 s to drain."""
    fs, store = core.fs, core.store
    gate = store.gate("put_if_absent", prefix=entry_key("root", b"f"), times=7)
    for i in range(7):
        await core.save(ROOT_INO, f"f{i}".encode(), f"small file {i}".encode())
    with trio.fail_after(10):
        while len(gate.calls) < 5:
            await trio.sleep(0.01)
    await trio.sleep(0.2)
    assert len(gate.calls) == 5, "more publishes at once than upload_concurrency"
    gate.release()
    await fs.wait_idle()
    for i in range(7):
        assert await core.load(await core.resolve(f"f{i}")) == f"small file {i}".encode()
        assert Entry.from_json(store.get(entry_key("root", f"f{i}".encode()))[0]).size == \
            len(f"small file {i}")
