"""A save of a name that another node made a hard link meanwhile writes the linked file.

Found by the model test's race step (soak seed 1215372, async, local and SeaweedFS):
A links ``d1/f2`` as ``f1`` while B, which has not seen ``f1`` yet, saves ``f1``.  Both
succeed, so the link came first, and B's ``open(O_CREAT|O_TRUNC)`` of ``f1`` then
truncates and writes the linked file: ``f1`` and ``d1/f2`` both hold B's save.  B's
publish met A's link entry under the name and (since a publish never writes over an
entry that is not a file) kept B's save as ``f1.ckptfs-conflict-<node>``; ``f1`` kept
the old bytes.  Now the save joins the shared inode object the link names and writes
its content there (compare-and-swap), as a save through that name on A would.
"""

from __future__ import annotations


import pytest
import trio

from ckptfs.core import Config
from ckptfs.format.remote import INODES_PREFIX
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, two_cores


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_save_of_a_name_another_node_just_linked_writes_the_linked_file(tmp_path,
                                                                        durability):
    async def main() -> None:
        store = MemoryStore()
        config = Config(durability=durability, metadata_ttl=3600.0)
        async with two_cores(tmp_path, store, config) as (a, b):
            old = await a.save(ROOT_INO, b"f2", b"A's file before the save" * 100)
            await a.fs.wait_idle()
            handle, _ = await b.fs.create(ROOT_INO, b"f1", 0o644, WRITE_NEW, 0, 0, b.me())
            await b.fs.write(handle.fh, 0, b"B's save")
            await a.fs.link(old, ROOT_INO, b"f1")          # first: B's save succeeds
            await a.fs.wait_idle()
            before = len(store.calls)
            await b.fs.flush(handle.fh)
            await b.fs.release(handle.fh)
            with trio.fail_after(30):
                await b.fs.wait_idle()
            object_reads = [c for c in store.calls[before:]
                            if c.op == "get" and c.key.startswith(INODES_PREFIX)]
            assert len(object_reads) == 1, "the publish reads the inode object once"
            for node in (a, b):
                seen: dict[str, bytes] = {}
                for _ in range(50):
                    await node.fs.refresh_dir(ROOT_INO, force=True)
                    seen = {n: await node.load(await node.resolve(n))
                            for n in await node.names()}
                    if seen == {"f1": b"B's save", "f2": b"B's save"}:
                        break
                    await trio.sleep(0.05)
                assert seen == {"f1": b"B's save", "f2": b"B's save"}, seen
    trio.run(main)
