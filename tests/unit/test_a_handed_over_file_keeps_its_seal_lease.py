"""Found by a review: a truncate by name beside a reader of a version not in the store yet, in
a staged checkpoint directory.  The owed version (and the truncate's version after it)
goes to a fresh inode (``taken.hand_owed_version_to``), which never counts under the
directory's seal lease (``LeaseManager.writing`` runs only at a writable open or a
create; ``file_dir`` still names the old inode).  At the reader's release the old,
nameless inode settles, the lease has no file left, lingers and goes -- while this
node still owes the store the file: another node's mark then seals (and shows) the
checkpoint without it.  Before the hand-over the old inode, owing the version, kept
the lease until its publish."""

from __future__ import annotations

import errno
import os

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.format.remote import CHUNKS_PREFIX
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import two_cores

pytestmark = pytest.mark.trio

CONFIG = Config(durability="async", metadata_ttl=0.0, upload_hold=0.0, lease_ttl=3.0)
SHARD = b"rank 1's shard " * 1000


async def test_the_lease_stays_while_the_file_taken_over_is_owed(tmp_path):
    store = MemoryStore()
    async with two_cores(tmp_path, store, CONFIG) as (a, b):
        for node in (a, b):
            await node.fs.st.nursery.start(node.fs.leases.run)
        ck = await a.fs.mkdir(ROOT_INO, b"checkpoint-3", 0o755, 0, 0)
        await a.fs.wait_idle()
        ck_b = await b.resolve("checkpoint-3")
        gate = store.gate("put", prefix=CHUNKS_PREFIX, times=1000)
        try:
            old = await b.save(ck_b, b"shard-1.bin", SHARD)      # owed to the store
            with trio.fail_after(10):
                while b.fs.st.oplog.pending or \
                        not any(k.startswith("leases/") for k in store.keys()):
                    await trio.sleep(0.01)
            reader = await b.fs.open(old, os.O_RDONLY, b.me())
            with pytest.raises(FsError) as moved:              # truncate -s N shard-1.bin
                await b.fs.setattr(old, size=100)
            assert moved.value.errno == errno.ESTALE
            fresh = (await b.fs.lookup(ck_b, b"shard-1.bin")).ino
            assert fresh != old
            await b.fs.setattr(fresh, size=100)                 # the kernel's retry
            await b.fs.release(reader.fh)
            await trio.sleep(2.0)                               # past the lease's linger
            assert fresh in b.fs.st.queue.queued, "(the file is still owed)"
            lease_kept = any(k.startswith("leases/") for k in store.keys())
            await a.save(ck.ino, b"trainer_state.json", b'{"global_step": 3}')  # the mark
            shown = await a.names()
            assert lease_kept and shown == [], \
                f"node b's lease went while it still owes the store a file below " \
                f"(lease kept: {lease_kept}); node a shows {shown} sealed without it"
        finally:
            gate.release()
