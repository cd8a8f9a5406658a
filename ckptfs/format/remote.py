"""The remote format, v2 (DESIGN.md §3): key names and directory-entry JSON.

``chunks/<aa>/<chunk id>`` hold immutable chunk bodies (``chunkid.py``: a bare sha256 as
v1 wrote, or ``b3-<blake3>``; ``aa`` is the first two hex digits of the digest); ``dirs/<dir-id>/<name>`` holds one
JSON entry per name.  This module encodes and validates; a hostile or corrupt entry
raises ``BadEntry`` instead of leaking into the namespace.  It knows nothing of LMDB,
FUSE or how bytes are moved.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import math
import re
import stat
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from . import chunkid
from .chunkid import digest_hex, is_chunk_id

ROOT_DIR_ID = "root"
FORMAT_KEY = "ckptfs.json"
# v2 (decision 0025): entries may name BLAKE3 chunks (``b3-`` ids) beside
# v1's sha256 ones.  A v1 daemon refuses a v2 marker at mount (one line), so it never
# meets an id it cannot verify; this code reads both.  A store stays v1 until a node
# that writes BLAKE3 chunks mounts it (node/daemon.py upgrades the marker).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# Entries may name chunks up to this size whatever this node's own chunk size: every
# node reads files written with any chunk size.
MAX_CHUNK_SIZE = 64 << 20
# How many link count-outs an inode object remembers (``Entry.counted``): far more
# than can be in flight for one linked file at once.
COUNTED_KEPT = 32
_DIR_ID_RE = re.compile(r"^(root|[0-9a-f]{32})$")
# Special files (FIFOs, devices, sockets) are metadata-only entries (issue 10); "link"
# names a hard-linked file whose content lives in ``inodes/<id>`` (decision 0008).
SPECIAL_TYPES = ("fifo", "chr", "blk", "sock")
_TYPES = ("file", "dir", "symlink", "link") + SPECIAL_TYPES
TYPE_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK,
             "fifo": stat.S_IFIFO, "chr": stat.S_IFCHR, "blk": stat.S_IFBLK,
             "sock": stat.S_IFSOCK}
TYPE_OF_BITS = {bits: kind for kind, bits in TYPE_BITS.items()}
MAX_RDEV = (1 << 32) - 1           # the kernel's dev_t as FUSE carries it
# ``user.*`` extended attributes ride in the entry; bounded so entries stay small.
XATTR_NAME_MAX = 255
XATTR_TOTAL_MAX = 64 << 10         # names + values of one entry


# A name's encoded key component becomes a file name in a LocalStore (255 bytes on
# every common Linux file system) and part of an S3 key (1024 bytes in all, prefix
# included): 255 bytes is the limit that holds for both.
MAX_KEY_COMPONENT = 255
MAX_KEY = 1024 - 256            # room left for a store's own key prefix


class BadEntry(ValueError):
    """A directory entry in the store is malformed or hostile."""


class KeyTooLong(ValueError):
    """A name whose store key would be too long for the store."""


def check_key_fits(dir_id: str, name: bytes) -> None:
    """Raise ``KeyTooLong`` (with a one-line reason) if ``name`` in directory ``dir_id``
    cannot be stored: its encoded key component exceeds ``MAX_KEY_COMPONENT`` bytes
    (escapes make '%', control characters and undecodable bytes three bytes each), or
    the whole entry key exceeds ``MAX_KEY``."""
    component = len(encode_name(name).encode("utf-8", "surrogateescape"))
    if component > MAX_KEY_COMPONENT:
        raise KeyTooLong(f"name of {len(name)} bytes is {component} bytes as a store key "
                         f"component (limit {MAX_KEY_COMPONENT}; '%', control characters "
                         "and non-UTF-8 bytes take 3 bytes each)")
    key = len(dir_prefix(dir_id).encode()) + component
    if key > MAX_KEY:
        raise KeyTooLong(f"store key of {key} bytes (limit {MAX_KEY})")


CHUNKS_PREFIX = "chunks/"
INODES_PREFIX = "inodes/"
DIRS_PREFIX = "dirs/"
# ``removed/<dir-id>``: the mark an rmdir leaves (decision 0028): where the directory's
# entry was and what it held, so that a writer whose entry lands in that directory
# after the rmdir's last listing brings the directory back instead of leaving its entry
# under no name.  gc deletes marks older than its grace period.
REMOVED_PREFIX = "removed/"


@functools.lru_cache(maxsize=16)
def zero_chunk_ids(length: int) -> frozenset[str]:
    """The ids of ``length`` zero bytes under every chunk hash: a chunk with one holds a
    hole's bytes (the format records no holes; a chunk of zeros is stored like any
    other, once)."""
    return frozenset(chunkid.chunk_id(bytes(length), alg) for alg in chunkid.ALGORITHMS)


def allocated_bytes(chunks: list[tuple[str, int]]) -> int:
    """Bytes of a published file that hold data: its chunks but those of zeros."""
    return sum(n for cid, n in chunks if cid not in zero_chunk_ids(n))


def chunk_key(cid: str) -> str:
    """The store key of the chunk ``cid``: its id is the last component."""
    return f"{CHUNKS_PREFIX}{digest_hex(cid)[:2]}/{cid}"


class ChunkHasher(Protocol):
    """What verifying a chunk needs of a hash: fed in pieces, read as hex."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def chunk_id_of_key(key: str) -> str | None:
    """The chunk id a ``chunks/`` key names, or None for a key that is no chunk's (a
    stray object, or a chunk under the wrong fan-out directory)."""
    if not key.startswith(CHUNKS_PREFIX):
        return None
    cid = key.rsplit("/", 1)[-1]
    if not is_chunk_id(cid) or chunk_key(cid) != key:
        return None
    return cid


class _PrefixedHasher:
    """A hash whose hex digest reads as a chunk id (``b3-`` before BLAKE3's)."""

    def __init__(self, inner, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def update(self, data: bytes | bytearray | memoryview, /) -> object:
        return self.inner.update(data)

    def hexdigest(self) -> str:
        return self.prefix + self.inner.hexdigest()


def chunk_hasher(cid: str) -> ChunkHasher:
    """A fresh hash of the kind ``cid`` is made with, fed in pieces; its ``hexdigest``
    equals ``cid`` for the chunk's bytes (``BadEntry`` for an id of no known kind)."""
    if not is_chunk_id(cid):
        raise BadEntry(f"unknown chunk id {cid!r}")
    if chunkid.algorithm_of(cid) == chunkid.BLAKE3:
        return _PrefixedHasher(chunkid.blake3_hasher(), chunkid.B3_PREFIX)
    return hashlib.sha256()


def chunk_matches(cid: str, data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is the body of chunk ``cid``."""
    return is_chunk_id(cid) and chunkid.chunk_ok(data, cid)


def inode_key(link_id: str) -> str:
    """The shared inode object of a hard-linked file (decision 0008)."""
    return f"{INODES_PREFIX}{link_id}"


def dir_prefix(dir_id: str) -> str:
    return f"{DIRS_PREFIX}{dir_id}/"


def entry_key(dir_id: str, name: bytes) -> str:
    return dir_prefix(dir_id) + encode_name(name)


def dir_id_of_key(key: str) -> str | None:
    """The id of the directory an entry key is in (None for a key that is no entry's)."""
    if not key.startswith(DIRS_PREFIX):
        return None
    dir_id, sep, _ = key[len(DIRS_PREFIX):].partition("/")
    return dir_id if sep else None


def removed_key(dir_id: str) -> str:
    """The removal mark of directory ``dir_id`` (decision 0028)."""
    return f"{REMOVED_PREFIX}{dir_id}"


@dataclass
class RemovalMark:
    """What an rmdir leaves under ``removed/<dir-id>``: the key the directory's entry
    had and the entry itself (without a rename claim)."""

    key: str
    entry: Entry

    def to_json(self) -> bytes:
        return json.dumps({"v": FORMAT_VERSION, "key": self.key,
                           "entry": json.loads(self.entry.to_json())},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, dir_id: str) -> "RemovalMark":
        """Parse and validate the mark of ``dir_id``: its key must be an entry key and
        its entry a directory with that id (a hostile mark names no other)."""
        doc = _json_object(data)
        key = doc.get("key")
        if not isinstance(key, str) or dir_id_of_key(key) is None:
            raise BadEntry(f"removal mark of {dir_id} names no entry key: {key!r}")
        component = key[len(dir_prefix(dir_id_of_key(key) or "")):]
        decode_name(component)
        if not _DIR_ID_RE.match(dir_id_of_key(key) or ""):
            raise BadEntry(f"removal mark of {dir_id}: bad directory id in {key!r}")
        entry = Entry.from_json(json.dumps(doc.get("entry")).encode())
        if entry.type != "dir" or entry.id != dir_id:
            raise BadEntry(f"removal mark of {dir_id} holds no entry of that directory")
        entry.moving_to, entry.moving_at = None, 0.0
        return cls(key=key, entry=entry)


def encode_name(name: bytes) -> str:
    """A POSIX name (bytes) as a key component: UTF-8 kept as is, '%', control
    characters and undecodable bytes percent-escaped.  Reversible."""
    text = name.decode("utf-8", "surrogateescape")
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "%" or code < 0x20 or code == 0x7F:
            out.append(f"%{code:02X}")
        elif 0xDC80 <= code <= 0xDCFF:  # an undecodable byte
            out.append(f"%{code - 0xDC00:02X}")
        else:
            out.append(ch)
    return "".join(out)


def decode_name(component: str) -> bytes:
    name = unescape(component)
    check_name(name)
    return name


def unescape(component: str) -> bytes:
    out = bytearray()
    i = 0
    while i < len(component):
        ch = component[i]
        if ch == "%":
            try:
                out.append(int(component[i + 1:i + 3], 16))
            except ValueError:
                raise BadEntry(f"bad escape in name {component!r}") from None
            i += 3
        else:
            out += ch.encode("utf-8")
            i += 1
    return bytes(out)


def check_xattr_name(name: bytes) -> None:
    """A storable extended attribute name: ``user.*``, not our own status namespace."""
    if not name.startswith(b"user.") or name.startswith(b"user.ckptfs.") \
            or len(name) > XATTR_NAME_MAX or b"\0" in name or name == b"user.":
        raise BadEntry(f"invalid xattr name {name!r}")


def xattrs_size(xattrs: dict[bytes, bytes]) -> int:
    return sum(len(k) + len(v) for k, v in xattrs.items())


def check_name(name: bytes) -> None:
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name or len(name) > 255:
        raise BadEntry(f"invalid name {name!r}")


@dataclass
class Entry:
    """One name in a directory, as stored remotely."""

    type: str
    mode: int
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    chunks: list[tuple[str, int]] = field(default_factory=list)
    id: str | None = None           # a directory's id
    target: bytes | None = None     # a symlink's target
    staged: bool = False
    # A rename in progress (decision 0003): the key this entry is being moved to and
    # when the move was claimed (the claiming node's wall clock).
    moving_to: str | None = None
    moving_at: float = 0.0
    rdev: int = 0                   # character and block devices
    xattrs: dict[bytes, bytes] = field(default_factory=dict)   # user.* only
    link: str | None = None         # "link" entries: the id of the shared inode object
    nlink: int = 1                  # inode objects: how many names point at them
    # Directories: wall time of the seal (retention orders checkpoints by it); absent
    # in entries written before it existed, and in directories never sealed.
    sealed_at: float | None = None
    # Files: the id of the save that published this content (random, new at every
    # publish of a closed version, kept by attribute rewrites and renames).  Tells a
    # newer save of the same bytes from the one a node published (decision 0016);
    # absent in entries written before it existed.
    save_id: str | None = None
    # Inode objects: the ids of the latest link count-outs made on them (at most
    # ``COUNTED_KEPT``, oldest first), so that a count-out tried again after its reply
    # was lost finds itself done instead of counting a name out twice; absent in
    # objects written before it existed, and while none was made.
    counted: list[str] = field(default_factory=list)

    def claim_is_live(self, now: float, ttl: float) -> bool:
        return self.moving_to is not None and now - self.moving_at < ttl

    def to_json(self) -> bytes:
        # ``rev`` makes every PUT's body unique, so an ETag (the body's MD5 on S3) never
        # repeats: a compare-and-swap against an old ETag cannot match a newer write of
        # the same bytes (no ABA).
        doc: dict = {"v": FORMAT_VERSION, "type": self.type, "mode": self.mode,
                     "uid": self.uid, "gid": self.gid, "mtime_ns": self.mtime_ns,
                     "size": self.size, "staged": self.staged, "rev": uuid.uuid4().hex}
        if self.moving_to is not None:
            doc["moving_to"] = self.moving_to
            doc["moving_at"] = self.moving_at
        if self.type == "file":
            doc["chunks"] = [[sha, n] for sha, n in self.chunks]
        if self.save_id is not None and self.type not in ("dir", "link"):
            doc["save"] = self.save_id
        if self.type == "dir":
            doc["id"] = self.id
        if self.type == "symlink":
            assert self.target is not None
            doc["target"] = self.target.decode("utf-8", "surrogateescape")
        if self.type in ("chr", "blk"):
            doc["rdev"] = self.rdev
        if self.type == "link":
            doc["inode"] = self.link
        if self.nlink != 1:
            doc["nlink"] = self.nlink
        if self.counted:
            doc["counted"] = list(self.counted[-COUNTED_KEPT:])
        if self.sealed_at is not None:
            doc["sealed_at"] = self.sealed_at
        if self.xattrs:
            doc["xattrs"] = {encode_name(k): base64.b64encode(v).decode()
                             for k, v in sorted(self.xattrs.items())}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, max_chunk: int = MAX_CHUNK_SIZE) -> "Entry":
        """Parse and validate an entry; unknown fields are ignored (newer writers may
        add some).  Chunks up to ``max_chunk`` bytes are accepted: by default the
        format's maximum, never this node's own chunk size.  The checks run in a fixed
        order (common fields, rename claim, the type's own fields, nlink, xattrs), so a
        hostile entry is always refused with the same message."""
        doc = _json_object(data)
        kind = doc.get("type")
        if kind not in _TYPES:
            raise BadEntry(f"unknown entry type {kind!r}")
        ints = {name: _uint_field(doc, name)
                for name in ("mode", "uid", "gid", "mtime_ns", "size")}
        # Permission and sticky bits only: setuid/setgid from a store are never honoured.
        mode = ints["mode"] & 0o1777
        entry = cls(type=kind, mode=mode, uid=ints["uid"], gid=ints["gid"],
                    mtime_ns=ints["mtime_ns"], size=ints["size"],
                    staged=bool(doc.get("staged", False)))
        _read_claim(entry, doc)
        _read_kind_fields(entry, doc, max_chunk)
        if kind in SPECIAL_TYPES and (entry.size or entry.chunks):
            raise BadEntry(f"a {kind} entry has no content")
        nlink = doc.get("nlink", 1)
        if not _is_int(nlink) or not 0 <= nlink < 1 << 32:
            raise BadEntry(f"bad nlink {nlink!r}")
        entry.nlink = nlink
        sealed_at = doc.get("sealed_at")
        if isinstance(sealed_at, (int, float)) and not isinstance(sealed_at, bool) \
                and 0 <= sealed_at < math.inf:
            entry.sealed_at = float(sealed_at)      # anything else: as if absent
        entry.xattrs = _xattrs_from_json(doc.get("xattrs", {}))
        save_id = doc.get("save")
        if kind not in ("dir", "link") and isinstance(save_id, str) and _SAVE_ID_RE.match(save_id):
            entry.save_id = save_id                 # anything else: as if absent
        counted = doc.get("counted")
        if isinstance(counted, list) and len(counted) <= COUNTED_KEPT and \
                all(isinstance(c, str) and _COUNT_ID_RE.match(c) for c in counted):
            entry.counted = list(counted)           # anything else: as if absent
        return entry

    @property
    def st_mode(self) -> int:
        return TYPE_BITS[self.type] | self.mode


_LINK_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SAVE_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_COUNT_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def _is_int(value: object) -> bool:
    """A JSON integer (``true`` and ``false`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _json_object(data: bytes) -> dict:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadEntry(f"entry is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadEntry("entry is not an object")
    return doc


def _uint_field(doc: dict, name: str) -> int:
    value = doc.get(name, 0)
    if not _is_int(value) or value < 0:
        raise BadEntry(f"bad {name} {value!r}")
    return value


def _read_claim(entry: Entry, doc: dict) -> None:
    """A rename claim (decision 0003), if the entry carries one."""
    moving_to, moving_at = doc.get("moving_to"), doc.get("moving_at", 0.0)
    if moving_to is None:
        return
    if not isinstance(moving_to, str) or not isinstance(moving_at, (int, float)) \
            or isinstance(moving_at, bool):
        raise BadEntry("bad rename claim")
    entry.moving_to, entry.moving_at = moving_to, float(moving_at)


def _read_kind_fields(entry: Entry, doc: dict, max_chunk: int) -> None:
    """The fields only one type of entry has."""
    kind = entry.type
    if kind == "file":
        entry.chunks = _chunks_from_json(doc.get("chunks"), entry.size, max_chunk)
    elif kind == "dir":
        dir_id = doc.get("id")
        if not isinstance(dir_id, str) or not _DIR_ID_RE.match(dir_id) or dir_id == ROOT_DIR_ID:
            raise BadEntry(f"bad directory id {dir_id!r}")
        entry.id = dir_id
    elif kind == "symlink":
        target = doc.get("target")
        if not isinstance(target, str) or not target or "\0" in target or len(target) > 4096:
            raise BadEntry("bad symlink target")
        entry.target = target.encode("utf-8", "surrogateescape")
    elif kind == "link":
        link = doc.get("inode")
        if not isinstance(link, str) or not _LINK_ID_RE.match(link):
            raise BadEntry(f"bad inode id {link!r}")
        entry.link = link
    elif kind in ("chr", "blk"):
        rdev = doc.get("rdev", 0)
        if not _is_int(rdev) or not 0 <= rdev <= MAX_RDEV:
            raise BadEntry(f"bad rdev {rdev!r}")
        entry.rdev = rdev


def _chunks_from_json(chunks: object, size: int, max_chunk: int) -> list[tuple[str, int]]:
    """A file's chunk list: (chunk id, length) pairs adding up to its size (ids of
    either algorithm, mixed as they may be within one file's history)."""
    if not isinstance(chunks, list):
        raise BadEntry("file entry without chunk list")
    out: list[tuple[str, int]] = []
    total = 0
    for item in chunks:
        if (not isinstance(item, list) or len(item) != 2
                or not is_chunk_id(item[0])
                or not _is_int(item[1]) or not 0 < item[1] <= max_chunk):
            raise BadEntry(f"bad chunk {item!r}")
        total += item[1]
        out.append((item[0], item[1]))
    if total != size:
        raise BadEntry(f"chunks add up to {total}, size says {size}")
    return out


def _xattrs_from_json(raw: object) -> dict[bytes, bytes]:
    if not isinstance(raw, dict):
        raise BadEntry("xattrs is not an object")
    out: dict[bytes, bytes] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not isinstance(value, str) or len(value) > 2 * XATTR_TOTAL_MAX:
            raise BadEntry("bad xattr")
        name = unescape(key)
        check_xattr_name(name)
        try:
            out[name] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadEntry(f"bad xattr value for {name!r}") from None
    if xattrs_size(out) > XATTR_TOTAL_MAX:
        raise BadEntry("xattrs too large")
    return out
