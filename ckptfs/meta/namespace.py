"""The node-local namespace: inodes, directory entries and the journal, in LMDB.

Every method is synchronous and short; callers run them on the trio thread with no
``await`` in between related changes, so the namespace needs no lock of its own (the
S3QL discipline).  A write that does not fit (the state dir's disk full, or the LMDB
map full) is ``FsError(ENOSPC)`` and changes nothing, on disk or in the in-memory
caches; ``batch`` makes several writes one transaction.  It knows nothing of file bytes, of the object store, or of FUSE.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import math
import stat
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol, TypeVar

import lmdb
import orjson

from ..errors import FsError
from .lmdbtxn import Transactions
from .reserve import RoomReserve

log = logging.getLogger(__name__)

ROOT_INO = 1
_U64 = struct.Struct(">Q")


def _k(n: int) -> bytes:
    return _U64.pack(n)


def _b2s(b: bytes | None) -> str | None:
    return None if b is None else b.decode("utf-8", "surrogateescape")


def _s2b(s: str | None) -> bytes | None:
    return None if s is None else s.encode("utf-8", "surrogateescape")


_TYPE_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK,
              "fifo": stat.S_IFIFO, "chr": stat.S_IFCHR, "blk": stat.S_IFBLK,
              "sock": stat.S_IFSOCK}


@dataclass
class Inode:
    ino: int
    type: str                       # "file" | "dir" | "symlink" | "fifo" | "chr" | "blk" | "sock"
    mode: int                       # permission bits only
    uid: int = 0
    gid: int = 0
    size: int = 0                   # current size (staged size while dirty)
    mtime_ns: int = 0
    ctime_ns: int = 0
    atime_ns: int = 0
    parent: int = 0                 # 0 once unlinked (files may live on while open)
    name: bytes = b""
    chunks: list[tuple[str, int]] = field(default_factory=list)   # published content
    published: bool = False         # an entry for this inode exists in the store
    dirty: bool = False             # the staging file is newer than ``chunks``
    local_copy: bool = False        # the staging file of ``ver`` holds the content
    ver: int = 0                    # staging version of the last closed content
    max_ver: int = 0                # highest staging version handed out
    remote_etag: str | None = None  # ETag of our entry as last written or seen
    dir_id: str | None = None       # directories: the id their entries live under
    target: bytes | None = None     # symlinks
    listed_at: float = 0.0          # directories: wall time of the last remote listing
    staged: bool = False            # directories: a checkpoint not yet sealed (unlisted)
    rdev: int = 0                   # character and block devices
    xattrs: dict[bytes, bytes] = field(default_factory=dict)    # user.* attributes
    # Hard links (decision 0008): names beyond ``parent``/``name``; the id of the shared
    # inode object in the store once the inode has had a second name; the link count
    # that object holds (names on other nodes' directories count too).
    aliases: list[tuple[int, bytes]] = field(default_factory=list)
    link_id: str | None = None
    remote_nlink: int = 0
    links_pending: bool = False     # link entries not yet written (first publish does)
    sealed_at: float | None = None  # directories: wall time of the seal (retention)
    # A file with no closed version yet, renamed over a published name: that name's
    # entry stays in the store until this file's closed version lands there (its
    # publish overwrites it) or the name is removed here; a killed writer leaves it.
    # [directory id, name (hex), identity of the entry].
    held: list[list[str]] = field(default_factory=list)
    # Files: the last closed version's mtime while a write session may have changed
    # ``mtime_ns`` (a truncating open saves its own): shown again when the session is
    # abandoned -- by a killed writer, or by the next run after a daemon crash.
    closed_mtime_ns: int | None = None
    # Attributes changed here and not yet in the store ("mode", "owner", "mtime",
    # "xattrs"; they ride with the next publish or attribute rewrite): a write that
    # finds another node's newer entry keeps these and takes the others (entries.py).
    attrs_unsent: list[str] = field(default_factory=list)
    # Entry PUTs of this inode's publish that were sent and never answered: the store
    # may hold them (an answer lost on its way).  [key, identity] pairs, recorded before
    # the PUT goes; a later answered PUT of the key clears its own; a rename or removal
    # of the name takes them (its log record, or its store step in sync mode) so that
    # what landed there goes too (entries.py).
    unsure: list[list[str]] = field(default_factory=list)
    # Files: the save id of the published content (``chunks``): the entry's ``save``.
    save_id: str | None = None
    # Files: the staging version taken over by a rename over a save that had not landed
    # (core/taken.py): while it is ``ver``, the closed version is the name's, and a
    # rename on leaves it there.  0: none.
    taken_ver: int = 0
    # Hard-linked files: the ids of the latest link count-outs the shared object holds
    # (``Entry.counted``), as last read or written there: every rewrite keeps them.
    link_counted: list[str] = field(default_factory=list)

    @property
    def st_mode(self) -> int:
        return _TYPE_BITS[self.type] | self.mode

    @property
    def names(self) -> list[tuple[int, bytes]]:
        return ([(self.parent, self.name)] if self.parent else []) + list(self.aliases)

    @property
    def nlink(self) -> int:
        """Names of a non-directory: 0 once unlinked (an open file lives on)."""
        if not self.parent:
            return 0
        return max(1 + len(self.aliases), self.remote_nlink if self.link_id else 0)

    @property
    def published_size(self) -> int:
        return sum(n for _, n in self.chunks)

    def encode(self) -> bytes:
        # Field by field, not ``asdict``: its deep copy was a tenth of the daemon's CPU
        # in a copy of many small files (every request saves an inode).
        doc = {name: getattr(self, name) for name in _INODE_FIELDS}
        doc["name"] = _b2s(self.name)
        doc["target"] = _b2s(self.target)
        doc["xattrs"] = {base64.b64encode(k).decode(): base64.b64encode(v).decode()
                         for k, v in self.xattrs.items()}
        doc["aliases"] = [[p, _b2s(n)] for p, n in self.aliases]
        if all(v is None or math.isfinite(v) for v in (self.listed_at, self.sealed_at)):
            try:
                return orjson.dumps(doc)        # the fast way (decision 0030)
            except TypeError:
                pass    # a name that is not UTF-8 (a lone surrogate), an int over 64 bits
        # The json module: what orjson refuses, and infinities (it writes them as null).
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Inode":
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:      # a name that is not UTF-8 (see ``encode``)
            doc = json.loads(raw)
        else:
            if any(type(doc.get(k)) is float for k in _INT_FIELDS):
                doc = json.loads(raw)       # orjson reads an int over 64 bits as a float
        doc["name"] = _s2b(doc["name"])
        doc["target"] = _s2b(doc["target"])
        doc["chunks"] = [tuple(c) for c in doc["chunks"]]
        doc.setdefault("staged", False)
        doc["xattrs"] = {base64.b64decode(k): base64.b64decode(v)
                         for k, v in doc.get("xattrs", {}).items()}
        doc["aliases"] = [(p, _s2b(n)) for p, n in doc.get("aliases", [])]
        return cls(**doc)


_INODE_FIELDS = tuple(f.name for f in fields(Inode))
_INT_FIELDS = tuple(f.name for f in fields(Inode) if f.type == "int")


def _take_next(txn: lmdb.Transaction, db: lmdb._Database, counter: bytes) -> int:
    """The next number of a counter in the meta table (made with the table), counted."""
    raw = txn.get(counter, db=db)
    if raw is None:
        raise FsError(errno.EIO, f"meta.lmdb has no {counter.decode()} counter")
    value: int = _U64.unpack(raw)[0]
    txn.put(counter, _k(value + 1), db=db)
    return value


T = TypeVar("T")


class _NamespaceParts(Protocol):
    """What the parts (``TwoStepNames``, ``JournalTables``) use of the ``Namespace``
    they are part of (their self-type)."""

    path: Path
    env: lmdb.Environment
    db_meta: lmdb._Database
    db_journal: lmdb._Database
    db_publish: lmdb._Database
    db_dentries: lmdb._Database
    db_dir_ids: lmdb._Database
    db_link_ids: lmdb._Database
    _cache: dict[int, Inode]

    def _read(self) -> AbstractContextManager[lmdb.Transaction[bytes]]: ...
    def _write(self) -> AbstractContextManager[lmdb.Transaction[bytes]]: ...
    def _put_inode(self, txn: lmdb.Transaction, inode: Inode) -> None: ...
    def _index(self, inode: Inode) -> None: ...
    def _count(self, parent: int, inode: Inode, delta: int) -> None: ...
    def delete_inode(self, ino: int) -> None: ...
    def with_room(self, write: Callable[[], T]) -> T: ...


class TwoStepNames:
    """Part of ``Namespace``: a name created in two steps around a store call.  The
    inode is written first with no name (``reserve_inode``: a full state dir fails
    the operation before anything happened anywhere), named last (``attach``), or
    dropped (``forget_reserved``)."""

    def reserve_inode(self: _NamespaceParts, type_: str, mode: int, uid: int, gid: int,
                      **extra) -> Inode:
        """An inode with no name yet: nobody can find it."""
        now = time.time_ns()
        with self._write() as txn:
            ino = _take_next(txn, self.db_meta, b"next_ino")
            inode = Inode(ino=ino, type=type_, mode=mode & 0o7777, uid=uid, gid=gid,
                          mtime_ns=extra.pop("mtime_ns", now), ctime_ns=now, atime_ns=now,
                          parent=0, name=b"", **extra)
            self._put_inode(txn, inode)
        return inode

    def attach(self: _NamespaceParts, inode: Inode, parent: Inode, name: bytes) -> None:
        """Give a reserved inode its name, and its parent a new mtime, in one step."""
        with self._write() as txn:
            inode.parent, inode.name = parent.ino, name
            self._put_inode(txn, inode)
            txn.put(_k(parent.ino) + name, _k(inode.ino), db=self.db_dentries)
            if inode.dir_id:
                txn.put(inode.dir_id.encode(), _k(inode.ino), db=self.db_dir_ids)
            if inode.link_id:
                txn.put(inode.link_id.encode(), _k(inode.ino), db=self.db_link_ids)
            parent.mtime_ns = parent.ctime_ns = time.time_ns()
            self._put_inode(txn, parent)
        self._cache[inode.ino] = inode
        self._cache[parent.ino] = parent
        self._index(inode)
        self._count(parent.ino, inode, +1)

    def forget_reserved(self: _NamespaceParts, inode: Inode) -> None:
        """Drop a reserved inode whose operation failed (best effort: a record left
        behind on a full disk has no name and is never seen)."""
        inode.parent, inode.name = 0, b""
        try:
            self.with_room(lambda: self.delete_inode(inode.ino))
        except FsError as exc:
            log.warning("reserved inode %d stays in %s, unnamed: %s", inode.ino, self.path,
                        exc.reason)


class JournalTables:
    """Part of ``Namespace``: the ordered journal of metadata records (oplog.py) and the
    closed, unpublished files (the publish queue), each written in the caller's batch."""

    # ------------------------------------------------------------------ journal

    def journal_add(self: _NamespaceParts, record: dict) -> int:
        with self._write() as txn:
            seq = _take_next(txn, self.db_meta, b"next_journal")
            txn.put(_k(seq), json.dumps(record).encode(), db=self.db_journal)
        return seq

    def journal_put(self: _NamespaceParts, seq: int, record: dict) -> None:
        """Replace a pending record (same place in the order); in the caller's batch."""
        with self._write() as txn:
            txn.put(_k(seq), json.dumps(record).encode(), db=self.db_journal)

    def journal_done(self: _NamespaceParts, seq: int) -> None:
        with self._write() as txn:
            txn.delete(_k(seq), db=self.db_journal)

    def journal(self: _NamespaceParts) -> list[tuple[int, dict]]:
        with self._read() as txn:
            return [(_U64.unpack(k)[0], json.loads(v))
                    for k, v in txn.cursor(db=self.db_journal)]

    # ------------------------------------------------------------------ pending publishes
    # Keyed by inode (not in the ordered journal): adding or finishing one is O(1) however
    # many files a checkpoint has.

    def publish_pending_add(self: _NamespaceParts, ino: int, epoch: int = 0) -> None:
        """``epoch``: the metadata log record the publish must follow (oplog.py)."""
        with self._write() as txn:
            txn.put(_k(ino), str(epoch).encode(), db=self.db_publish)

    def publish_pending_done(self: _NamespaceParts, ino: int) -> None:
        with self._write() as txn:
            txn.delete(_k(ino), db=self.db_publish)

    def publish_pending(self: _NamespaceParts) -> dict[int, int]:
        """Inode -> epoch of every closed, unpublished file."""
        out = {}
        with self._read() as txn:
            for k, v in txn.cursor(db=self.db_publish):
                try:
                    out[_U64.unpack(k)[0]] = int(bytes(v))
                except ValueError:
                    out[_U64.unpack(k)[0]] = 0
        return out


class Namespace(TwoStepNames, JournalTables, Transactions):
    """Inodes and dentries of one mount, persisted in ``state_dir/meta.lmdb``."""

    def __init__(self, path: Path, map_size: int = 4 << 30,
                 root_owner: tuple[int, int] = (0, 0),      # of a new root dir
                 reserve: RoomReserve | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        # sync=False: a daemon crash loses nothing (the map lives in the page cache);
        # callers call ``sync()`` where a power cut must not lose a journal record.
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=16, sync=False,
                             metasync=False, lock=True)
        self.db_inodes = self.env.open_db(b"inodes")
        self.db_dentries = self.env.open_db(b"dentries")
        self.db_journal = self.env.open_db(b"journal")
        self.db_chunks = self.env.open_db(b"known_chunks")
        self.db_meta = self.env.open_db(b"meta")
        self.db_dir_ids = self.env.open_db(b"dir_ids")      # directory id -> inode
        self.db_publish = self.env.open_db(b"pending_publish")   # inode -> closed, unpublished
        self.db_link_ids = self.env.open_db(b"link_ids")    # shared inode object id -> inode
        self._cache: dict[int, Inode] = {}
        self._staged: set[int] | None = None   # staged directories, indexed on first use
        # Subdirectories per directory (its link count), counted once, then kept up to
        # date by every dentry change below.
        self._subdirs: dict[int, int] = {}
        self.path = path
        self._written: set[int] = set()     # inodes the open write transaction wrote
        # Told of each inode read again from disk after a failed write: the owner of
        # state kept only in memory (an open writer's size) puts it back.
        self.on_reload: Callable[[Inode], None] | None = None
        self._init_transactions(reserve)
        with self._write() as txn:
            if txn.get(_k(ROOT_INO), db=self.db_inodes) is None:
                now = time.time_ns()
                root = Inode(ino=ROOT_INO, type="dir", mode=0o755, mtime_ns=now, ctime_ns=now,
                             atime_ns=now, parent=ROOT_INO, dir_id="root", published=True,
                             uid=root_owner[0], gid=root_owner[1])
                txn.put(_k(ROOT_INO), root.encode(), db=self.db_inodes)
                txn.put(b"next_ino", _k(ROOT_INO + 1), db=self.db_meta)
                txn.put(b"next_journal", _k(1), db=self.db_meta)

    def _rolled_back(self) -> None:
        """Every inode the failed write wrote is read again as it is on disk -- INTO the
        object callers hold (a fresh object beside it let a caller's later write of the
        old one, or a retried removal, disagree with what ``get`` returned) -- and
        ``on_reload`` puts back what is kept only in memory.  Never raises: it runs
        while the write's own error is on its way."""
        written, self._written = self._written, set()
        self._subdirs.clear()
        self._staged = None
        for ino in written:
            cached = self._cache.get(ino)
            if cached is None:
                continue
            try:
                with self._read() as txn:
                    raw = txn.get(_k(ino), db=self.db_inodes)
                if raw is None:                 # made by the failed write: not there
                    del self._cache[ino]
                    continue
                vars(cached).update(vars(Inode.decode(raw)))
                if self.on_reload is not None:
                    self.on_reload(cached)
            except Exception as exc:  # noqa: BLE001  (the write's error goes on)
                log.error("inode %d could not be read again after a failed write (%s): "
                          "it is read from disk at its next use", ino, exc)
                self._cache.pop(ino, None)

    def _committed(self) -> None:
        self._written.clear()

    def _put_inode(self, txn: lmdb.Transaction, inode: Inode) -> None:
        self._written.add(inode.ino)
        txn.put(_k(inode.ino), inode.encode(), db=self.db_inodes)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    def sync(self) -> None:
        self.env.sync(True)

    # ------------------------------------------------------------------ inodes

    def get(self, ino: int) -> Inode:
        inode = self._cache.get(ino)
        if inode is not None:
            return inode
        with self._read() as txn:
            raw = txn.get(_k(ino), db=self.db_inodes)
        if raw is None:
            raise FsError.enoent(f"inode {ino}")
        inode = Inode.decode(raw)
        self._cache[ino] = inode
        return inode

    def maybe_get(self, ino: int) -> Inode | None:
        try:
            return self.get(ino)
        except FsError:
            return None

    def save(self, *inodes: Inode) -> None:
        with self._write() as txn:
            for inode in inodes:
                self._put_inode(txn, inode)
                self._cache[inode.ino] = inode
        for inode in inodes:
            self._index(inode)

    def new_inode(self, parent: int, name: bytes, type_: str, mode: int, uid: int,
                  gid: int, **extra) -> Inode:
        """Create an inode and its dentry in one transaction."""
        now = time.time_ns()
        with self._write() as txn:
            ino = _take_next(txn, self.db_meta, b"next_ino")
            inode = Inode(ino=ino, type=type_, mode=mode & 0o7777, uid=uid, gid=gid,
                          mtime_ns=extra.pop("mtime_ns", now), ctime_ns=now, atime_ns=now,
                          parent=parent, name=name, **extra)
            self._put_inode(txn, inode)
            txn.put(_k(parent) + name, _k(ino), db=self.db_dentries)
            if inode.dir_id:
                txn.put(inode.dir_id.encode(), _k(ino), db=self.db_dir_ids)
            if inode.link_id:
                txn.put(inode.link_id.encode(), _k(ino), db=self.db_link_ids)
        self._cache[ino] = inode
        self._index(inode)
        self._count(parent, inode, +1)
        return inode

    def _count(self, parent: int, inode: Inode, delta: int) -> None:
        if inode.type == "dir" and parent in self._subdirs:
            self._subdirs[parent] += delta

    def subdirs(self, ino: int) -> int:
        """How many subdirectories a directory has (for its link count)."""
        count = self._subdirs.get(ino)
        if count is None:
            count = 0
            for _, child in self.children(ino):
                inode = self.maybe_get(child)
                if inode is not None and inode.type == "dir":
                    count += 1
            self._subdirs[ino] = count
        return count

    def ino_of_link_id(self, link_id: str) -> int | None:
        """The inode this node holds for a shared inode object, if any."""
        with self._read() as txn:
            raw = txn.get(link_id.encode(), db=self.db_link_ids)
        return None if raw is None else _U64.unpack(raw)[0]

    def set_link_id(self, inode: Inode, link_id: str) -> None:
        with self._write() as txn:
            inode.link_id = link_id
            txn.put(link_id.encode(), _k(inode.ino), db=self.db_link_ids)
            self._put_inode(txn, inode)
        self._cache[inode.ino] = inode

    def add_name(self, inode: Inode, parent: int, name: bytes) -> None:
        """A further name (hard link) for a non-directory inode."""
        with self._write() as txn:
            txn.put(_k(parent) + name, _k(inode.ino), db=self.db_dentries)
            if inode.parent:
                inode.aliases.append((parent, name))
            else:
                inode.parent, inode.name = parent, name
            inode.ctime_ns = time.time_ns()
            self._put_inode(txn, inode)
        self._cache[inode.ino] = inode

    def ino_of_dir_id(self, dir_id: str) -> int | None:
        """The inode this node holds for a directory id, if any."""
        with self._read() as txn:
            raw = txn.get(dir_id.encode(), db=self.db_dir_ids)
        return None if raw is None else _U64.unpack(raw)[0]

    def change_dir_id(self, inode: Inode, dir_id: str) -> None:
        """A directory created here joined another node's of the same name (oplog.py)."""
        with self._write() as txn:
            if inode.dir_id and txn.get(inode.dir_id.encode(), db=self.db_dir_ids) == \
                    _k(inode.ino):
                txn.delete(inode.dir_id.encode(), db=self.db_dir_ids)
            inode.dir_id = dir_id
            txn.put(dir_id.encode(), _k(inode.ino), db=self.db_dir_ids)
            self._put_inode(txn, inode)
        self._cache[inode.ino] = inode

    def delete_inode(self, ino: int) -> None:
        inode = self.maybe_get(ino)
        with self._write() as txn:
            txn.delete(_k(ino), db=self.db_inodes)
            if inode is not None and inode.dir_id:
                key = inode.dir_id.encode()
                if txn.get(key, db=self.db_dir_ids) == _k(ino):
                    txn.delete(key, db=self.db_dir_ids)
            if inode is not None and inode.link_id:
                key = inode.link_id.encode()
                if txn.get(key, db=self.db_link_ids) == _k(ino):
                    txn.delete(key, db=self.db_link_ids)
        self._cache.pop(ino, None)
        if self._staged is not None:
            self._staged.discard(ino)
        self._subdirs.pop(ino, None)

    def all_inodes(self) -> Iterator[Inode]:
        with self._read() as txn:
            raws = [v for _, v in txn.cursor(db=self.db_inodes)]
        for raw in raws:
            inode = Inode.decode(raw)
            yield self._cache.get(inode.ino, inode)

    # ------------------------------------------------------------------ staged directories

    @staticmethod
    def _is_staged_dir(inode: Inode) -> bool:
        return inode.type == "dir" and inode.staged and bool(inode.parent)

    def _index(self, inode: Inode) -> None:
        if self._staged is None:
            return
        if self._is_staged_dir(inode):
            self._staged.add(inode.ino)
        else:
            self._staged.discard(inode.ino)

    def staged_dirs(self) -> list[Inode]:
        """The staged (unsealed) directories this node's namespace holds.  The first call
        scans every inode; later ones read an index that every change keeps current."""
        if self._staged is None:
            self._staged = {i.ino for i in self.all_inodes() if self._is_staged_dir(i)}
        out = []
        for ino in sorted(self._staged):
            inode = self.maybe_get(ino)
            if inode is not None and self._is_staged_dir(inode):
                out.append(inode)
        return out

    # ------------------------------------------------------------------ dentries

    def lookup(self, parent: int, name: bytes) -> int | None:
        with self._read() as txn:
            raw = txn.get(_k(parent) + name, db=self.db_dentries)
        return None if raw is None else _U64.unpack(raw)[0]

    def children(self, parent: int) -> list[tuple[bytes, int]]:
        prefix = _k(parent)
        out = []
        with self._read() as txn:
            cur = txn.cursor(db=self.db_dentries)
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    out.append((bytes(key[8:]), _U64.unpack(value)[0]))
        return out

    def next_name(self, parent: int, name: bytes) -> tuple[bytes, int] | None:
        """The entry of ``parent`` that follows ``name`` in name order, if any."""
        prefix = _k(parent)
        with self._read() as txn:
            cur = txn.cursor(db=self.db_dentries)
            if not cur.set_range(prefix + name + b"\x00"):
                return None
            key, value = cur.item()
            if not key.startswith(prefix):
                return None
            return bytes(key[8:]), _U64.unpack(value)[0]

    def has_children(self, parent: int) -> bool:
        prefix = _k(parent)
        with self._read() as txn:
            cur = txn.cursor(db=self.db_dentries)
            return bool(cur.set_range(prefix)) and bytes(cur.key()).startswith(prefix)

    def _restore_on_rollback(self, inode: Inode) -> None:
        """The caller's ``inode`` gets back the names it has now if the open write
        fails: callers hold it, and a removal tried again (``with_room``) or a later
        step must see the names that are still on disk."""
        names = (inode.parent, inode.name, list(inode.aliases), inode.ctime_ns)

        def restore() -> None:
            inode.parent, inode.name, inode.aliases, inode.ctime_ns = names
        self.on_rollback(restore)

    def unlink(self, inode: Inode, parent: int | None = None, name: bytes | None = None,
               all_names: bool = False) -> None:
        """Remove one dentry of ``inode`` (by default its first name; every name with
        ``all_names``).  The inode record is kept; ``parent`` is 0 once no name is left."""
        if parent is None:
            parent, name = inode.parent, inode.name
        assert name is not None
        with self._write() as txn:
            self._restore_on_rollback(inode)
            gone = inode.names if all_names else [(parent, name)]
            for p, n in gone:
                if txn.get(_k(p) + n, db=self.db_dentries) == _k(inode.ino):
                    txn.delete(_k(p) + n, db=self.db_dentries)
                self._count(p, inode, -1)
            if all_names or (parent, name) == (inode.parent, inode.name):
                if inode.aliases and not all_names:
                    inode.parent, inode.name = inode.aliases.pop(0)
                else:
                    inode.parent, inode.aliases = 0, []
            elif (parent, name) in inode.aliases:
                inode.aliases.remove((parent, name))
            if inode.parent:
                inode.ctime_ns = time.time_ns()
            self._put_inode(txn, inode)
        self._index(inode)

    def move(self, inode: Inode, new_parent: int, new_name: bytes,
             old: tuple[int, bytes] | None = None) -> None:
        """Point ``new_parent/new_name`` at inode (replacing any dentry there), moving
        the name ``old`` (default: its first name)."""
        old = old or (inode.parent, inode.name)
        with self._write() as txn:
            self._restore_on_rollback(inode)
            replaced = txn.get(_k(new_parent) + new_name, db=self.db_dentries)
            if replaced is not None and replaced != _k(inode.ino):
                self._subdirs.pop(new_parent, None)
            if old[0]:
                if txn.get(_k(old[0]) + old[1], db=self.db_dentries) == _k(inode.ino):
                    txn.delete(_k(old[0]) + old[1], db=self.db_dentries)
                self._count(old[0], inode, -1)
            txn.put(_k(new_parent) + new_name, _k(inode.ino), db=self.db_dentries)
            self._count(new_parent, inode, +1)
            if old in inode.aliases:
                inode.aliases[inode.aliases.index(old)] = (new_parent, new_name)
            else:
                inode.parent, inode.name = new_parent, new_name
            inode.ctime_ns = time.time_ns()
            self._put_inode(txn, inode)
        self._index(inode)

    def exchange(self, a: Inode, a_name: tuple[int, bytes], b: Inode,
                 b_name: tuple[int, bytes]) -> None:
        """Swap two dentries (RENAME_EXCHANGE) in one transaction."""
        with self._write() as txn:
            txn.put(_k(a_name[0]) + a_name[1], _k(b.ino), db=self.db_dentries)
            txn.put(_k(b_name[0]) + b_name[1], _k(a.ino), db=self.db_dentries)
            for inode, old, new in ((a, a_name, b_name), (b, b_name, a_name)):
                self._count(old[0], inode, -1)
                self._count(new[0], inode, +1)
                if old in inode.aliases:
                    inode.aliases[inode.aliases.index(old)] = new
                else:
                    inode.parent, inode.name = new
                inode.ctime_ns = time.time_ns()
                self._put_inode(txn, inode)
        self._index(a)
        self._index(b)

    def path_of(self, ino: int) -> bytes:
        parts = []
        while ino != ROOT_INO:
            inode = self.get(ino)
            if not inode.parent:
                raise FsError.enoent("unlinked")
            parts.append(inode.name)
            ino = inode.parent
        return b"/" + b"/".join(reversed(parts))

    # ------------------------------------------------------------------ chunks known to be in the store

    # The value is the first gc pass that could delete the chunk unnoticed, as
    # ``ChunkLiveness`` remembers it (decision 0003), in JSON; "1" (written before gc
    # generations existed) reads as unknown.

    def known_chunks(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        with self._read() as txn:
            for key, value in txn.cursor(db=self.db_chunks):
                out[bytes(key).decode()] = _chunk_generation(bytes(value))
        return out

    def chunk_mark(self, sha: str, generation: int) -> None:
        with self._write() as txn:
            txn.put(sha.encode(), json.dumps({"gen": generation, "at": int(time.time())}).encode(),
                    db=self.db_chunks)

    # ------------------------------------------------------------------ store identity

    def meta_get(self, key: str) -> str | None:
        with self._read() as txn:
            raw = txn.get(key.encode(), db=self.db_meta)
        return None if raw is None else raw.decode()

    def meta_put(self, key: str, value: str) -> None:
        with self._write() as txn:
            txn.put(key.encode(), value.encode(), db=self.db_meta)


def _chunk_generation(raw: bytes) -> int | None:
    try:
        value = json.loads(raw)
        return int(value["gen"]) if isinstance(value, dict) else None
    except (ValueError, KeyError, TypeError):
        return None
