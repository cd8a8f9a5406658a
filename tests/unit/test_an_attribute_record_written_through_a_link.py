"""An async ``attrs`` record (utime) of ``f`` that meets the link entry another node
made of ``f`` meanwhile is written through the link (``_exec_attrs`` ->
``Publish._save_through_link``).  Here the new name is in another directory, ``d/g``,
which node A lists while its record is on its way: A holds the linked file on an inode
of its own for ``d/g`` (the holder), and the record's inode must take its names
(``take_names_of``).  Found by a review (stop 50); both cases failed before:

- without a fault, the holder's name ``d/g`` vanished from A (the lookup inside the
  batch: test_a_save_through_a_link_keeps_the_holders_names.py);
- with the object PUT's answer lost, the record failed after it set the link id, its
  retry rewrote the linked inode (``_rewrite_entry``) and never took the names: A held
  the linked file on two inodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from ckptfs.store.base import StoreTimeout
from support.core import reached, two_cores

pytestmark = pytest.mark.trio

MTIME = 1_700_000_000_000_000_001


@pytest.mark.parametrize("lose", [False, True], ids=["no_fault", "reply_lost"])
async def test_a_utime_written_through_a_link_leaves_one_inode_with_every_name(
        tmp_path: Path, lose: bool):
    store = MemoryStore()
    config = Config(durability="async", upload_hold=0.0, metadata_ttl=3600.0)
    async with two_cores(tmp_path, store, config) as (a, b):
        d = (await a.fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)).ino
        ino = await a.save(ROOT_INO, b"f", b"weights")
        with trio.fail_after(30):
            await a.fs.wait_idle()
        await b.fs.refresh_dir(ROOT_INO, force=True)
        landing = store.gate("put", prefix="dirs/root/f")
        await a.fs.setattr(ino, mtime_ns=MTIME)
        await reached(landing)
        await b.fs.link(await b.resolve("f"), await b.resolve("d"), b"g")
        await a.fs.refresh_dir(d, force=True)           # A: d/g, the linked file
        assert await a.names(d) == ["g"]
        lost = []

        def lose_answer(call) -> None:       # the object PUT lands, its answer is lost
            if call.error is None and not lost:
                lost.append(call.key)
                raise StoreTimeout("answer lost after the store acted")
        if lose:
            store.after(lose_answer, "put", prefix="inodes/", times=1)
        landing.release()
        with trio.fail_after(60):
            await a.fs.wait_idle()
        assert bool(lost) == lose
        assert await a.names(d) == ["g"], "A lost the name d/g"
        one, two = await a.resolve("f"), await a.resolve("d/g")
        assert one == two, "A holds the linked file on two inodes"
        for node in (a, b):
            for name in ("f", "d/g"):
                attrs = node.fs.getattr(await node.resolve(name))
                if node is b:
                    await node.fs.refresh_dir(ROOT_INO, force=True)
                    await node.fs.refresh_dir(await node.resolve("d"), force=True)
                    attrs = node.fs.getattr(await node.resolve(name))
                assert attrs.mtime_ns == MTIME, name
                assert await node.load(attrs.ino) == b"weights"
