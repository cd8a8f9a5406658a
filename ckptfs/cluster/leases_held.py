"""The held side of the cluster seal leases (decision 0004; the overview is in
``leases.py``): this node's lease on each staged directory it writes below — taken at
the first file opened for writing there, renewed while any such file is unpublished,
deleted a linger after the last one, left to die when a file was abandoned — and its
persistence across a restart.

Knows the namespace (to find a file's nearest staged ancestor) and the store; knows
nothing of file bytes, FUSE, or seals (``leases_pending.py``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

import trio

from ..errors import FsError
from ..store.retrypolicy import RetryPolicy
from .leases_common import Held, LeaseBook, lease_key
from ..meta.namespace import ROOT_INO, Inode
from ..store import StoreError

log = logging.getLogger("ckptfs.cluster.leases")

_META_HELD = "lease_held"


class HeldLeases:
    def __init__(self, book: LeaseBook, lease_ttl: float, writers: Callable[[int], int],
                 in_session: Callable[[int], bool], queued: Callable[[int], bool]) -> None:
        """``writers(ino)``: open writable handles; ``in_session(ino)``: a working version
        is being written; ``queued(ino)``: a closed version waits in the upload queue."""
        self.book = book
        self.ns = book.ns
        self.store = book.store
        self.held = book.held
        self.file_dir = book.file_dir
        # Async mode (local-first): an open waits at most this long for its lease PUT,
        # then goes on while the renewal task retries (None: wait for the store).
        self.open_wait: float | None = None
        self.renew_every = lease_ttl / 3
        # A failed renewal backs off from a quarter of the renewal period up to all of it
        # (a lease must not look dead to others because of it), never giving up.
        self.renew_retry = RetryPolicy(attempts=None, base_delay=self.renew_every / 4,
                                       max_delay=self.renew_every)
        self.linger = min(lease_ttl / 3, 2.0)
        self._writers = writers
        self._in_session = in_session
        self._queued = queued

    # ------------------------------------------------------------------ store calls

    def _body(self, held: Held) -> bytes:
        held.seq += 1   # the body changes on every renewal, so its ETag does too
        return json.dumps({"node": self.book.node_id, "dir": held.dir_id,
                           "host": socket.gethostname(), "pid": os.getpid(),
                           "seq": held.seq, "renewed_at": time.time()}).encode()

    async def _put(self, held: Held, abandon_on_cancel: bool = False) -> None:
        key = lease_key(held.dir_id, self.book.node_id)
        await self.book.call(self.store.put, key, self._body(held),
                             abandon_on_cancel=abandon_on_cancel)
        self.book.stats.puts += 1
        log.debug("lease PUT %s", key)
        held.acquired = True
        held.last_put = time.monotonic()

    async def _delete(self, held: Held) -> None:
        key = lease_key(held.dir_id, self.book.node_id)
        await self.book.call(self.store.delete, key)
        self.book.stats.deletes += 1
        log.debug("lease DELETE %s", key)
        held.acquired = False

    # ------------------------------------------------------------------ where a file counts

    def staged_dir_of(self, inode: Inode) -> Inode | None:
        """The nearest staged ancestor of ``inode`` (not the inode itself)."""
        ino = inode.parent
        while ino and ino != ROOT_INO:
            d = self.ns.maybe_get(ino)
            if d is None:
                return None
            if d.staged:
                return d
            ino = d.parent
        return None

    def _relpath(self, inode: Inode, dir_ino: int) -> str:
        parts = []
        cur: Inode | None = inode
        while cur is not None and cur.ino != dir_ino and cur.parent:
            parts.append(cur.name.decode("utf-8", "surrogateescape"))
            cur = self.ns.maybe_get(cur.parent)
        return "/".join(reversed(parts)) or f"<inode {inode.ino}>"

    def _below(self, path: bytes, dir_ino: int) -> str:
        """``path`` (from the mount's root) relative to the directory ``dir_ino``."""
        try:
            top = self.ns.path_of(dir_ino).rstrip(b"/") + b"/"
        except FsError:             # (a directory above it has no name left here)
            top = b"\0"
        rel = path[len(top):] if path.startswith(top) else path
        return rel.decode("utf-8", "surrogateescape")

    def _busy(self, ino: int) -> bool:
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.parent:
            return False
        return self._writers(ino) > 0 or self._in_session(ino) or inode.dirty

    # ------------------------------------------------------------------ hooks from fs

    async def writing(self, inode: Inode) -> None:
        """See ``LeaseManager.writing``."""
        if inode.ino in self.file_dir:
            return
        d = self.staged_dir_of(inode)
        if d is None or d.dir_id is None:
            return
        held = self.held.get(d.ino)
        if held is None:
            held = self.held[d.ino] = Held(d.ino, d.dir_id)
        held.files.add(inode.ino)
        held.idle_since = None
        self.file_dir[inode.ino] = d.ino
        self.persist()
        if (held.acquired or held.broken) and not held.lock.locked():
            return
        # Serialized with the renewal task: a DELETE of the lingering lease in flight
        # must land before this PUT, not after it.
        async with held.lock:
            if held.acquired or held.broken:
                return
            try:
                if self.open_wait is None:
                    await self._put(held)
                else:
                    with trio.move_on_after(self.open_wait) as scope:
                        await self._put(held, abandon_on_cancel=True)
                    if scope.cancelled_caught:
                        log.warning("the lease on %s is not taken yet (the store is slow); "
                                    "retrying in the background", self.book.path(d.ino))
            except StoreError as exc:
                # The open goes on (the renewal task retries); until the PUT lands, a
                # seal on another node does not know about this writer.
                log.warning("could not take the lease on %s (%s); retrying in the "
                            "background", self.book.path(d.ino), exc)

    async def dir_id_changed(self, dir_ino: int, dir_id: str) -> None:
        """See ``LeaseManager.dir_id_changed``."""
        held = self.held.get(dir_ino)
        if held is None or held.dir_id == dir_id:
            return
        async with held.lock:
            old = Held(held.dir_ino, held.dir_id, acquired=held.acquired)
            held.dir_id, held.acquired = dir_id, False
            self.persist()
            if held.files:
                await self._put(held)
            if old.acquired:
                try:
                    await self._delete(old)
                except StoreError as exc:
                    log.info("old lease %s not deleted (%s): it expires",
                             lease_key(old.dir_id, self.book.node_id), exc)

    def settle(self, ino: int) -> int | None:
        """See ``LeaseManager.settle``.  Returns the staged directory ``ino`` no longer
        counts under (its pending seal may look again), None if nothing changed."""
        dir_ino = self.file_dir.get(ino)
        if dir_ino is None or self._busy(ino):
            return None
        del self.file_dir[ino]
        held = self.held.get(dir_ino)
        if held is None:
            return None
        held.files.discard(ino)
        inode = self.ns.maybe_get(ino)
        if held.broken and inode is not None and inode.parent and inode.published:
            # The name that was abandoned has been written whole since: forgiven.
            name = self._relpath(inode, dir_ino)
            if name in held.broken:
                held.broken.discard(name)
                if not held.broken:
                    log.info("lease on %s is healthy again", self.book.path(dir_ino))
                    held.last_put = 0.0
        if not held.files:
            held.idle_since = time.monotonic()
        self.persist()
        return dir_ino

    def handed_over(self, ino: int, to: int) -> None:
        """See ``LeaseManager.handed_over``."""
        dir_ino = self.file_dir.pop(ino, None)
        if dir_ino is None:
            return
        self.file_dir[to] = dir_ino
        held = self.held.get(dir_ino)
        if held is not None:
            held.files.discard(ino)
            held.files.add(to)
        self.persist()

    def abandoned(self, inode: Inode) -> None:
        """See ``LeaseManager.abandoned``."""
        dir_ino = self.file_dir.get(inode.ino)
        d = self.ns.maybe_get(dir_ino) if dir_ino else self.staged_dir_of(inode)
        if d is None or d.dir_id is None:
            return
        held = self.held.get(d.ino)
        if held is None:
            held = self.held[d.ino] = Held(d.ino, d.dir_id, acquired=False)
        name = self._relpath(inode, d.ino)
        held.broken.add(name)
        self.persist()
        log.warning("%s/%s was abandoned: this node's lease on %s is left to expire, so "
                    "the checkpoint stays staged (ckptfs gc reclaims it)",
                    self.book.path(d.ino), name, self.book.path(d.ino))
        self.book.wake()

    def report(self) -> list[dict]:
        return [{"path": self.book.path(h.dir_ino), "files": len(h.files),
                 "broken": sorted(h.broken), "acquired": h.acquired}
                for h in self.held.values()]

    # ------------------------------------------------------------------ persistence

    def persist(self) -> None:
        doc = {str(h.dir_ino): {"dir_id": h.dir_id, "files": sorted(h.files),
                                "broken": sorted(h.broken), "acquired": h.acquired}
               for h in self.held.values() if h.acquired or h.broken or h.files}
        self.ns.meta_put(_META_HELD, json.dumps(doc))

    def restore(self, cut_off: Mapping[int, bytes]) -> None:
        """The held half of ``LeaseManager.restore``."""
        held_doc = json.loads(self.ns.meta_get(_META_HELD) or "{}")
        for key, rec in held_doc.items():
            d = self.ns.maybe_get(int(key))
            if d is None or d.dir_id is None or d.dir_id != rec["dir_id"]:
                continue
            held = Held(d.ino, d.dir_id, broken=set(rec.get("broken", ())),
                        acquired=bool(rec.get("acquired", True)))
            for ino in rec.get("files", ()):
                inode = self.ns.maybe_get(ino)
                if inode is None or not inode.parent:
                    if ino in cut_off:      # a new file never closed: recovery removed it
                        held.broken.add(self._below(cut_off[ino], d.ino))
                    continue
                if ino in cut_off or (inode.dirty and not self._queued(ino)):
                    held.broken.add(self._relpath(inode, d.ino))
                elif inode.dirty:
                    held.files.add(ino)
                    self.file_dir[ino] = d.ino
            if held.broken:
                log.error("a writer below %s was cut off by the daemon's restart: the lease "
                          "there is left to expire", self.book.path(d.ino))
            if not held.files:
                held.idle_since = time.monotonic()
            self.held[d.ino] = held
        self.persist()

    # ------------------------------------------------------------------ background

    async def renew_loop(self) -> None:
        tick = max(0.05, min(0.25, self.linger / 4))
        while True:
            await trio.sleep(tick)
            for held in list(self.held.values()):
                if time.monotonic() < held.retry_at:
                    continue
                try:
                    await self._tend(held)
                    held.failures = 0
                except StoreError as exc:
                    # Backs off by renew_retry; said once per failing streak.
                    held.failures += 1
                    if held.failures == 1:
                        log.warning("lease on %s: %s (retrying with back-off)",
                                    self.book.path(held.dir_ino), exc)
                    held.retry_at = time.monotonic() + self.renew_retry.delay(held.failures)
                except Exception:  # noqa: BLE001 - a background task never takes the daemon down
                    log.exception("lease task failed")

    async def _tend(self, held: Held) -> None:
        if held.lock.locked():
            return
        async with held.lock:
            now = time.monotonic()
            if held.broken:
                # Never renewed, never deleted: it dies.  Written once if it never was.
                if not held.acquired:
                    await self._put(held)
                return
            if not held.files:
                if held.idle_since is not None and now - held.idle_since >= self.linger:
                    if held.acquired:
                        await self._delete(held)
                    # A file that joined during the DELETE PUTs again (it waits on the lock).
                    if not held.files and self.held.get(held.dir_ino) is held:
                        del self.held[held.dir_ino]
                        self.persist()
                        self.book.wake()
                    return
            if not held.acquired or now - held.last_put >= self.renew_every:
                await self._put(held)

    async def shutdown(self) -> None:
        """See ``LeaseManager.shutdown``."""
        for held in list(self.held.values()):
            if held.files or held.broken or not held.acquired:
                continue
            try:
                async with held.lock:
                    await self._delete(held)
                self.held.pop(held.dir_ino, None)
            except StoreError as exc:
                log.warning("could not release the lease on %s: %s",
                            self.book.path(held.dir_ino), exc)
        self.persist()
