"""``ckptfs fsck``: check a store against the remote format (DESIGN.md §3), read only.

``check`` walks the tree from the root the way the filesystem resolves names
(``dirs/<dir-id>/<name>``, a directory entry naming the id of its content, a "link"
entry naming its shared inode object ``inodes/<id>``), then lists every entry and inode
object flat (as gc marks, decision 0003), then lists ``chunks/`` once, and reports:

* damaged files, by path: a chunk they name is missing (or, with ``full``, its bytes do
  not hash to its id, or its size is not the one the entry says);
* entries and keys that do not parse (``format.remote``'s validation of hostile entries);
* dangling directory ids: content under ``dirs/<id>/`` that no entry names;
* missing inode objects (a link entry naming none), orphaned inode objects and orphaned
  chunks (no entry references them: gc's to reclaim after its grace period, never
  fsck's), staged (unsealed) trees with their seal leases, the gc state.

Safe beside live mounts: chunks are listed after every entry was read (a publish uploads
its chunks before its entry, so an entry read names chunks already listed), and nothing
is reported missing, dangling or corrupt before a second look (the chunk's own key listed
again, the entries that named it read again, the flat listing repeated, the body read
again).  Issues GETs and LISTs only; never writes or deletes (``fsck_repair`` is the
one writer).  Chunk ids are handled by ``format.remote``'s functions only, so every kind
of id it knows is verified.  Other prefixes (``peers/``, ``probe/``, ...) are not ours to
judge and are skipped.  Works on the ``ObjectStore`` alone (blocking; run it in a
thread); knows nothing of inodes, LMDB or FUSE.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .leases_common import LEASE_ROOT
from ..data.liveness import GC_STATE_KEY, GcState
from ..format.remote import (DIRS_PREFIX, INODES_PREFIX, ROOT_DIR_ID, BadEntry, Entry,
                             chunk_hasher, chunk_id_of_key, chunk_key, decode_name,
                             dir_prefix, inode_key)
from ..store import ListedObject, NotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

UNREACHABLE = "(unreachable) "     # the path of an entry no walk from the root reaches


@dataclass(frozen=True)
class ChunkRef:
    """One use of a chunk: by the entry (or inode object) ``key``, reached as ``path``,
    at byte ``offset`` of a file of ``size`` bytes, ``length`` bytes long."""

    chunk: str
    key: str
    path: str
    offset: int
    length: int
    size: int


@dataclass
class DamagedFile:
    path: str
    key: str                                   # the entry or inode object naming chunks
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)


@dataclass
class StagedTree:
    path: str
    dir_id: str
    idle: float                                # seconds since the entry's mtime
    lease_age: float | None                    # seconds since a seal lease was renewed


@dataclass
class FsckReport:
    url: str = ""
    entries: int = 0                           # entries and inode objects read
    dirs: int = 0
    files: int = 0                             # names that are not directories
    chunks: int = 0                            # chunk objects listed
    chunk_bytes: int = 0
    chunks_hashed: int = 0
    damaged_files: list[DamagedFile] = field(default_factory=list)
    missing_chunks: list[str] = field(default_factory=list)
    corrupt_chunks: list[str] = field(default_factory=list)
    bad_entries: list[tuple[str, str]] = field(default_factory=list)    # key, reason
    dangling_dirs: list[tuple[str, int]] = field(default_factory=list)  # id, objects
    missing_inodes: list[tuple[str, str]] = field(default_factory=list)  # path, key
    orphan_chunks: list[str] = field(default_factory=list)
    orphan_chunk_bytes: int = 0
    orphan_inodes: list[str] = field(default_factory=list)
    stray_keys: list[str] = field(default_factory=list)   # under chunks/, not a chunk
    staged_trees: list[StagedTree] = field(default_factory=list)
    leases: int = 0
    # Renames in progress (decision 0006): path, the key it moves to, seconds since the
    # claim.  An old one is a node that died mid-rename; its journal finishes it.
    rename_claims: list[tuple[str, str, float]] = field(default_factory=list)
    gc_phase: str | None = None
    repaired: list[tuple[str, str]] = field(default_factory=list)       # chunk, source
    refs: dict[str, list[ChunkRef]] = field(default_factory=dict)       # damaged chunks

    @property
    def damaged(self) -> bool:
        return bool(self.damaged_files or self.missing_chunks or self.corrupt_chunks
                    or self.bad_entries or self.dangling_dirs or self.missing_inodes)

    def to_json(self) -> dict:
        return {
            "url": self.url, "clean": not self.damaged,
            "entries": self.entries, "dirs": self.dirs, "files": self.files,
            "chunks": self.chunks, "chunk_bytes": self.chunk_bytes,
            "chunks_hashed": self.chunks_hashed,
            "damaged_files": [{"path": d.path, "key": d.key, "missing": d.missing,
                               "corrupt": d.corrupt} for d in self.damaged_files],
            "missing_chunks": self.missing_chunks, "corrupt_chunks": self.corrupt_chunks,
            "bad_entries": [{"key": k, "reason": r} for k, r in self.bad_entries],
            "dangling_dirs": [{"dir_id": d, "objects": n} for d, n in self.dangling_dirs],
            "missing_inodes": [{"path": p, "key": k} for p, k in self.missing_inodes],
            "orphan_chunks": self.orphan_chunks,
            "orphan_chunk_bytes": self.orphan_chunk_bytes,
            "orphan_inodes": self.orphan_inodes, "stray_keys": self.stray_keys,
            "staged_trees": [{"path": s.path, "dir_id": s.dir_id, "idle": round(s.idle, 1),
                              "lease_age": None if s.lease_age is None
                              else round(s.lease_age, 1)} for s in self.staged_trees],
            "leases": self.leases, "gc_phase": self.gc_phase,
            "rename_claims": [{"path": p, "moving_to": k, "age": round(a, 1)}
                              for p, k, a in self.rename_claims],
            "repaired": [{"chunk": c, "source": s} for c, s in self.repaired],
        }


@dataclass
class _Read:
    etag: str
    entry: Entry | None
    error: str | None = None


class _Check:
    """One fsck run: what it read, keyed by store key, and the references it found."""

    def __init__(self, store: ObjectStore, pool: ThreadPoolExecutor,
                 progress: Callable[[str], None], clock: Callable[[], float]) -> None:
        self.store = store
        self.pool = pool
        self.progress = progress
        self.clock = clock
        self.report = FsckReport(url=getattr(store, "url", ""))
        self.read: dict[str, _Read] = {}
        self.paths: dict[str, str] = {}          # entry key -> path (walk)
        self.link_paths: dict[str, list[str]] = {}   # inode key -> paths of its names
        self.link_keys: dict[str, list[tuple[str, str]]] = {}   # ... -> (entry key, path)
        self.bad: dict[str, str] = {}

    # ------------------------------------------------------------------ reading
    def fetch(self, key: str) -> _Read | None:
        """GET and parse one entry (None: it is gone)."""
        try:
            body, etag = self.store.get(key)
        except NotFound:
            self.read.pop(key, None)
            return None
        try:
            got = _Read(etag, Entry.from_json(body))
        except BadEntry as exc:
            got = _Read(etag, None, str(exc))
        self.read[key] = got
        return got

    def fetch_all(self, keys: Iterable[str]) -> None:
        for _ in self.pool.map(self.fetch, list(keys)):
            pass

    # ------------------------------------------------------------------ the walk
    def walk(self) -> None:
        """Breadth-first from the root without recursion; a directory id met twice (a
        loop, or an id shared in a corrupt store) is walked once."""
        queue: deque[tuple[str, str, bool]] = deque([(ROOT_DIR_ID, "", False)])
        seen = {ROOT_DIR_ID}
        leases = self.lease_ages()
        now = self.clock()
        while queue:
            dir_id, path, in_staged = queue.popleft()
            prefix = dir_prefix(dir_id)
            keys = []
            for obj in self.store.list(prefix):
                component = obj.key[len(prefix):]
                if "/" in component:
                    self.bad[obj.key] = "not an entry key (a '/' in the name)"
                    continue
                keys.append(obj.key)
            self.fetch_all(keys)
            for key in keys:
                got = self.read.get(key)
                if got is None:
                    continue
                try:
                    name = decode_name(key[len(prefix):]).decode("utf-8", "replace")
                except BadEntry as exc:
                    self.bad[key] = str(exc)
                    continue
                child = f"{path}/{name}"
                entry = got.entry
                if entry is None:
                    continue
                self.paths[key] = child
                if entry.moving_to is not None:
                    self.report.rename_claims.append(
                        (child, entry.moving_to, max(0.0, now - entry.moving_at)))
                if entry.type == "link" and entry.link:
                    self.link_paths.setdefault(inode_key(entry.link), []).append(child)
                    self.link_keys.setdefault(inode_key(entry.link), []).append((key, child))
                if entry.type != "dir" or not entry.id:
                    continue
                if entry.staged and not in_staged:
                    lease = leases.get(entry.id)
                    self.report.staged_trees.append(StagedTree(
                        child, entry.id, max(0.0, now - entry.mtime_ns / 1e9),
                        None if lease is None else max(0.0, now - lease)))
                if entry.id not in seen:
                    seen.add(entry.id)
                    queue.append((entry.id, child, in_staged or entry.staged))
        self.progress(f"walked {len(self.paths)} names")

    def lease_ages(self) -> dict[str, float]:
        """Directory id -> the newest renewal (LastModified) of a seal lease below it."""
        newest: dict[str, float] = {}
        for obj in self.store.list(LEASE_ROOT):
            self.report.leases += 1
            dir_id = obj.key[len(LEASE_ROOT):].split("/", 1)[0]
            newest[dir_id] = max(newest.get(dir_id, 0.0), obj.mtime)
        return newest

    # ------------------------------------------------------------------ flat pass
    def flat(self) -> tuple[list[ListedObject], list[ListedObject]]:
        """Every entry and inode object, reachable or not; reads those the walk did not
        (or that changed since)."""
        entries = [o for o in self.store.list(DIRS_PREFIX)
                   if "/" not in o.key[len(DIRS_PREFIX):].partition("/")[2]]
        objects = list(self.store.list(INODES_PREFIX))
        stale = [o.key for o in entries + objects
                 if o.key not in self.read or self.read[o.key].etag != o.etag or not o.etag]
        self.fetch_all(stale)
        return entries, objects

    def dangling(self, entries: list[ListedObject]) -> dict[str, set[str]]:
        """Directory ids with content under ``dirs/`` that no entry names, with the
        keys under each."""
        named = {ROOT_DIR_ID}
        for obj in entries:
            got = self.read.get(obj.key)
            if got is not None and got.entry is not None and got.entry.id:
                named.add(got.entry.id)
        present: dict[str, set[str]] = {}
        for obj in entries:
            dir_id = obj.key[len(DIRS_PREFIX):].split("/", 1)[0]
            if dir_id not in named:
                present.setdefault(dir_id, set()).add(obj.key)
        return present

    # ------------------------------------------------------------------ references
    def references(self, keys: Iterable[str]) -> dict[str, list[ChunkRef]]:
        refs: dict[str, list[ChunkRef]] = {}
        for key in keys:
            got = self.read.get(key)
            if got is None or got.entry is None:
                continue
            for ref in self.refs_of(key, got.entry):
                refs.setdefault(ref.chunk, []).append(ref)
        return refs

    def refs_of(self, key: str, entry: Entry) -> list[ChunkRef]:
        if key.startswith(INODES_PREFIX):
            paths = self.link_paths.get(key) or [UNREACHABLE + key]
        else:
            paths = [self.paths.get(key, UNREACHABLE + key)]
        out = []
        offset = 0
        for chunk, length in entry.chunks:
            out += [ChunkRef(chunk, key, path, offset, length, entry.size) for path in paths]
            offset += length
        return out

    def still_named(self, chunk: str, refs: list[ChunkRef]) -> list[ChunkRef]:
        """The references of ``chunk`` that hold after reading their entries again."""
        out = []
        for key in sorted({r.key for r in refs}):
            got = self.fetch(key)
            if got is None or got.entry is None:
                continue
            out += [r for r in self.refs_of(key, got.entry) if r.chunk == chunk]
        return out

    def listed_again(self, key: str) -> ListedObject | None:
        for obj in self.store.list(key):
            if obj.key == key:
                return obj
        return None

    # ------------------------------------------------------------------ --full
    def rehash(self, listed: dict[str, ListedObject]) -> list[str]:
        """Read every chunk (``pool`` GETs at a time, each into a buffer its thread
        reuses: memory is bounded by workers × the largest chunk) and return the ids of
        those whose bytes do not hash to their id, after a second read."""
        local = threading.local()

        def verify(chunk: str) -> str | None:
            obj = listed[chunk]
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < obj.size + 1:
                buf = local.buf = bytearray(max(obj.size + 1, 1 << 20))
            for _ in range(2):          # a mismatch is read once more before it counts
                try:
                    n, _etag = self.store.get_into(obj.key, buf)
                except NotFound:
                    return None         # deleted meanwhile (gc): not ours to judge
                hasher = chunk_hasher(chunk)
                if n <= len(buf):
                    hasher.update(memoryview(buf)[:n])
                    if hasher.hexdigest() == chunk:
                        return None
            return chunk

        bad = [c for c in self.pool.map(verify, sorted(listed)) if c is not None]
        self.report.chunks_hashed = len(listed)
        return bad


def check(store: ObjectStore, full: bool = False, workers: int = 8,
          progress: Callable[[str], None] = lambda msg: None,
          clock: Callable[[], float] = time.time) -> FsckReport:
    """One read-only check of ``store`` (see the module docstring).  Store errors
    propagate (the caller says it could not run)."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        run = _Check(store, pool, progress, clock)
        report = run.report
        try:
            body, _ = store.get(GC_STATE_KEY)
        except NotFound:
            body = None
        if body is not None:
            try:
                report.gc_phase = GcState.from_json(body).phase
            except StoreError as exc:   # gc refuses to run on it: damage to report
                run.bad[GC_STATE_KEY] = str(exc)
        run.walk()
        entries, objects = run.flat()
        dangling = run.dangling(entries)
        if dangling:
            # Look again: a directory renamed during the listing has its new name now,
            # and one losing entries is a tree being removed (gc removes a staged tree's
            # directory entries before the entries under them).
            entries, objects = run.flat()
            dangling = {d: keys for d, keys in run.dangling(entries).items()
                        if d in dangling and dangling[d] <= keys}
        report.dangling_dirs = sorted((d, len(keys)) for d, keys in dangling.items())
        keys = [o.key for o in entries + objects]
        refs = run.references(keys)
        # Chunks are listed after every entry was read: an entry names chunks uploaded
        # before it was published, so before this listing.
        listed: dict[str, ListedObject] = {}
        for obj in store.list("chunks/"):
            chunk = chunk_id_of_key(obj.key)
            if chunk is None:
                report.stray_keys.append(obj.key)
            else:
                listed[chunk] = obj
        progress(f"listed {len(listed)} chunks")
        report.chunks = len(listed)
        report.chunk_bytes = sum(o.size for o in listed.values())
        _count(run, keys)
        _missing_and_truncated(run, refs, listed)
        if full:
            for chunk in run.rehash(listed):
                if chunk not in report.corrupt_chunks:
                    report.corrupt_chunks.append(chunk)
                    run.report.refs.setdefault(chunk, refs.get(chunk, []))
        report.corrupt_chunks.sort()
        _inodes(run, objects)
        report.bad_entries = sorted(
            [(k, g.error or "") for k, g in run.read.items() if g.entry is None]
            + list(run.bad.items()))
        orphans = sorted(c for c in listed if c not in refs)
        report.orphan_chunks = orphans
        report.orphan_chunk_bytes = sum(listed[c].size for c in orphans)
        report.staged_trees.sort(key=lambda s: s.path)
        damaged_files(report)
    return report


def _count(run: _Check, keys: list[str]) -> None:
    report = run.report
    for key in keys:
        got = run.read.get(key)
        if got is None or got.entry is None:
            continue
        report.entries += 1
        if got.entry.type == "dir":
            report.dirs += 1
        elif not key.startswith(INODES_PREFIX):     # files, links, symlinks, specials
            report.files += 1


def _missing_and_truncated(run: _Check, refs: dict[str, list[ChunkRef]],
                           listed: dict[str, ListedObject]) -> None:
    """Chunks named but not listed, or listed at another size than named: each looked
    at again (its own key listed, the entries naming it read) before it counts."""
    report = run.report
    for chunk in sorted(refs):
        obj = listed.get(chunk)
        if obj is not None and all(r.length == obj.size for r in refs[chunk]):
            continue
        again = run.listed_again(chunk_key(chunk))
        named = run.still_named(chunk, refs[chunk])
        if not named:
            continue                # its entries changed or went away meanwhile
        if again is None:
            report.missing_chunks.append(chunk)
            report.refs[chunk] = named
        elif any(r.length != again.size for r in named):
            report.corrupt_chunks.append(chunk)
            report.refs[chunk] = named
        if again is not None:
            listed[chunk] = again


def _inodes(run: _Check, objects: list[ListedObject]) -> None:
    """Link entries naming no inode object (after reading both again), and inode
    objects no link entry names (gc's to report too; never deleted here)."""
    report = run.report
    present = {o.key for o in objects}
    linked: set[str] = set()
    for read in list(run.read.values()):
        if read.entry is not None and read.entry.type == "link" and read.entry.link:
            linked.add(inode_key(read.entry.link))
    for key in sorted(linked - present):
        if run.listed_again(key) is not None:
            continue
        for entry_key_, path in run.link_keys.get(key, []):
            got = run.fetch(entry_key_)      # still a link to it? (an unlink meanwhile)
            if got is not None and got.entry is not None and got.entry.link \
                    and inode_key(got.entry.link) == key:
                report.missing_inodes.append((path, key))
    report.orphan_inodes = sorted(present - linked)


def damaged_files(report: FsckReport) -> None:
    """(Re)build ``damaged_files`` from the missing and corrupt chunks' references."""
    files: dict[tuple[str, str], DamagedFile] = {}
    for kind, chunks in (("missing", report.missing_chunks),
                         ("corrupt", report.corrupt_chunks)):
        for chunk in chunks:
            for ref in report.refs.get(chunk, []):
                damaged = files.setdefault((ref.path, ref.key), DamagedFile(ref.path, ref.key))
                bucket = damaged.missing if kind == "missing" else damaged.corrupt
                if chunk not in bucket:
                    bucket.append(chunk)
    report.damaged_files = sorted(files.values(), key=lambda d: d.path)
