"""A release never waits for the kernel's entry invalidation.

When an open made by create fails in the kernel after the daemon answered, the kernel
sends a release and waits for its answer while the creating process still holds the
parent directory's lock; invalidating the name takes that same lock.  A release that
awaited the invalidation hung both for ever (seen with a failed passthrough open).  The
invalidation goes on in the background; the name is dropped from the namespace at once.
"""

from __future__ import annotations

import pytest
import trio

from ckptfs.core import Config
from ckptfs.errors import FsError
from ckptfs.meta.namespace import ROOT_INO
from ckptfs.store import MemoryStore
from support.core import WRITE_NEW, me, open_core

pytestmark = pytest.mark.trio


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_release_after_a_failed_create_answers_while_the_kernel_holds_the_lock(
        tmp_path, durability):
    lock_released = trio.Event()         # the kernel's directory lock: never released here
    invalidations: list[tuple[int, bytes]] = []

    async def invalidate_entry(parent: int, name: bytes) -> None:
        invalidations.append((parent, name))
        await lock_released.wait()

    async with open_core(tmp_path, MemoryStore(), Config(durability=durability),
                         invalidate_entry=invalidate_entry) as fs:
        handle, _ = await fs.create(ROOT_INO, b"new.bin", 0o644, WRITE_NEW, 0, 0, me())
        with trio.move_on_after(30) as waited:     # a bound, not a timing assertion
            await fs.release(handle.fh)             # no flush: the kernel's open failed
        assert not waited.cancelled_caught, "release waited for the directory lock"
        with pytest.raises(FsError):
            await fs.lookup(ROOT_INO, b"new.bin")   # never closed: not there
        for _ in range(100):
            if invalidations:
                break
            await trio.sleep(0.01)
        assert invalidations == [(ROOT_INO, b"new.bin")]    # still asked, in the background
