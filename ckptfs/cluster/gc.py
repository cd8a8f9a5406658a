"""Garbage collection over the remote format (decision 0003): staged checkpoint trees
older than the grace period, then chunks no entry references, in two phases so that
writers that deduplicate against the store never lose a chunk.

One pass (one ``collect`` call) with generation X:

1. walks the tree from the root (iteratively, tolerating directory-id loops) and removes
   staged trees older than the grace period (unless a node still renews a seal lease
   below them), then seal leases not renewed within the grace period and rmdir's
   removal marks older than it;
2. if the previous pass condemned chunks (X's *candidates*), announces "marking" in
   ``gc/state.json`` and waits ``settle`` seconds;
3. marks: lists every entry under ``dirs/`` and every shared inode object of a hard
   link under ``inodes/`` (decision 0008), reachable or not, and reads the new ones;
   an entry it cannot parse stops the pass here: no chunk is deleted;
4. if some candidates are unreferenced, announces "deleting", waits ``settle`` seconds,
   lists the chunks and deletes those candidates that are still unreferenced and were not
   PUT again since the marking announcement (store LastModified times), within a lease;
5. condemns the unreferenced chunks older than the grace period for pass X+1, and
   announces "idle".

Works on the ``ObjectStore`` alone (blocking; run it in a thread); knows nothing of
inodes or FUSE.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .leases import LEASE_ROOT, lease_prefix
from ..data.liveness import (DELETING, GC_CANDIDATES_PREFIX, GC_CLOCK_KEY, GC_STATE_KEY, IDLE,
                       MARKING, GcState, candidates_key, read_candidates)
from ..format.remote import (REMOVED_PREFIX, ROOT_DIR_ID, BadEntry, Entry, decode_name,
                             dir_prefix)
from ..store import NotFound, ObjectStore, PreconditionFailed, StoreError

log = logging.getLogger(__name__)

HISTORY = 32                # passes whose candidate sets writers can still look up
MARK_DEADLINE = 6 * 3600.0  # a pass that marks for longer deletes nothing
CLOCK_SKEW = 1.0            # seconds: LastModified is whole seconds on S3


class GcConflict(Exception):
    """Another gc pass is running (or won the race to start)."""


@dataclass
class GcReport:
    staged_trees: list[str] = field(default_factory=list)   # paths removed (or to remove)
    entries_deleted: int = 0
    chunks_deleted: int = 0
    chunk_bytes_deleted: int = 0
    chunks_kept: int = 0
    chunks_condemned: int = 0
    leases_deleted: int = 0
    removal_marks_deleted: int = 0
    orphan_inodes: list[str] = field(default_factory=list)   # inode objects no name links to
    bad_entries: list[str] = field(default_factory=list)    # keys gc could not parse
    generation: int = 0
    stopped: str | None = None     # why no chunk was deleted, when a pass had to stop
    waited: float = 0.0            # seconds spent letting writers see announcements


@dataclass
class _Run:
    store: ObjectStore
    report: GcReport
    pool: ThreadPoolExecutor
    bodies: dict[str, tuple[str, Entry | None]] = field(default_factory=dict)  # key -> (etag, entry)
    live_dirs: set[str] = field(default_factory=set)   # directory ids the walk reached

    def fetch(self, key: str) -> tuple[str, Entry | None]:
        """Read and parse one entry; a bad one is recorded (by key) and is None."""
        try:
            body, etag = self.store.get(key)
        except NotFound:
            return key, None
        try:
            entry = Entry.from_json(body)
        except BadEntry as exc:
            if key not in self.report.bad_entries:
                log.error("gc: cannot parse entry %s (%s): no chunk will be deleted in this "
                          "pass", key, exc)
                self.report.bad_entries.append(key)
            entry = None
        self.bodies[key] = (etag, entry)
        return key, entry


def store_now(store: ObjectStore) -> float:
    """The store's clock: the LastModified of an object written just now."""
    store.put(GC_CLOCK_KEY, b"")
    for obj in store.list(GC_CLOCK_KEY):
        if obj.key == GC_CLOCK_KEY:
            return obj.mtime
    raise StoreError(f"{GC_CLOCK_KEY} vanished right after it was written")


def _read_state(store: ObjectStore) -> tuple[GcState, str | None]:
    try:
        body, etag = store.get(GC_STATE_KEY)
    except NotFound:
        return GcState(settle=0.0), None
    return GcState.from_json(body), etag


def _write_state(store: ObjectStore, state: GcState, etag: str | None,
                 clock: Callable[[], float] = time.monotonic) -> tuple[str, float, float]:
    """Compare and swap ``gc/state.json``; returns its new ETag, its LastModified, and
    ``clock()`` right after the PUT returned (a lease starts no later than that)."""
    body = state.to_json()
    try:
        if etag is None:
            if not store.put_if_absent(GC_STATE_KEY, body):
                raise GcConflict("another gc pass created the gc state first")
        else:
            store.put(GC_STATE_KEY, body, if_match=etag)
    except PreconditionFailed:
        # A retried PUT whose first attempt landed also fails its condition: ours?
        try:
            current, _ = store.get(GC_STATE_KEY)
        except NotFound:
            current = b""
        if current != body:
            raise GcConflict("another gc pass changed the gc state") from None
    written_at = clock()
    for obj in store.list(GC_STATE_KEY):
        if obj.key == GC_STATE_KEY:
            written, new_etag = store.get(GC_STATE_KEY)
            if written != body:
                raise GcConflict("another gc pass changed the gc state")
            return new_etag, obj.mtime, written_at
    raise GcConflict("the gc state vanished")


def _walk_staged(run: _Run, cutoff: float,
                 progress: Callable[[str], None]) -> list[tuple[str, str, str]]:
    """Breadth-first from the root, without recursion; a directory id met twice (a loop
    or a shared id in a corrupt store) is walked once.  Returns (entry key, dir id, path)
    of staged trees older than the cutoff that no node renews a seal lease below; it does
    not descend into them."""
    cutoff_ns = int(cutoff * 1e9)
    queue = deque([(ROOT_DIR_ID, "")])
    seen = {ROOT_DIR_ID}
    old_staged: list[tuple[str, str, str]] = []
    while queue:
        dir_id, path = queue.popleft()
        prefix = dir_prefix(dir_id)
        keys = [o.key for o in run.store.list(prefix) if "/" not in o.key[len(prefix):]]
        for key, entry in run.pool.map(run.fetch, keys):
            if entry is None:
                continue
            try:
                name = decode_name(key[len(prefix):]).decode(errors="replace")
            except BadEntry:
                name = key[len(prefix):]
            child_path = f"{path}/{name}"
            if entry.type == "dir" and entry.staged and entry.mtime_ns < cutoff_ns \
                    and not any(o.mtime > cutoff
                                for o in run.store.list(lease_prefix(entry.id or ""))):
                progress(f"staged tree {child_path}")
                old_staged.append((key, entry.id or "", child_path))
                continue
            if entry.type == "dir" and entry.id and entry.id not in seen:
                seen.add(entry.id)
                queue.append((entry.id, child_path))
    run.live_dirs = seen
    return old_staged


def _delete_tree(run: _Run, top_key: str, top_id: str, live: set[str], dry_run: bool) -> None:
    """Delete a staged tree's entries, iteratively, deepest directories first: a pass
    that dies halfway leaves whatever remains reachable from the tree's top entry (deleted
    last), so the next pass finds it; a subdirectory's entry never goes before the
    entries under it.  Directory ids that are also reachable outside the tree (corrupt
    store) or already visited are left alone."""
    stack = [top_id] if top_id and top_id not in live else []
    visited = set(stack)
    listings: list[list[str]] = []
    while stack:
        dir_id = stack.pop()
        keys = []
        for obj in list(run.store.list(dir_prefix(dir_id))):
            key = obj.key
            _, entry = run.bodies.get(key) or run.fetch(key)
            if entry is not None and entry.type == "dir" and entry.id and \
                    entry.id not in visited and entry.id not in live:
                visited.add(entry.id)
                stack.append(entry.id)
            keys.append(key)
        listings.append(keys)
    # a directory is listed after the one that names it: reversed, every directory's
    # entries go before the entry naming it
    for keys in reversed(listings):
        for key in keys:
            if not dry_run:
                run.store.delete(key)
            run.report.entries_deleted += 1
    if not dry_run:
        run.store.delete(top_key)
    run.report.entries_deleted += 1


def _mark(run: _Run) -> set[str]:
    """Every chunk referenced by any entry in the store, reachable or not: a flat listing
    sees an entry that exists all through it even if directories move meanwhile.  The
    content of hard-linked files is in their inode objects (``inodes/``), marked the
    same way whether or not a link entry was seen (a link entry being renamed may be
    missed by a listing; its object never is)."""
    referenced: set[str] = set()
    listed = list(run.store.list("dirs/"))
    objects = list(run.store.list("inodes/"))
    stale = [o.key for o in listed + objects
             if run.bodies.get(o.key, ("",))[0] != o.etag or not o.etag]
    for _ in run.pool.map(run.fetch, stale):
        pass
    linked: set[str] = set()
    for obj in listed + objects:
        _, entry = run.bodies.get(obj.key, ("", None))
        if entry is not None:
            referenced.update(sha for sha, _ in entry.chunks)
            if entry.type == "link" and entry.link:
                linked.add(entry.link)
    # Inode objects no link entry names (a crash between writing one and its first link
    # entry, or links removed with a staged tree) are reported, not deleted: a listing
    # can miss a link entry that a rename is moving, so deleting them safely would need
    # the two-phase protocol chunks get.
    run.report.orphan_inodes = sorted(o.key for o in objects
                                      if o.key.rsplit("/", 1)[-1] not in linked)
    return referenced


def collect(store: ObjectStore, grace: float, dry_run: bool, settle: float,
            progress: Callable[[str], None] = lambda msg: None, workers: int = 16,
            wait: Callable[[str, float], None] | None = None,
            clock: Callable[[], float] = time.monotonic) -> GcReport:
    """One gc pass.  ``wait(phase, seconds)`` lets writers see an announcement (tests
    pass their own to interleave writers at exact points)."""
    report = GcReport()
    if wait is None:
        wait = lambda phase, seconds: time.sleep(seconds)  # noqa: E731
    with ThreadPoolExecutor(workers) as pool:
        run = _Run(store, report, pool)
        _Pass(run, grace, dry_run, settle, progress, wait, clock).run()
    return report


@dataclass
class _Pass:
    """One gc pass, phase by phase in the order of decision 0003 (the numbers in the
    method docstrings are its steps).  Between phases it keeps what a later one needs:
    the state's ETag (every write is a compare and swap on the last one), the candidates,
    the marking announcement's times, the mark and what was deleted."""
    ctx: _Run
    grace: float
    dry_run: bool
    settle: float
    progress: Callable[[str], None]
    wait: Callable[[str, float], None]
    clock: Callable[[], float]
    # Filled by start():
    now: float = 0.0
    cutoff: float = 0.0
    state: GcState = field(default_factory=lambda: GcState(settle=0.0))
    etag: str | None = None
    generation: int = 0
    owner: str = ""
    candidates_set_key: str | None = None
    candidates: frozenset[str] = frozenset()
    history: list[tuple[int, str | None]] = field(default_factory=list)
    # Filled by the later phases:
    marking_at: float = 0.0
    announced_at: float = 0.0      # LastModified of the marking announcement
    referenced: set[str] = field(default_factory=set)
    listed_chunks: list | None = None
    deleted: set[str] = field(default_factory=set)

    @property
    def store(self) -> ObjectStore:
        return self.ctx.store

    @property
    def report(self) -> GcReport:
        return self.ctx.report

    def run(self) -> None:
        self.start()
        self.reclaim_staged()
        self.reclaim_leases()
        self.reclaim_removal_marks()
        self.announce_marking()
        self.mark()
        if self.stop_on_bad_entries():
            return
        doomed = {c for c in self.candidates if c not in self.referenced}
        if doomed and not self.dry_run:
            if self.stop_on_mark_deadline():
                return
            self.delete(doomed)
        if self.listed_chunks is None:
            self.listed_chunks = list(self.store.list("chunks/"))
        self.finish(self.condemn())

    def start(self) -> None:
        """Read the state; refuse to run beside a live pass, take over a dead one."""
        store = self.store
        self.now = time.time() if self.dry_run else store_now(store)
        self.cutoff = self.now - self.grace
        state, self.etag = _read_state(store)
        self.state = state
        self.settle = max(self.settle, state.settle)
        if state.running and not self.dry_run:
            age = self.now - _state_mtime(store)
            if age <= state.lease + state.settle:
                raise GcConflict(f"gc pass {state.generation} is {state.phase} (since "
                                 f"{age:.0f}s); try again later")
            log.warning("gc pass %d was %s and outlived its lease: taking over",
                        state.generation, state.phase)
        self.generation = state.generation + 1
        self.report.generation = self.generation
        self.owner = uuid.uuid4().hex
        self.candidates_set_key = state.candidates if state.running else state.next
        self.candidates = read_candidates(store, self.candidates_set_key) \
            if self.candidates_set_key else frozenset()
        self.history = [*state.history,
                        (self.generation, self.candidates_set_key)][-HISTORY:]

    def reclaim_staged(self) -> None:
        """1. Staged trees older than the grace period."""
        old_staged = _walk_staged(self.ctx, self.cutoff, self.progress)
        live = self.ctx.live_dirs
        for key, dir_id, path in old_staged:
            self.report.staged_trees.append(path)
            _delete_tree(self.ctx, key, dir_id, live, self.dry_run)

    def reclaim_leases(self) -> None:
        """1. (end) Leases nobody renewed within the grace period: their node died, or
        their tree was just reclaimed (a live writer renews every lease_ttl / 3)."""
        for obj in list(self.store.list(LEASE_ROOT)):
            if obj.mtime <= self.cutoff:
                if not self.dry_run:
                    self.store.delete(obj.key)
                self.report.leases_deleted += 1

    def reclaim_removal_marks(self) -> None:
        """1. (end) rmdir's removal marks older than the grace period (decision 0028): a
        writer reads its directory's mark right after its entry lands, so only a node
        that stopped between the two for longer than the grace period needs one."""
        for obj in list(self.store.list(REMOVED_PREFIX)):
            if obj.mtime <= self.cutoff:
                if not self.dry_run:
                    self.store.delete(obj.key)
                self.report.removal_marks_deleted += 1

    def announce_marking(self) -> None:
        """2. Announce the pass to writers (only if it may delete something)."""
        self.marking_at = self.clock()
        self.announced_at = 0.0
        if not self.candidates or self.dry_run:
            return
        self.etag, self.announced_at, self.marking_at = _write_state(
            self.store, GcState(
                generation=self.generation, phase=MARKING,
                candidates=self.candidates_set_key, history=self.state.history,
                settle=self.settle, owner=self.owner,
                lease=MARK_DEADLINE + 3 * self.settle),
            self.etag, self.clock)
        self.progress(f"pass {self.generation}: marking, {len(self.candidates)} "
                      "candidate chunk(s)")
        self.wait(MARKING, self.settle)
        self.report.waited += self.settle

    def mark(self) -> None:
        """3. Mark."""
        self.referenced = _mark(self.ctx)

    def stop_on_bad_entries(self) -> bool:
        """3. (end) An entry gc cannot parse stops the pass: no chunk deleted."""
        report = self.report
        if not report.bad_entries:
            return False
        n = len(report.bad_entries)
        report.stopped = (f"{n} entr{'y' if n == 1 else 'ies'}"
                          f" could not be parsed (first: {report.bad_entries[0]}); "
                          "no chunk deleted")
        log.error("gc: %s", report.stopped)
        self.finish(self.candidates_set_key)  # condemned stay condemned; nothing new
        return True

    def stop_on_mark_deadline(self) -> bool:
        """4. (start) A pass that marked for longer than its deadline deletes nothing."""
        if self.clock() - self.marking_at <= MARK_DEADLINE:
            return False
        self.report.stopped = "marking took longer than its deadline; no chunk deleted"
        log.error("gc: %s", self.report.stopped)
        self.finish(self.candidates_set_key)
        return True

    def delete(self, doomed: set[str]) -> None:
        """4. Announce "deleting", wait, delete inside its lease."""
        store, report, settle = self.store, self.report, self.settle
        self.etag, _, deleting_at = _write_state(store, GcState(
            generation=self.generation, phase=DELETING,
            candidates=self.candidates_set_key, history=self.state.history,
            settle=settle, owner=self.owner, lease=2 * settle), self.etag, self.clock)
        self.progress(f"pass {self.generation}: deleting up to {len(doomed)} chunk(s)")
        self.wait(DELETING, settle)
        report.waited += settle
        self.listed_chunks = list(store.list("chunks/"))
        # Still unreferenced (doomed), not PUT again since the marking announcement, and
        # old enough; deleted only inside the lease announced with "deleting".
        victims = [o for o in self.listed_chunks if o.key.rsplit("/", 1)[-1] in doomed
                   and o.mtime < self.announced_at - CLOCK_SKEW
                   and o.mtime <= self.cutoff]

        def delete(obj):
            if self.clock() - deleting_at >= 2 * settle:
                return None
            store.delete(obj.key)
            return obj

        for obj in self.ctx.pool.map(delete, victims):
            if obj is not None:
                self.deleted.add(obj.key.rsplit("/", 1)[-1])
                report.chunks_deleted += 1
                report.chunk_bytes_deleted += obj.size
        if len(self.deleted) < len(victims):
            log.warning("gc: delete window over; %d chunk(s) left for the next pass",
                        len(victims) - len(self.deleted))

    def condemn(self) -> str | None:
        """5. Condemn for the next pass; returns the key of the set written, if any."""
        report = self.report
        condemned = []
        for obj in self.listed_chunks or []:
            sha = obj.key.rsplit("/", 1)[-1]
            if sha in self.deleted:
                continue
            if sha in self.referenced or obj.mtime > self.cutoff:
                report.chunks_kept += 1
                continue
            if self.dry_run and sha in self.candidates:
                report.chunks_deleted += 1          # would be deleted by this pass
                report.chunk_bytes_deleted += obj.size
                continue
            condemned.append(sha)
        report.chunks_condemned = len(condemned)
        next_key = None
        if condemned and not self.dry_run:
            next_key = candidates_key(self.generation + 1)
            self.store.put(next_key, json.dumps({"generation": self.generation + 1,
                                                 "chunks": sorted(condemned)}).encode())
        return next_key

    def finish(self, next_key: str | None) -> None:
        """5. (end) Announce "idle" with the next pass's candidates; prune old sets."""
        if self.dry_run:
            return
        _write_state(self.store, GcState(
            generation=self.generation, phase=IDLE, next=next_key, history=self.history,
            settle=self.settle, owner=self.owner), self.etag, self.clock)
        _prune_sets(self.store, self.history, next_key)


def _state_mtime(store: ObjectStore) -> float:
    for obj in store.list(GC_STATE_KEY):
        if obj.key == GC_STATE_KEY:
            return obj.mtime
    return 0.0


def _prune_sets(store: ObjectStore, history: list[tuple[int, str | None]],
                next_key: str | None) -> None:
    keep = {k for _, k in history if k} | ({next_key} if next_key else set())
    for obj in list(store.list(GC_CANDIDATES_PREFIX)):
        if obj.key not in keep:
            store.delete(obj.key)
