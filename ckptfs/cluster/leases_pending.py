"""The pending side of the cluster seal leases (decision 0004; the overview is in
``leases.py``): whether a seal may go through now (no lease of another node, no writer
of this node, below the directory), the seals recorded as pending otherwise — with the
leases they wait for and those judged dead over this node's own clock — their
persistence, and the background loop that retries them.

Knows the namespace and the store; knows nothing of how a directory is sealed (the
filesystem passes ``seal`` in) nor of how leases are taken (``leases_held.py``).
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Awaitable, Callable

import trio

from ..errors import FsError
from ..store.retrypolicy import RetryPolicy
from .leases_common import DEAD_FACTOR, MAX_POLL, LeaseBook, Pending, lease_prefix
from ..meta.namespace import Inode
from ..format.remote import BadEntry, Entry, entry_key
from ..store import NotFound, StoreError

log = logging.getLogger("ckptfs.cluster.leases")

_META_PENDING = "lease_pending"


class PendingSeals:
    def __init__(self, book: LeaseBook, lease_ttl: float, in_session: Callable[[int], bool],
                 seal: Callable[[int], Awaitable[bool]]) -> None:
        """``in_session(ino)``: a working version is being written (no close has made it
        the closed version yet); ``seal(ino)``: the filesystem's seal."""
        self.book = book
        self.ns = book.ns
        self.store = book.store
        self.pending = book.pending
        self.renew_every = lease_ttl / 3
        # A pending seal LISTs the leases 0.2 s after asking, then 1.5 times slower each
        # time, at most a renewal period (and MAX_POLL) apart.
        self.pending_poll = RetryPolicy(attempts=None, base_delay=0.2, factor=1.5,
                                        max_delay=min(max(self.renew_every, 0.2), MAX_POLL))
        self.dead_after = lease_ttl * DEAD_FACTOR
        self._in_session = in_session
        self._seal = seal

    def _local_writers(self, dir_ino: int) -> int:
        """Files of this node below the directory still being written: a working
        version no close has made the closed one yet.  (Closed versions waiting for
        upload are the seal's own wait, ``Filesystem._pending_under``.)"""
        held = self.book.held.get(dir_ino)
        if held is None:
            return 0
        n = 0
        for ino in held.files:
            inode = self.ns.maybe_get(ino)
            if inode is not None and inode.parent and self._in_session(ino):
                n += 1
        return n

    async def may_seal(self, ino: int) -> bool:
        """See ``LeaseManager.may_seal``."""
        d = self.ns.get(ino)
        if not d.staged or not d.parent or d.dir_id is None:
            self.drop(ino)
            return True
        held = self.book.held.get(ino)
        local = self._local_writers(ino)
        if local or (held is not None and held.broken):
            self._record(d, local, [])
            return False
        prefix = lease_prefix(d.dir_id)
        try:
            listing = await self.book.call(lambda: list(self.store.list(prefix)))
        except StoreError as exc:
            raise FsError(errno.EIO, f"listing leases failed: {exc}") from None
        self.book.stats.lists += 1
        others = [o for o in listing if o.key[len(prefix):] != self.book.node_id]
        if others:
            self._record(d, 0, others)
            return False
        if ino in self.pending and not await self._still_staged_in_store(d):
            log.warning("%s is gone from the store (gc?); its pending seal is dropped",
                        self.book.path(ino))
            self.drop(ino)
            return False
        return True

    async def _still_staged_in_store(self, d: Inode) -> bool:
        parent = self.ns.maybe_get(d.parent)
        if parent is None or parent.dir_id is None:
            return False
        try:
            body, _ = await self.book.call(self.store.get, entry_key(parent.dir_id, d.name))
            self.book.stats.gets += 1
            entry = Entry.from_json(body, 1 << 40)
        except NotFound:
            return False
        except (StoreError, BadEntry) as exc:
            raise FsError(errno.EIO, f"checking {self.book.path(d.ino)} before sealing: "
                                     f"{exc}") from None
        return entry.type == "dir" and entry.id == d.dir_id and entry.staged

    def _record(self, d: Inode, local: int, others: list) -> None:
        """Record (or update) the pending seal of ``d``: what it waits for, what is dead."""
        now = time.monotonic()
        p = self.pending.get(d.ino)
        new = p is None
        if p is None:
            p = self.pending[d.ino] = Pending(d.ino, d.dir_id or "", time.time())
            self.persist()
        p.checks += 1
        p.next_check = now + self.pending_poll.delay(p.checks)
        p.local_writers = local
        dead = self._observe(p, others, now)
        p.waiting_for = sorted(p.seen) + ([self.book.node_id] if local else [])
        held = self.book.held.get(d.ino)
        if held is not None and held.broken:
            p.waiting_for.append(self.book.node_id)
            dead.append(self.book.node_id)
        p.dead = sorted(set(dead))
        self._log(p, new)

    def _observe(self, p: Pending, others: list, now: float) -> list[str]:
        """Note each other node's lease version and since when (this node's clock) it
        has not changed; returns the nodes whose lease stood still for ``dead_after``."""
        prefix = lease_prefix(p.dir_id)
        seen: dict[str, tuple[str, float, float]] = {}
        dead = []
        for obj in others:
            node = obj.key[len(prefix):]
            version = (obj.etag, obj.mtime)
            before = p.seen.get(node)
            first = before[2] if before is not None and before[:2] == version else now
            seen[node] = (obj.etag, obj.mtime, first)
            if now - first >= self.dead_after:
                dead.append(node)
        p.seen = seen
        return dead

    def _log(self, p: Pending, new: bool) -> None:
        if new or not p.logged:
            p.logged = True
            log.warning("seal of %s waits for node(s) %s still writing there",
                        self.book.path(p.ino), ", ".join(p.waiting_for))
        for node in p.dead:
            if node not in p.logged_dead:
                p.logged_dead.add(node)
                log.error("node %s's lease on %s is dead (not renewed for %.0f s, or its "
                          "files were abandoned): the checkpoint is incomplete and stays "
                          "staged; ckptfs gc reclaims it", node, self.book.path(p.ino),
                          self.dead_after)

    def drop(self, ino: int) -> None:
        if self.pending.pop(ino, None) is not None:
            self.persist()

    def writer_left(self, dir_ino: int) -> None:
        """A file of this node stopped counting under ``dir_ino``: a seal that waited
        for this node's own writers looks again now."""
        p = self.pending.get(dir_ino)
        if p is not None and p.local_writers:
            p.next_check = 0.0
        self.book.wake()

    def report(self) -> list[dict]:
        return [{"path": self.book.path(p.ino), "waiting_for": p.waiting_for,
                 "dead": p.dead, "local_writers": p.local_writers, "since": p.since}
                for p in self.pending.values()]

    def of(self, ino: int) -> dict | None:
        p = self.pending.get(ino)
        if p is None:
            return None
        return {"path": self.book.path(ino), "waiting_for": p.waiting_for, "dead": p.dead}

    # ------------------------------------------------------------------ persistence

    def persist(self) -> None:
        doc = {str(p.ino): {"dir_id": p.dir_id, "since": p.since}
               for p in self.pending.values()}
        self.ns.meta_put(_META_PENDING, json.dumps(doc))

    def restore(self) -> None:
        """The pending half of ``LeaseManager.restore``."""
        pending_doc = json.loads(self.ns.meta_get(_META_PENDING) or "{}")
        for key, rec in pending_doc.items():
            ino = int(key)
            d = self.ns.maybe_get(ino)
            if d is None or d.dir_id is None or d.dir_id != rec["dir_id"] or not d.staged:
                continue
            self.pending[ino] = Pending(ino, d.dir_id, rec.get("since", time.time()))
        self.persist()

    # ------------------------------------------------------------------ background

    async def loop(self, nursery: trio.Nursery) -> None:
        while True:
            now = time.monotonic()
            for p in list(self.pending.values()):
                if not p.checking and p.next_check <= now:
                    p.checking = True
                    nursery.start_soon(self._check, p)
            self.book.wake_event = trio.Event()
            with trio.move_on_after(0.1):
                await self.book.wake_event.wait()

    async def _check(self, p: Pending) -> None:
        try:
            sealed = await self._seal(p.ino)
            d = self.ns.maybe_get(p.ino)
            if sealed or d is None or not d.staged or not d.parent:
                if sealed:
                    log.info("sealed %s: the last lease below it is gone",
                             self.book.path(p.ino))
                self.drop(p.ino)
        except FsError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):   # gone or replaced
                self.drop(p.ino)
            else:
                log.warning("pending seal of %s: %s (retrying)", self.book.path(p.ino), exc)
                p.next_check = time.monotonic() + 2.0
        except Exception:  # noqa: BLE001 - a background task never takes the daemon down
            log.exception("pending seal of %s failed", self.book.path(p.ino))
            p.next_check = time.monotonic() + 5.0
        finally:
            p.checking = False

