"""Found by a review: kernel writes through a passthrough writer's handle after its
close, once the name had moved to a fresh inode that took the owed version over
(``taken.hand_owed_version_to``: a hard link of the same staging file).  Those writes
landed in the fresh inode's file too -- the file the name shows on this node -- but
the release of that handle found its inode nameless (``Release._written_after_close``
returns) and nothing published them: this node showed bytes no other node ever saw.
Now a version with a handle that wrote still open does not move: the late writes
become its next version, published as before."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, reached, two_cores

pytestmark = pytest.mark.trio

CLOSED = b"P" * 40000
LATER = b"C" * 100


async def test_late_kernel_writes_never_split_the_nodes(tmp_path: Path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, Config(durability="async",
                                                 upload_hold=0.0)) as (a, b):
        a.fs.st.passthrough_available = lambda: True
        uploading = store.gate("put", prefix="chunks/", times=1000)
        handle, inode = await a.fs.create(ROOT_INO, b"f", 0o644, WRITE_NEW, 0, 0, a.me())
        assert handle.passthrough
        path = a.fs.st.staging.path(inode.ino, a.fs.st.runtime[inode.ino].session.ver)
        with open(path, "r+b") as kernel:
            kernel.write(CLOSED)
        await a.fs.flush(handle.fh)             # the parent's close; a child holds it
        await reached(uploading)                # CLOSED is owed to the store
        reader = await a.fs.open(inode.ino, os.O_RDONLY, a.me())
        with pytest.raises(FsError) as refused:     # another writer's open
            await a.fs.open(inode.ino, os.O_WRONLY | os.O_TRUNC, a.me())
        # The name stays (a handle that wrote is open: ``taken.may_hand_over``), and
        # the writer is refused past the wait, as beside any passthrough writer's
        # version (decision 0019).
        assert refused.value.errno == errno.EBUSY
        assert await a.resolve("f") == inode.ino
        uploading.release()
        with trio.fail_after(30):
            await a.fs.wait_idle()
        with open(path, "r+b") as kernel:       # the child writes on, then exits
            kernel.write(LATER)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        await a.fs.release(handle.fh)
        await a.fs.release(reader.fh)
        with trio.fail_after(30):
            await a.fs.wait_idle()
        here = await a.load(await a.resolve("f"))
        await b.fs.refresh_dir(ROOT_INO, force=True)
        there = await b.load(await b.resolve("f"))
        assert here[:100] == there[:100], \
            f"this node shows {here[:4]!r}..., the store {there[:4]!r}...: split"
