"""A writer's open that joined (or started) a write session and was then refused,
because a rename replaced the file while the session was being made (its content
fetched from the store, a copy under way): ESTALE, and the kernel opens by name again.
The session stayed, held by no handle, with its staging file and the size it gave the
inode (0 for ``O_TRUNC``) -- shown to a reader of the replaced file lingering for its
2 s, and kept under ``abandoned/`` by the next start.  Found by a review (not proved
there).  Now such a session goes at once, and the inode shows its closed version's
size again."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.core import Config, linger
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from support.core import reached, two_cores
from ckptfs.store import MemoryStore

pytestmark = pytest.mark.trio

OLD = b"the version another node saved " * 3000


async def test_a_session_refused_at_the_open_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(linger, "REPLACED_LINGER", 0.2)
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="sync")) as (a, b):
        await b.save(ROOT_INO, b"f0", OLD)
        ino = await a.resolve("f0")             # no local copy on A: fetched at the open
        fetching = store.gate("get", prefix="chunks/")
        refused: list[int] = []

        async def open_for_writing() -> None:
            try:
                await a.fs.open(ino, os.O_RDWR, a.me())
            except FsError as exc:
                refused.append(exc.errno)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_for_writing)
            await reached(fetching)             # the session is being made
            await a.save(ROOT_INO, b"tmp", b"the new version")
            await a.fs.rename(ROOT_INO, b"tmp", ROOT_INO, b"f0", 0)
            reader = await a.fs.open(ino, os.O_RDONLY, a.me())     # lingering: allowed
            fetching.release()
        assert refused == [errno.ESTALE]
        rt = a.fs.runtime.get(ino)
        assert rt is None or rt.session is None, "the refused writer's session stayed"
        assert a.fs.getattr(ino).size == len(OLD), "the reader's file shows its size cut"
        assert await a.fs.read(reader.fh, 0, len(OLD) + 1) == OLD
        await a.fs.release(reader.fh)
        await trio.sleep(0.5)                   # (past the replaced file's linger)
        assert a.fs.ns.maybe_get(ino) is None
        assert not a.fs.staging.versions_of(ino), "its staging file stayed"
