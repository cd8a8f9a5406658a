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

The lease is on the *nearest* staged ancestor of a file.  This module knows the
namespace (to find that ancestor) and the store; it knows nothing of file bytes, of
FUSE, or of how a directory is sealed (the filesystem passes ``seal`` in).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from .errors import FsError
from .namespace import ROOT_INO, Inode, Namespace
from .remote import BadEntry, Entry, entry_key
from .retrypolicy import RetryPolicy
from .store import NotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

LEASE_ROOT = "leases/"
DEAD_FACTOR = 2.0            # unrenewed for lease_ttl × this: the holder is dead
MAX_POLL = 2.0               # a pending seal LISTs the leases at most this far apart
_META_NODE = "lease_node_id"
_META_HELD = "lease_held"
_META_PENDING = "lease_pending"


def lease_prefix(dir_id: str) -> str:
    return f"{LEASE_ROOT}{dir_id}/"


def lease_key(dir_id: str, node_id: str) -> str:
    return lease_prefix(dir_id) + node_id


@dataclass
class LeaseStats:
    puts: int = 0
    deletes: int = 0
    lists: int = 0
    gets: int = 0


@dataclass
class Held:
    """This node's lease on one staged directory."""

    dir_ino: int
    dir_id: str
    files: set[int] = field(default_factory=set)     # open for writing or unpublished
    broken: set[str] = field(default_factory=set)    # abandoned names: never renewed
    acquired: bool = False                           # the object is (believed) in the store
    last_put: float = 0.0                            # monotonic time of the last PUT
    idle_since: float | None = None                  # monotonic; set while files is empty
    seq: int = 0
    lock: trio.Lock = field(default_factory=trio.Lock)   # one store request at a time
    retry_at: float = 0.0                            # monotonic; after a failed request
    failures: int = 0                                # in a row; 0 while requests succeed


@dataclass
class Pending:
    """A seal this node was asked for, waiting for leases to go."""

    ino: int
    dir_id: str
    since: float                                     # wall time, for the status only
    next_check: float = 0.0                          # monotonic
    checks: int = 0                                  # LISTs so far (the poll backs off)
    waiting_for: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    local_writers: int = 0
    logged: bool = False
    logged_dead: set[str] = field(default_factory=set)
    seen: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    checking: bool = False


class LeaseManager:
    def __init__(self, ns: Namespace, store: ObjectStore, lease_ttl: float,
                 writers: Callable[[int], int], in_session: Callable[[int], bool],
                 queued: Callable[[int], bool],
                 seal: Callable[[int], Awaitable[bool]]) -> None:
        """``writers(ino)``: open writable handles; ``in_session(ino)``: a working version
        is being written (no close has made it the closed version yet); ``queued(ino)``:
        a closed version waits in the upload queue; ``seal(ino)``: the filesystem's seal."""
        self.ns = ns
        self.store = store
        # Async mode (local-first): an open waits at most this long for its lease PUT,
        # then goes on while the renewal task retries (None: wait for the store).
        self.open_wait: float | None = None
        self.ttl = lease_ttl
        self.renew_every = lease_ttl / 3
        # A failed renewal backs off from a quarter of the renewal period up to all of it
        # (a lease must not look dead to others because of it), never giving up.
        self.renew_retry = RetryPolicy(attempts=None, base_delay=self.renew_every / 4,
                                       max_delay=self.renew_every)
        # A pending seal LISTs the leases 0.2 s after asking, then 1.5 times slower each
        # time, at most a renewal period (and MAX_POLL) apart.
        self.pending_poll = RetryPolicy(attempts=None, base_delay=0.2, factor=1.5,
                                        max_delay=min(max(self.renew_every, 0.2), MAX_POLL))
        self.linger = min(lease_ttl / 3, 2.0)
        self.dead_after = lease_ttl * DEAD_FACTOR
        self._writers = writers
        self._in_session = in_session
        self._queued = queued
        self._seal = seal
        self.held: dict[int, Held] = {}          # staged dir ino -> lease
        self.file_dir: dict[int, int] = {}       # file ino -> staged dir ino it counts under
        self.pending: dict[int, Pending] = {}    # staged dir ino -> waiting seal
        self.stats = LeaseStats()
        self._wake = trio.Event()
        node = ns.meta_get(_META_NODE)
        if node is None:
            node = uuid.uuid4().hex[:16]
            ns.meta_put(_META_NODE, node)
        self.node_id = node

    # ------------------------------------------------------------------ store calls

    async def _call(self, fn, *args, abandon_on_cancel: bool = False):
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)

    def _body(self, held: Held) -> bytes:
        held.seq += 1   # the body changes on every renewal, so its ETag does too
        return json.dumps({"node": self.node_id, "dir": held.dir_id,
                           "host": socket.gethostname(), "pid": os.getpid(),
                           "seq": held.seq, "renewed_at": time.time()}).encode()

    async def _put(self, held: Held, abandon_on_cancel: bool = False) -> None:
        await self._call(self.store.put, lease_key(held.dir_id, self.node_id), self._body(held),
                         abandon_on_cancel=abandon_on_cancel)
        self.stats.puts += 1
        log.debug("lease PUT %s", lease_key(held.dir_id, self.node_id))
        held.acquired = True
        held.last_put = time.monotonic()

    async def _delete(self, held: Held) -> None:
        await self._call(self.store.delete, lease_key(held.dir_id, self.node_id))
        self.stats.deletes += 1
        log.debug("lease DELETE %s", lease_key(held.dir_id, self.node_id))
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

    def _busy(self, ino: int) -> bool:
        inode = self.ns.maybe_get(ino)
        if inode is None or not inode.parent:
            return False
        return self._writers(ino) > 0 or self._in_session(ino) or inode.dirty

    # ------------------------------------------------------------------ hooks from fs

    async def writing(self, inode: Inode) -> None:
        """A handle open for writing was created on ``inode``.  The first one below a
        staged directory takes this node's lease there before the open returns (so a
        seal that LISTs after this open saw it); every later one costs nothing."""
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
        self._persist_held()
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
                                    "retrying in the background", self._path(d.ino))
            except StoreError as exc:
                # The open goes on (the renewal task retries); until the PUT lands, a
                # seal on another node does not know about this writer.
                log.warning("could not take the lease on %s (%s); retrying in the "
                            "background", self._path(d.ino), exc)

    async def dir_id_changed(self, dir_ino: int, dir_id: str) -> None:
        """A directory made here joined another node's of the same name (async mode,
        decision 0012): this node's lease moves to the shared id before the join is
        done, so a seal there knows about this node's writers.  Store errors propagate
        (the join is retried)."""
        held = self.held.get(dir_ino)
        if held is None or held.dir_id == dir_id:
            return
        async with held.lock:
            old = Held(held.dir_ino, held.dir_id, acquired=held.acquired)
            held.dir_id, held.acquired = dir_id, False
            self._persist_held()
            if held.files:
                await self._put(held)
            if old.acquired:
                try:
                    await self._delete(old)
                except StoreError as exc:
                    log.info("old lease %s not deleted (%s): it expires",
                             lease_key(old.dir_id, self.node_id), exc)

    def settle(self, ino: int) -> None:
        """``ino`` may have been published, closed, abandoned or removed: if nothing of
        it is left to publish, it no longer holds its directory's lease."""
        dir_ino = self.file_dir.get(ino)
        if dir_ino is None or self._busy(ino):
            return
        del self.file_dir[ino]
        held = self.held.get(dir_ino)
        if held is None:
            return
        held.files.discard(ino)
        inode = self.ns.maybe_get(ino)
        if held.broken and inode is not None and inode.parent and inode.published:
            # The name that was abandoned has been written whole since: forgiven.
            name = self._relpath(inode, dir_ino)
            if name in held.broken:
                held.broken.discard(name)
                if not held.broken:
                    log.info("lease on %s is healthy again", self._path(dir_ino))
                    held.last_put = 0.0
        if not held.files:
            held.idle_since = time.monotonic()
        self._persist_held()
        p = self.pending.get(dir_ino)
        if p is not None and p.local_writers:
            p.next_check = 0.0     # it waited for this node's own writers: look again now
        self._wake.set()

    def abandoned(self, inode: Inode) -> None:
        """A file below a staged directory was left unpublished (its writer was killed,
        or a write failed): this node's part of the checkpoint is incomplete.  Its lease
        is neither renewed nor deleted, so it dies, and no seal lets the directory through
        (unless this node later writes the same name whole)."""
        dir_ino = self.file_dir.get(inode.ino)
        d = self.ns.maybe_get(dir_ino) if dir_ino else self.staged_dir_of(inode)
        if d is None or d.dir_id is None:
            return
        held = self.held.get(d.ino)
        if held is None:
            held = self.held[d.ino] = Held(d.ino, d.dir_id, acquired=False)
        name = self._relpath(inode, d.ino)
        held.broken.add(name)
        self._persist_held()
        log.warning("%s/%s was abandoned: this node's lease on %s is left to expire, so "
                    "the checkpoint stays staged (ckptfs gc reclaims it)", self._path(d.ino),
                    name, self._path(d.ino))
        self._wake.set()

    # ------------------------------------------------------------------ sealing

    def _local_writers(self, dir_ino: int) -> int:
        """Files of this node below the directory still being written: a working
        version no close has made the closed one yet.  (Closed versions waiting for
        upload are the seal's own wait, ``Filesystem._pending_under``.)"""
        held = self.held.get(dir_ino)
        if held is None:
            return 0
        n = 0
        for ino in held.files:
            inode = self.ns.maybe_get(ino)
            if inode is not None and inode.parent and self._in_session(ino):
                n += 1
        return n

    async def may_seal(self, ino: int) -> bool:
        """Called first by every seal.  True: no node holds a lease below the directory,
        go on.  False: the seal is recorded as pending (or dropped, if the directory is
        gone from the store) and completes in the background."""
        d = self.ns.get(ino)
        if not d.staged or not d.parent or d.dir_id is None:
            self._drop_pending(ino)
            return True
        held = self.held.get(ino)
        local = self._local_writers(ino)
        if local or (held is not None and held.broken):
            self._record_pending(d, local, [])
            return False
        prefix = lease_prefix(d.dir_id)
        try:
            listing = await self._call(lambda: list(self.store.list(prefix)))
        except StoreError as exc:
            raise FsError(errno.EIO, f"listing leases failed: {exc}") from None
        self.stats.lists += 1
        others = [o for o in listing if o.key[len(prefix):] != self.node_id]
        if others:
            self._record_pending(d, 0, others)
            return False
        if ino in self.pending and not await self._still_staged_in_store(d):
            log.warning("%s is gone from the store (gc?); its pending seal is dropped",
                        self._path(ino))
            self._drop_pending(ino)
            return False
        return True

    async def _still_staged_in_store(self, d: Inode) -> bool:
        parent = self.ns.maybe_get(d.parent)
        if parent is None or parent.dir_id is None:
            return False
        try:
            body, _ = await self._call(self.store.get, entry_key(parent.dir_id, d.name))
            self.stats.gets += 1
            entry = Entry.from_json(body, 1 << 40)
        except NotFound:
            return False
        except (StoreError, BadEntry) as exc:
            raise FsError(errno.EIO, f"checking {self._path(d.ino)} before sealing: {exc}") from None
        return entry.type == "dir" and entry.id == d.dir_id and entry.staged

    def _record_pending(self, d: Inode, local: int, others: list) -> None:
        now = time.monotonic()
        p = self.pending.get(d.ino)
        new = p is None
        if p is None:
            p = self.pending[d.ino] = Pending(d.ino, d.dir_id or "", time.time())
            self._persist_pending()
        p.checks += 1
        p.next_check = now + self.pending_poll.delay(p.checks)
        p.local_writers = local
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
        p.waiting_for = sorted(seen) + ([self.node_id] if local else [])
        held = self.held.get(d.ino)
        if held is not None and held.broken:
            p.waiting_for.append(self.node_id)
            dead.append(self.node_id)
        p.dead = sorted(set(dead))
        if new or not p.logged:
            p.logged = True
            log.warning("seal of %s waits for node(s) %s still writing there",
                        self._path(d.ino), ", ".join(p.waiting_for))
        for node in p.dead:
            if node not in p.logged_dead:
                p.logged_dead.add(node)
                log.error("node %s's lease on %s is dead (not renewed for %.0f s, or its "
                          "files were abandoned): the checkpoint is incomplete and stays "
                          "staged; ckptfs gc reclaims it", node, self._path(d.ino),
                          self.dead_after)

    def _drop_pending(self, ino: int) -> None:
        if self.pending.pop(ino, None) is not None:
            self._persist_pending()

    def pending_report(self) -> list[dict]:
        return [{"path": self._path(p.ino), "waiting_for": p.waiting_for, "dead": p.dead,
                 "local_writers": p.local_writers, "since": p.since}
                for p in self.pending.values()]

    def pending_of(self, ino: int) -> dict | None:
        p = self.pending.get(ino)
        if p is None:
            return None
        return {"path": self._path(ino), "waiting_for": p.waiting_for, "dead": p.dead}

    def held_report(self) -> list[dict]:
        return [{"path": self._path(h.dir_ino), "files": len(h.files),
                 "broken": sorted(h.broken), "acquired": h.acquired}
                for h in self.held.values()]

    def _path(self, ino: int) -> str:
        try:
            return self.ns.path_of(ino).decode(errors="replace")
        except FsError:
            return f"<inode {ino}>"

    # ------------------------------------------------------------------ persistence

    def _persist_held(self) -> None:
        doc = {str(h.dir_ino): {"dir_id": h.dir_id, "files": sorted(h.files),
                                "broken": sorted(h.broken), "acquired": h.acquired}
               for h in self.held.values() if h.acquired or h.broken or h.files}
        self.ns.meta_put(_META_HELD, json.dumps(doc))

    def _persist_pending(self) -> None:
        doc = {str(p.ino): {"dir_id": p.dir_id, "since": p.since}
               for p in self.pending.values()}
        self.ns.meta_put(_META_PENDING, json.dumps(doc))

    def restore(self) -> None:
        """After the journal replay: take back the leases and pending seals of the
        previous run.  A file that was being written when the daemon died (a working
        version newer than its closed one) is lost: its lease is broken.  Closed files
        waiting for upload keep the lease until they are published."""
        held_doc = json.loads(self.ns.meta_get(_META_HELD) or "{}")
        for key, rec in held_doc.items():
            d = self.ns.maybe_get(int(key))
            if d is None or d.dir_id != rec["dir_id"]:
                continue
            held = Held(d.ino, d.dir_id, broken=set(rec.get("broken", ())),
                        acquired=bool(rec.get("acquired", True)))
            for ino in rec.get("files", ()):
                inode = self.ns.maybe_get(ino)
                if inode is None or not inode.parent:
                    continue
                if inode.max_ver > inode.ver or (inode.dirty and not self._queued(ino)):
                    held.broken.add(self._relpath(inode, d.ino))
                elif inode.dirty:
                    held.files.add(ino)
                    self.file_dir[ino] = d.ino
            if held.broken:
                log.error("a writer below %s was cut off by the daemon's restart: the lease "
                          "there is left to expire", self._path(d.ino))
            if not held.files:
                held.idle_since = time.monotonic()
            self.held[d.ino] = held
        self._persist_held()
        pending_doc = json.loads(self.ns.meta_get(_META_PENDING) or "{}")
        for key, rec in pending_doc.items():
            ino = int(key)
            d = self.ns.maybe_get(ino)
            if d is None or d.dir_id != rec["dir_id"] or not d.staged:
                continue
            self.pending[ino] = Pending(ino, d.dir_id, rec.get("since", time.time()))
        self._persist_pending()

    # ------------------------------------------------------------------ background

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            nursery.start_soon(self._renew_loop)
            nursery.start_soon(self._pending_loop, nursery)

    async def _renew_loop(self) -> None:
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
                                    self._path(held.dir_ino), exc)
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
                        self._persist_held()
                        self._wake.set()
                    return
            if not held.acquired or now - held.last_put >= self.renew_every:
                await self._put(held)

    async def _pending_loop(self, nursery: trio.Nursery) -> None:
        while True:
            now = time.monotonic()
            for p in list(self.pending.values()):
                if not p.checking and p.next_check <= now:
                    p.checking = True
                    nursery.start_soon(self._check_pending, p)
            self._wake = trio.Event()
            with trio.move_on_after(0.1):
                await self._wake.wait()

    async def _check_pending(self, p: Pending) -> None:
        try:
            sealed = await self._seal(p.ino)
            d = self.ns.maybe_get(p.ino)
            if sealed or d is None or not d.staged or not d.parent:
                if sealed:
                    log.info("sealed %s: the last lease below it is gone", self._path(p.ino))
                self._drop_pending(p.ino)
        except FsError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):   # gone or replaced
                self._drop_pending(p.ino)
            else:
                log.warning("pending seal of %s: %s (retrying)", self._path(p.ino), exc)
                p.next_check = time.monotonic() + 2.0
        except Exception:  # noqa: BLE001 - a background task never takes the daemon down
            log.exception("pending seal of %s failed", self._path(p.ino))
            p.next_check = time.monotonic() + 5.0
        finally:
            p.checking = False

    async def shutdown(self) -> None:
        """Clean unmount: nothing is being written any more; release what is idle now
        instead of leaving it to die (a dead lease would block the seal for good)."""
        for held in list(self.held.values()):
            if held.files or held.broken or not held.acquired:
                continue
            try:
                async with held.lock:
                    await self._delete(held)
                self.held.pop(held.dir_ino, None)
            except StoreError as exc:
                log.warning("could not release the lease on %s: %s", self._path(held.dir_ino),
                            exc)
        self._persist_held()
