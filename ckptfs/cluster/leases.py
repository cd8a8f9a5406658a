"""Cluster seal leases (docs/decisions/0004-cluster-seal-leases.md).

Many nodes may write into one staged checkpoint directory; one node's completion mark
must not make it visible while another node is still writing there.  Each node says
"I am writing below staged directory D" with one small object in the store,
``leases/<D's dir-id>/<node-id>``: PUT at the node's first file opened for writing
below D, renewed every ``lease_ttl / 3`` while any such file is open or closed but not
yet published, DELETED a short linger after the last one is published (so a rank
writing its files one after another costs one PUT and one DELETE, not two per file).

A seal (mark, pointer, rename, fsync on the directory, ``ckptfs commit``) LISTs
``leases/<D>/``: with other nodes' leases there (or this node's own writers still
writing) it is recorded as pending, persisted, and completed by the background task
once the leases are gone.  A lease that stops changing for ``lease_ttl × DEAD_FACTOR``
— judged by its ETag/LastModified as this node sees them over its own monotonic clock,
never by comparing two nodes' wall clocks — belongs to a node that died or gave up (a
killed writer's file was abandoned): the seal never goes through, and ``ckptfs gc``
reclaims the tree with its leases after the grace period.

The lease is on the *nearest* staged ancestor of a file.  This module is the façade the
filesystem and the daemon call; the work is in ``leases_held.py`` (taking, renewing,
releasing this node's leases), ``leases_pending.py`` (may a seal go through; pending
seals and their retries) and ``leases_common.py`` (keys, records, the shared tables).
It knows the namespace (to find that ancestor) and the store; it knows nothing of file
bytes, of FUSE, or of how a directory is sealed (the filesystem passes ``seal`` in).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import trio

from .leases_common import (DEAD_FACTOR, LEASE_ROOT, MAX_POLL, Held, LeaseBook, LeaseStats,
                            Pending, lease_key, lease_prefix)
from .leases_held import HeldLeases
from .leases_pending import PendingSeals
from ..meta.namespace import Inode, Namespace
from ..store import ObjectStore

__all__ = ["DEAD_FACTOR", "LEASE_ROOT", "MAX_POLL", "Held", "LeaseManager", "LeaseStats",
           "Pending", "lease_key", "lease_prefix"]


class LeaseManager:
    """What the filesystem and the daemon call; each method delegates to one side."""

    def __init__(self, ns: Namespace, store: ObjectStore, lease_ttl: float,
                 writers: Callable[[int], int], in_session: Callable[[int], bool],
                 queued: Callable[[int], bool],
                 seal: Callable[[int], Awaitable[bool]]) -> None:
        """``writers(ino)``: open writable handles; ``in_session(ino)``: a working version
        is being written (no close has made it the closed version yet); ``queued(ino)``:
        a closed version waits in the upload queue; ``seal(ino)``: the filesystem's seal."""
        self.ns = ns
        self.store = store
        self.ttl = lease_ttl
        self.book = LeaseBook(ns, store)
        self.holding = HeldLeases(self.book, lease_ttl, writers, in_session, queued)
        self.seals = PendingSeals(self.book, lease_ttl, in_session, seal)

    # ------------------------------------------------------------------ state

    @property
    def node_id(self) -> str:
        return self.book.node_id

    @property
    def stats(self) -> LeaseStats:
        return self.book.stats

    @property
    def held(self) -> dict[int, Held]:
        return self.book.held          # staged dir ino -> lease

    @property
    def file_dir(self) -> dict[int, int]:
        return self.book.file_dir      # file ino -> staged dir ino it counts under

    @property
    def pending(self) -> dict[int, Pending]:
        return self.book.pending       # staged dir ino -> waiting seal

    @property
    def renew_retry(self):
        """Backoff of a failed lease renewal (retrypolicy.RetryPolicy)."""
        return self.holding.renew_retry

    @property
    def pending_poll(self):
        """How often a pending seal LISTs the leases (retrypolicy.RetryPolicy)."""
        return self.seals.pending_poll

    @property
    def open_wait(self) -> float | None:
        """Async mode (local-first): an open waits at most this long for its lease PUT,
        then goes on while the renewal task retries (None: wait for the store)."""
        return self.holding.open_wait

    @open_wait.setter
    def open_wait(self, seconds: float | None) -> None:
        self.holding.open_wait = seconds

    def staged_dir_of(self, inode: Inode) -> Inode | None:
        """The nearest staged ancestor of ``inode`` (not the inode itself)."""
        return self.holding.staged_dir_of(inode)

    # ------------------------------------------------------------------ hooks from fs

    async def writing(self, inode: Inode) -> None:
        """A handle open for writing was created on ``inode``.  The first one below a
        staged directory takes this node's lease there before the open returns (so a
        seal that LISTs after this open saw it); every later one costs nothing."""
        await self.holding.writing(inode)

    async def dir_id_changed(self, dir_ino: int, dir_id: str) -> None:
        """A directory made here joined another node's of the same name (async mode,
        decision 0012): this node's lease moves to the shared id before the join is
        done, so a seal there knows about this node's writers.  Store errors propagate
        (the join is retried)."""
        await self.holding.dir_id_changed(dir_ino, dir_id)

    def settle(self, ino: int) -> None:
        """``ino`` may have been published, closed, abandoned or removed: if nothing of
        it is left to publish, it no longer holds its directory's lease."""
        dir_ino = self.holding.settle(ino)
        if dir_ino is not None:
            self.seals.writer_left(dir_ino)

    def handed_over(self, ino: int, to: int) -> None:
        """``ino``'s owed closed version became ``to``'s (a fresh inode took its name
        beside readers, core/taken.py): the lease it held below a staged directory is
        ``to``'s now, until that publish lands."""
        self.holding.handed_over(ino, to)

    def abandoned(self, inode: Inode) -> None:
        """A file below a staged directory was left unpublished (its writer was killed,
        or a write failed): this node's part of the checkpoint is incomplete.  Its lease
        is neither renewed nor deleted, so it dies, and no seal lets the directory through
        (unless this node later writes the same name whole)."""
        self.holding.abandoned(inode)

    # ------------------------------------------------------------------ sealing

    async def may_seal(self, ino: int) -> bool:
        """Called first by every seal.  True: no node holds a lease below the directory,
        go on.  False: the seal is recorded as pending (or dropped, if the directory is
        gone from the store) and completes in the background."""
        return await self.seals.may_seal(ino)

    def pending_report(self) -> list[dict]:
        return self.seals.report()

    def pending_of(self, ino: int) -> dict | None:
        return self.seals.of(ino)

    def held_report(self) -> list[dict]:
        return self.holding.report()

    # ------------------------------------------------------------------ lifetime

    def restore(self, cut_off: Mapping[int, bytes] | None = None) -> None:
        """After the journal replay: take back the leases and pending seals of the
        previous run.  A file that was being written when the daemon died (``cut_off``:
        recovery found its working version unclosed, or removed a new file never
        closed; with its path then) is lost: its lease is broken.
        Closed files waiting for upload keep the lease until they are published.  (A
        version number past the closed one is no sign of that: a session that ended
        with nothing written leaves one.)"""
        self.holding.restore(cut_off or {})
        self.seals.restore()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            nursery.start_soon(self.holding.renew_loop)
            nursery.start_soon(self.seals.loop, nursery)

    async def shutdown(self) -> None:
        """Clean unmount: nothing is being written any more; release what is idle now
        instead of leaving it to die (a dead lease would block the seal for good)."""
        await self.holding.shutdown()
