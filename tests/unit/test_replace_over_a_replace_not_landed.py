"""Async, one node: ``os.replace`` of a just-saved file over a name whose last replace
has not reached the store yet must end with the newest save under the name -- never
the save before both (hostile run G: a lone node's reader saw ``p0.pt`` go two
versions back, then torn loads and EINVAL, 7 of 9 rounds; ``torch.save`` to a
temporary name and ``os.replace`` in a loop, one writer, one mount).

What happened: the previous file held the name's entry (its own upload not landed),
and the new file took that hold over.  Its first publish was in flight at the
rename, so it was not "published", and the move record did not say what it held:
when the record ran, the new file's entry (landed under the temporary name) met the
held entry under the name, took it for another node's save after the rename, and
the node adopted that older save."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import CHUNKS_PREFIX, Entry, entry_key
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, Core, open_core, reached

pytestmark = pytest.mark.trio

V0, V1, V2 = b"v0" * 50, b"v1 " * 40, b"v2, the newest" * 9


async def test_a_replace_over_a_replace_not_landed_keeps_the_newest_save(tmp_path: Path):
    store = MemoryStore(gate_limit=30)
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=0.0)
    async with open_core(tmp_path / "a", store, config) as fs:
        core = Core(fs, store)
        await core.save(ROOT_INO, b"p0", V0)
        with trio.fail_after(30):
            await fs.wait_idle()
        uploading = store.gate("put", prefix=CHUNKS_PREFIX)     # the first save's
        await core.save(ROOT_INO, b"tmp1", V1)
        await reached(uploading)
        await fs.rename(ROOT_INO, b"tmp1", ROOT_INO, b"p0", 0)
        entry_put = store.gate("put_if_absent", prefix=entry_key("root", b"tmp2"))
        handle, _ = await fs.create(ROOT_INO, b"tmp2", 0o644, WRITE_NEW, 0, 0, core.me())
        await fs.write(handle.fh, 0, V2)
        await fs.flush(handle.fh)
        await fs.release(handle.fh)
        await reached(entry_put)            # its first publish is in flight
        await fs.rename(ROOT_INO, b"tmp2", ROOT_INO, b"p0", 0)
        entry_put.release()
        uploading.release()
        with trio.fail_after(30):
            await fs.wait_idle()
        assert await core.names() == ["p0"]
        assert await core.load(await core.resolve("p0")) == V2, \
            "the name went back to the save before both replaces"
        assert Entry.from_json(store.get(entry_key("root", b"p0"))[0]).size == len(V2)
