"""Is a checkpoint file structurally complete?  (DESIGN.md promise 2, "structurally incomplete".)

An exception inside ``with open(...)`` during ``torch.save`` -- or a SIGTERM handler that
calls ``sys.exit(1)`` -- unwinds and closes a half-written file from a live process, so the
close looks meant.  Before a file is published we look at the formats checkpoints are
written in, recognised by their LEADING BYTES (never by name), and say why one is
incomplete:

* ``torch``: a zip archive (``PK\\3\\4``: torch.save, torch.jit.save, .pt2, .npz, DCP shards,
  which are several torch zips back to back) must have an end record (zip64 too) where
  zipfile looks for one, whose central directory parses and whose entries lie inside the
  file.  Bytes after it are allowed (zipfile allows them) unless they are zip records: then
  the file's own end record was cut and an inner archive's was found.  In a
  torch.save archive every storage that ``data.pkl`` references must be an entry of at
  least numel x element-size bytes: torch's zip writer writes the end record even when the
  save is interrupted (its close runs in a ``finally``), leaving an archive with no
  ``data.pkl`` or without the storages.  The legacy (pre-1.6) pickle-stream format is
  walked record by record.  ``data.pkl`` is read with an Unpickler that imports nothing.
* ``safetensors``: 8-byte header length, JSON header, size == 8 + N + largest data end.
* ``npy``: magic, header dict (``ast.literal_eval``), then prod(shape) x itemsize bytes, for
  each of the arrays np.save may have appended to one file; object arrays are not judged.
* ``pickle`` (protocol 2-5): the last byte is STOP.

Cannot tell: a cut exactly between two archives of a DCP shard or two appended arrays (it
looks like a file with fewer items); a pickle cut right after a ``.`` byte.  Whatever the
structure cannot settle (unknown element sizes, compressed data.pkl, huge headers) passes.
Reads with ``os.pread`` only the head, the tail, the zip central directory, the local
headers and the pickles -- never the tensor data.  Knows nothing of FUSE, trio, stores.
"""

from __future__ import annotations

import ast
import io
import json
import math
import os
import pickle
import pickletools
import re
import struct
from collections.abc import Iterable
from typing import Any

FORMATS = ("torch", "safetensors", "npy", "pickle")
MAX_HEADER = 100 * 2**20  # safetensors / npy header / pickles we are willing to read
MAX_NPY_HEADER = 1 << 20  # numpy's np.load refuses more than 10 000 bytes by default
_LEGACY_TORCH = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
_TORCH_BOOKKEEPING = {"version", "byteorder", ".data/serialization_id", ".data/version",
                      ".format_version", ".storage_alignment"}
# element size by storage class (``torch FloatStorage``) or dtype (``torch float8_e4m3fn``)
_ELEMENT_SIZE = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "QInt8": 1,
    "QUInt8": 1, "QInt32": 4, "QUInt4x2": 1, "QUInt2x4": 1, "Untyped": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1}


class _Incomplete(Exception):
    """The file's structure is incomplete; the message is the one-line reason."""


def parse_formats(text: str) -> tuple[str, ...]:
    """``"torch, npy"`` -> ``("torch", "npy")``; empty -> no checks; unknown -> ValueError."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    _validate(names)
    return names


def _validate(names: Iterable[str]) -> frozenset[str]:
    names = frozenset(names)
    if unknown := sorted(names - set(FORMATS)):
        raise ValueError(f"unknown checkpoint format {unknown[0]!r} (known: {', '.join(FORMATS)})")
    return names


# A plain pickle announces itself with three bytes (0x80, its protocol, an opcode), which
# about 1 in 61 000 random files also begin with; under a name given, it is checked only
# under the names pickle writers use.  The other formats' magic is long enough.
PICKLE_NAMES = (b".pkl", b".pickle", b".pk", b".p", b".pt", b".pth", b".ckpt")


def check_complete(fd: int, size: int, formats: Iterable[str] = FORMATS,
                   name: bytes | None = None) -> str | None:
    """None if the file is complete or of no known format; otherwise a one-line reason
    (e.g. "torch archive: storage data/3 referenced by data.pkl is missing").

    ``size`` is the file's logical size (bytes past it are never read); ``name``, the
    file's name when known (a plain pickle is then checked only under ``PICKLE_NAMES``).
    Raises ValueError for an unknown format name and OSError if the file cannot be read."""
    on = _validate(formats)
    head = _pread(fd, 0, min(size, 64))
    kind = recognise(head)
    if kind is None or kind.partition("-")[0] not in on:
        return None
    if kind == "pickle" and name is not None and not name.lower().endswith(PICKLE_NAMES):
        return None
    try:
        _CHECKS[kind](fd, size, head)
    except _Incomplete as e:
        return printable(str(e))
    except (struct.error, IndexError, ValueError, TypeError, OverflowError) as e:
        return printable(f"{kind} file: structure does not parse ({type(e).__name__}: {e})")
    return None


def printable(text: str, limit: int = 300) -> str:
    """One printable line of at most ``limit`` characters: reasons quote names read from
    a damaged file, which may hold newlines and any other bytes."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def recognise(head: bytes) -> str | None:
    """The format the leading bytes of a file announce: "torch" (a zip archive),
    "torch-legacy", "npy", "pickle", "safetensors", or None."""
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if head.startswith(_LEGACY_TORCH[:4]) and _LEGACY_TORCH.startswith(head[:15]):
        return "torch-legacy"  # a pickle stream followed by raw storage bytes
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and head[2:3] in _OPCODES:
        return "pickle"
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack_from("<Q", head)[0] <= MAX_HEADER:
        return "safetensors"
    return None


_OPCODES = {op.code.encode("latin1") for op in pickletools.opcodes} | {b""}


def _check_pickle(fd: int, size: int, head: bytes) -> None:
    if _pread(fd, size - 1, 1) != b".":
        raise _Incomplete(f"pickle (protocol {head[1]}): does not end with STOP")


def _pread(fd: int, offset: int, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
        n -= len(chunk)
    return b"".join(parts)


class _Stub:
    """Stands in for every global a pickle names: absorbs calls, items and state."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs) -> None: ...
    def __call__(self, *args, **kwargs) -> "_Stub": return _Stub()
    def __setstate__(self, state) -> None: ...
    def __setitem__(self, key, value) -> None: ...
    def append(self, item) -> None: ...
    def extend(self, items) -> None: ...
    def add(self, item) -> None: ...


class _StorageRefs(pickle._Unpickler):
    """Unpickles torch metadata without importing anything; collects storage references.

    The pure-Python unpickler, on purpose: the C one sizes its memo from the indexes the
    file names and zeroes it, so a 10-byte pickle (``LONG_BINPUT 0x40000000``) made it
    touch 16 GiB -- in the daemon, which checks every torch file closed in the mount.
    Here the memo is a dict, every read is bounded by the bytes there are, and
    ``BYTEARRAY8``, the one opcode that allocates its length before reading, is
    checked against them.  It costs about 3x the C unpickler's time (5 000 tensors'
    data.pkl, 0.5 MB: 0.11 s against 0.04 s)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file) -> None:
        super().__init__(file)
        self.stubs: dict[str, type] = {}
        self.pids: list = []
        # Unpickler documents overriding persistent_load by assignment as well as by
        # subclassing; it is called once per storage.
        self.persistent_load = self.pids.append  # type: ignore[method-assign,assignment]

    def _load_bytearray8(self) -> None:
        machine: Any = self          # read/append: set by the pure-Python unpickler
        (length,) = struct.unpack("<Q", machine.read(8))
        data = machine.read(min(length, MAX_HEADER))
        if len(data) != length:
            raise pickle.UnpicklingError("BYTEARRAY8 runs past the end of the pickle")
        machine.append(bytearray(data))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8  # type: ignore[assignment]

    def find_class(self, module: str, name: str) -> type:
        qual = f"{module}.{name}"
        if qual not in self.stubs:
            self.stubs[qual] = type(name, (_Stub,), {})
        return self.stubs[qual]

    @property
    def refs(self) -> dict[str, tuple[str, int]]:
        """storage key -> (storage type or dtype name, numel), from ('storage', type, key,
        location, numel, ...) persistent ids."""
        return {str(pid[2]): (getattr(pid[1], "__name__", ""), pid[4]) for pid in self.pids
                if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"
                and isinstance(pid[4], int)}


def _element_size(kind: str) -> int | None:
    return _ELEMENT_SIZE.get(kind.removesuffix("Storage"))


_MAX_EOCD_FROM_END = 65535 + 22  # zipfile looks for the end record this far from the end
_ZIP64_BEFORE_EOCD = 20 + 56      # zip64 locator and record
# Signatures of zip records (and their 3-byte prefixes): after an end record they mean the
# end record was an inner one -- a nested archive (.pt2) or an earlier one of a DCP shard.
_ZIP_RECORDS = {sig[:n] for sig in (b"PK\x01\x02", b"PK\x03\x04", b"PK\x05\x06", b"PK\x06\x06",
                                    b"PK\x06\x07", b"PK\x07\x08") for n in (3, 4)}


def _check_zip(fd: int, size: int, head: bytes) -> None:
    """Find the end record the way zipfile does (within the last 64 KiB; bytes after it
    and its comment are allowed), check its central directory, then the torch entries.

    Bytes after a valid end record are another file's business -- a newline, a signature
    -- unless they are zip records: then the record found belongs to an inner archive (a
    .pt2 holds zips, a DCP shard is zips back to back) and the file's own end was cut."""
    tail_at = max(0, size - (22 + _ZIP64_BEFORE_EOCD))
    tail = _pread(fd, tail_at, size - tail_at)
    if tail[-22:-18] != b"PK\x05\x06" or tail[-2:] != b"\0\0":  # a comment, or bytes after
        tail_at = max(0, size - (_MAX_EOCD_FROM_END + _ZIP64_BEFORE_EOCD))
        tail = _pread(fd, tail_at, size - tail_at)
    i, first_problem = len(tail), None
    while (i := tail.rfind(b"PK\x05\x06", 0, i)) >= 0:
        if size - (tail_at + i) > _MAX_EOCD_FROM_END:
            break
        end = i + 22 + (struct.unpack_from("<H", tail, i + 20)[0] if i + 22 <= len(tail) else 0)
        if end > len(tail):
            continue  # a record (or signature-like bytes) whose comment the file cuts
        after = tail[end:]
        try:
            entries = _central_directory(fd, tail, tail_at, i)
        except _Incomplete as e:
            if not after:
                raise  # the record sits exactly at the end: its directory is the answer
            first_problem = first_problem or e
            continue  # bytes that look like an end record inside data: look further back
        if after and (after[:4] in _ZIP_RECORDS or after in (b"P", b"PK")):
            raise _Incomplete("zip archive: zip records follow an end record "
                              "(the archive after it or around it is cut short)")
        _check_torch_entries(fd, entries)
        return
    raise first_problem or _Incomplete("zip archive: no end-of-central-directory record at the end")


def _central_directory(fd: int, tail: bytes, tail_at: int, i: int) -> dict[str, tuple[int, int, int]]:
    """name -> (method, uncompressed size, data start) of the archive whose end record
    is at ``tail[i:]``; _Incomplete if its directory or local headers are not where it says.
    Walks the directory by its size as zipfile does (the end record's count may wrap)."""
    cd_size, cd_off = struct.unpack_from("<12xLL", tail, i)
    cd_end = tail_at + i
    if i >= 76 and tail[i - 20:i - 16] == b"PK\x06\x07":  # zip64 locator; its record sits just before it
        if tail[i - 76:i - 72] != b"PK\x06\x06":
            raise _Incomplete("zip archive: zip64 end record missing")
        cd_size, cd_off = struct.unpack_from("<40xQQ", tail, i - 76)
        cd_end = tail_at + i - 76
    base = cd_end - cd_size - cd_off  # > 0 when the zip follows other bytes (DCP shards)
    if base < 0:
        raise _Incomplete("zip archive: central directory lies beyond its end record")
    cd_start = base + cd_off
    if cd_size > MAX_HEADER:
        return {}  # an implausibly large central directory: not ours to judge
    cd = _pread(fd, cd_start, cd_size)
    entries: dict[str, tuple[int, int, int]] = {}
    pos = 0
    while pos < len(cd):
        if cd[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(cd):
            raise _Incomplete(f"zip archive: central directory entry {len(entries)} is corrupt")
        (method, csize, usize, nlen, xlen, clen, off) = struct.unpack_from("<10xH8xLLHHH8xL", cd, pos)
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", errors="replace")
        csize, usize, off = _zip64_extra(cd[pos + 46 + nlen:pos + 46 + nlen + xlen], csize, usize, off)
        pos += 46 + nlen + xlen + clen
        # Only the signature: zipfile compares names after decoding them, and an archive
        # appended to in mode "a" may spell a name differently here and in its directory.
        local = _pread(fd, base + off, 30)
        if local[:4] != b"PK\x03\x04" or len(local) < 30:
            raise _Incomplete(f"zip archive: local header of {name} missing")
        start = base + off + 30 + sum(struct.unpack_from("<HH", local, 26))
        if start + csize > cd_start:
            raise _Incomplete(f"zip archive: data of {name} runs past the central directory")
        entries[name] = (method, usize, start)
    if pos != len(cd):
        raise _Incomplete(f"zip archive: central directory has {len(cd)} bytes, its entries {pos}")
    return entries


def _zip64_extra(extra: bytes, csize: int, usize: int, off: int) -> tuple[int, int, int]:
    while len(extra) >= 4:
        tag, n = struct.unpack_from("<HH", extra)
        if tag == 1:  # zip64: the 32-bit fields that are 0xFFFFFFFF, in this order
            values = iter(struct.unpack_from(f"<{n // 8}Q", extra, 4))
            usize = next(values) if usize == 0xFFFFFFFF else usize
            csize = next(values) if csize == 0xFFFFFFFF else csize
            off = next(values) if off == 0xFFFFFFFF else off
        extra = extra[4 + n:]
    return csize, usize, off


def _check_torch_entries(fd: int, entries: dict[str, tuple[int, int, int]]) -> None:
    prefixes = {n.partition("/")[0] for n in entries}
    if len(prefixes) != 1 or "/" not in next(iter(entries)):
        return  # not a torch archive (.npz, any other zip): the zip structure is all we check
    p = prefixes.pop() + "/"
    rest = {n[len(p):] for n in entries}
    if "version" not in rest and ".data/version" not in rest:
        return
    if "data.pkl" not in rest and all(n in _TORCH_BOOKKEEPING or re.fullmatch(r"data/\d+", n)
                                      for n in rest):
        raise _Incomplete("torch archive: no data.pkl (torch.save was interrupted)")
    for pkl, folder in (("data.pkl", "data/"), ("constants.pkl", "constants/")):
        method, usize, start = entries.get(p + pkl, (None, 0, 0))
        if method != 0 or usize > MAX_HEADER:
            continue  # absent, compressed (torch never compresses), or too big to read
        refs = _storage_refs(io.BytesIO(_pread(fd, start, usize)))
        if refs is None:
            continue  # a pickle these stubs cannot follow: cannot judge
        for key, (kind, numel) in sorted(refs.items()):
            entry = entries.get(f"{p}{folder}{key}")
            if entry is None:
                raise _Incomplete(f"torch archive: storage {folder}{key} referenced by {pkl} is missing")
            es = _element_size(kind)
            if es is not None and entry[1] < numel * es:
                raise _Incomplete(f"torch archive: storage {folder}{key} has {entry[1]} bytes, "
                                 f"{pkl} needs {numel * es}")


def _storage_refs(file) -> dict[str, tuple[str, int]] | None:
    unpickler = _StorageRefs(file)
    try:
        unpickler.load()
    except Exception:  # noqa: BLE001 - any failure of a pickle we only inspect
        return None
    return unpickler.refs


def _check_legacy_torch(fd: int, size: int, head: bytes) -> None:
    """Five pickles (magic, protocol, sys_info, the object, storage keys), then per storage
    its element count (int64) and bytes.  The pickles are read from a head that grows."""
    n = min(size, 1 << 20)
    while True:
        buf = io.BytesIO(_pread(fd, 0, n))
        try:
            for _ in range(3):
                _StorageRefs(buf).load()
            (objects := _StorageRefs(buf)).load()
            keys, refs = _StorageRefs(buf).load(), objects.refs
            break
        except Exception as e:  # noqa: BLE001 - a cut or corrupt pickle: read more, or judge
            if n == size:
                raise _Incomplete(f"legacy torch file: pickles end early ({type(e).__name__})") from None
            if n >= MAX_HEADER:
                return  # pickles too large to read: cannot judge
            n = min(size, MAX_HEADER, n * 8)
    pos = buf.tell()
    for key in keys if isinstance(keys, list) else ():
        es = _element_size(refs.get(str(key), ("", 0))[0])
        count = _pread(fd, pos, 8)
        if len(count) < 8:
            raise _Incomplete(f"legacy torch file: storage {key} is missing")
        if es is None:
            return  # unknown element size: cannot walk further
        pos += 8 + max(0, struct.unpack("<q", count)[0]) * es
    if pos != size:
        raise _Incomplete(f"legacy torch file: storages need {pos} bytes, file has {size}")


def _check_safetensors(fd: int, size: int, head: bytes) -> None:
    n = struct.unpack_from("<Q", head)[0]
    if 8 + n > size:
        raise _Incomplete(f"safetensors: header of {n} bytes is cut short ({size} bytes in file)")
    try:
        header = json.loads(_pread(fd, 8, n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise _Incomplete(f"safetensors: header does not parse ({type(e).__name__})") from None
    if size != 8 + n + end:
        raise _Incomplete(f"safetensors: size {size}, header says {8 + n + end}")


def _check_npy(fd: int, size: int, head: bytes) -> None:
    """One array, or several saved one after another into the same file (np.save twice)."""
    pos, n = 0, 0
    while pos < size:
        head = _pread(fd, pos, 12)
        if not head.startswith(b"\x93NUMPY"[:len(head)]):
            return  # other bytes after the arrays: not ours to judge
        major = head[6:7]
        if major not in (b"\x01", b"\x02", b"\x03", b""):
            return  # a version this checker does not know
        fmt = "<H" if major == b"\x01" else "<L"
        start = pos + 8 + struct.calcsize(fmt)
        if len(head) < start - pos:
            raise _Incomplete(f"npy: header of array {n} cut short ({size} bytes in file)")
        hlen = struct.unpack_from(fmt, head, 8)[0]
        if start + hlen > size:
            raise _Incomplete(f"npy: header of array {n} cut short ({size} bytes in file)")
        if hlen > MAX_NPY_HEADER:
            return  # numpy itself refuses such a header by default: not ours to judge
        try:
            text = _pread(fd, start, hlen).decode("utf-8" if major == b"\x03" else "latin1")
            header = ast.literal_eval(text)
            shape, descr = tuple(header["shape"]), header["descr"]
        except (ValueError, SyntaxError, TypeError, KeyError, UnicodeDecodeError,
                RecursionError, MemoryError) as e:
            raise _Incomplete(f"npy: header of array {n} does not parse ({type(e).__name__})") from None
        itemsize = _npy_itemsize(descr)
        if itemsize is None:
            return  # object arrays hold a pickle of unknown length
        pos = start + hlen + math.prod(shape) * itemsize
        if pos > size:
            raise _Incomplete(f"npy: array {n} needs {pos} bytes, file has {size}")
        n += 1


def _npy_itemsize(descr) -> int | None:
    """Bytes per element of a .npy descr; None for object dtypes or when it cannot be told."""
    if isinstance(descr, str) and (m := re.fullmatch(r"[<>|=]?([biufcSVUmM])(\d+)(\[\w+\])?", descr)):
        return int(m[2]) * (4 if m[1] == "U" else 1)
    try:
        import numpy  # only for structured dtypes
        dtype = numpy.lib.format.descr_to_dtype(descr)
    except Exception:  # noqa: BLE001 - no numpy, or a descr numpy rejects: cannot judge
        return None
    return None if dtype.hasobject else dtype.itemsize


_CHECKS = {"torch": _check_zip, "torch-legacy": _check_legacy_torch, "npy": _check_npy,
           "pickle": _check_pickle, "safetensors": _check_safetensors}
