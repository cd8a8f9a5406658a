"""Is a checkpoint file structurally complete?  (DESIGN.md promise 2, "structurally incomplete".)

An exception inside ``with open(...)`` during ``torch.save`` -- or a SIGTERM handler that
calls ``sys.exit(1)`` -- unwinds and closes a half-written file from a live process, so the
close looks meant.  Before a file is published we look at the formats checkpoints are
written in, recognised by their LEADING BYTES (never by name), and say why one is
incomplete:

* ``torch``: a zip archive (``PK\\3\\4``: torch.save, torch.jit.save, .pt2, .npz, DCP shards,
  which are several torch zips back to back) must end with a consistent end record
  (zip64 too) whose central directory parses and whose entries lie inside the file.  In a
  torch.save archive every storage that ``data.pkl`` references must be an entry of at
  least numel x element-size bytes: torch's zip writer writes the end record even when the
  save is interrupted (its close runs in a ``finally``), leaving an archive with no
  ``data.pkl`` or without the storages.  The legacy (pre-1.6) pickle-stream format is
  walked record by record.  ``data.pkl`` is read with an Unpickler that imports nothing.
* ``safetensors``: 8-byte header length, JSON header, size == 8 + N + largest data end.
* ``npy``: magic, header dict (``ast.literal_eval``), size == header + prod(shape) x itemsize.
* ``pickle`` (protocol 2-5): the last byte is STOP.

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

FORMATS = ("torch", "safetensors", "npy", "pickle")
MAX_HEADER = 100 * 2**20  # safetensors / npy header / pickles we are willing to read
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


class Incomplete(Exception):
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


def check_complete(fd: int, size: int, formats: Iterable[str] = FORMATS) -> str | None:
    """None if the file is complete or of no known format; otherwise a one-line reason
    (e.g. "torch archive: storage data/3 referenced by data.pkl is missing")."""
    on = _validate(formats)
    head = _pread(fd, 0, min(size, 64))
    try:
        if head.startswith(b"PK\x03\x04") and "torch" in on:
            _check_zip(fd, size)
        elif head.startswith(_LEGACY_TORCH[:4]) and _LEGACY_TORCH.startswith(head[:15]):
            if "torch" in on:  # a legacy torch file is a pickle stream followed by raw bytes
                _check_legacy_torch(fd, size)
        elif head.startswith(b"\x93NUMPY") and "npy" in on:
            _check_npy(fd, size, head)
        elif (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
              and (len(head) == 2 or chr(head[2]) in _OPCODES) and "pickle" in on):
            if _pread(fd, size - 1, 1) != b".":
                raise Incomplete(f"pickle (protocol {head[1]}): does not end with STOP")
        elif len(head) >= 9 and head[8:9] == b"{" and "safetensors" in on:
            _check_safetensors(fd, size, head)
    except Incomplete as e:
        return str(e)
    return None


_OPCODES = {op.code for op in pickletools.opcodes}


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


class _Window(io.RawIOBase):
    """A read-only file over ``fd`` bytes [start, end), for the Unpickler to pull from."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self.fd, self.pos, self.end = fd, start, end

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:  # type: ignore[override]
        data = _pread(self.fd, self.pos, min(len(buf), self.end - self.pos))
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _Stub:
    """Stands in for every global a pickle names: absorbs calls, items and state."""
    qualname = ""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs) -> None: ...
    def __setstate__(self, state) -> None: ...
    def __setitem__(self, key, value) -> None: ...
    def append(self, item) -> None: ...
    def extend(self, items) -> None: ...
    def add(self, item) -> None: ...


class _StorageRefs(pickle.Unpickler):
    """Unpickles torch metadata without importing anything; collects storage references."""

    def __init__(self, file) -> None:
        super().__init__(file)
        self.stubs: dict[str, type] = {}
        self.refs: dict[str, tuple[str, int]] = {}  # key -> (storage type, numel)

    def find_class(self, module: str, name: str) -> type:
        qual = f"{module}.{name}"
        if qual not in self.stubs:
            self.stubs[qual] = type(name, (_Stub,), {"qualname": qual})
        return self.stubs[qual]

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            kind = getattr(pid[1], "qualname", "")
            self.refs[str(pid[2])] = (kind.rpartition(".")[2], int(pid[4]))
        return _Stub()


def _element_size(kind: str) -> int | None:
    return _ELEMENT_SIZE.get(kind.removesuffix("Storage"))


def _check_zip(fd: int, size: int) -> None:
    tail_at = max(0, size - (65535 + 22 + 20 + 56))
    tail = _pread(fd, tail_at, size - tail_at)
    i = len(tail)
    while (i := tail.rfind(b"PK\x05\x06", 0, i)) >= 0:  # the end record, then its comment
        if i + 22 <= len(tail) and i + 22 + struct.unpack_from("<H", tail, i + 20)[0] == len(tail):
            break
    else:
        raise Incomplete("zip archive: no end-of-central-directory record at the end")
    count, cd_size, cd_off = struct.unpack_from("<10xHLL", tail, i)
    cd_end = tail_at + i
    if tail[i - 20:i - 16] == b"PK\x06\x07":  # zip64 locator; its record sits just before it
        if tail[i - 76:i - 72] != b"PK\x06\x06":
            raise Incomplete("zip archive: zip64 end record missing")
        count, cd_size, cd_off = struct.unpack_from("<32xQQQ", tail, i - 76)
        cd_end = tail_at + i - 76
    base = cd_end - cd_size - cd_off  # > 0 when the zip follows other bytes (DCP shards)
    if base < 0:
        raise Incomplete("zip archive: central directory lies beyond its end record")
    cd_start = base + cd_off
    cd = _pread(fd, cd_start, cd_size)
    entries: dict[str, tuple[int, int, int]] = {}  # name -> (method, uncompressed, data start)
    pos = 0
    for _ in range(count):
        if cd[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(cd):
            raise Incomplete(f"zip archive: central directory entry {len(entries)} is corrupt")
        (method, csize, usize, nlen, xlen, clen, off) = struct.unpack_from("<10xH8xLLHHH8xL", cd, pos)
        name = cd[pos + 46:pos + 46 + nlen]
        csize, usize, off = _zip64_extra(cd[pos + 46 + nlen:pos + 46 + nlen + xlen], csize, usize, off)
        pos += 46 + nlen + xlen + clen
        local = _pread(fd, base + off, 30 + nlen)
        if local[:4] != b"PK\x03\x04" or local[30:] != name:
            raise Incomplete(f"zip archive: local header of {name.decode(errors='replace')} missing")
        start = base + off + 30 + nlen + struct.unpack_from("<H", local, 28)[0]
        if start + csize > cd_start:
            raise Incomplete(f"zip archive: data of {name.decode(errors='replace')} runs past the central directory")
        entries[name.decode("utf-8", errors="replace")] = (method, usize, start)
    _check_torch_entries(fd, entries)


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
        raise Incomplete("torch archive: no data.pkl (torch.save was interrupted)")
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
                raise Incomplete(f"torch archive: storage {folder}{key} referenced by {pkl} is missing")
            es = _element_size(kind)
            if es is not None and entry[1] < numel * es:
                raise Incomplete(f"torch archive: storage {folder}{key} has {entry[1]} bytes, "
                                 f"{pkl} needs {numel * es}")


def _storage_refs(file) -> dict[str, tuple[str, int]] | None:
    unpickler = _StorageRefs(file)
    try:
        unpickler.load()
    except Exception:  # noqa: BLE001 - any failure of a pickle we only inspect
        return None
    return unpickler.refs


def _check_legacy_torch(fd: int, size: int) -> None:
    """magic, protocol, sys_info, object, storage keys (5 pickles); then per storage its
    element count (int64) and bytes."""
    reader = io.BufferedReader(_Window(fd, 0, size), 1 << 16)
    refs: dict[str, tuple[str, int]] = {}
    try:
        for _ in range(3):
            _StorageRefs(reader).load()
        objects = _StorageRefs(reader)
        objects.load()
        refs = objects.refs
        keys = _StorageRefs(reader).load()
    except Exception as e:  # noqa: BLE001
        raise Incomplete(f"legacy torch file: pickles end early ({type(e).__name__})") from None
    pos = reader.tell()  # exact: the Unpickler gives back what it peeked at
    for key in keys if isinstance(keys, list) else ():
        es = _element_size(refs.get(str(key), ("", 0))[0])
        count = _pread(fd, pos, 8)
        if len(count) < 8:
            raise Incomplete(f"legacy torch file: storage {key} is missing")
        if es is None:
            return  # unknown element size: cannot walk further
        pos += 8 + struct.unpack("<q", count)[0] * es
    if pos != size:
        raise Incomplete(f"legacy torch file: storages need {pos} bytes, file has {size}")


def _check_safetensors(fd: int, size: int, head: bytes) -> None:
    n = struct.unpack_from("<Q", head)[0]
    if n > MAX_HEADER:
        return  # not a plausible safetensors header: some other format
    if 8 + n > size:
        raise Incomplete(f"safetensors: header of {n} bytes is cut short ({size} bytes in file)")
    try:
        header = json.loads(_pread(fd, 8, n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise Incomplete(f"safetensors: header does not parse ({type(e).__name__})") from None
    if size != 8 + n + end:
        raise Incomplete(f"safetensors: size {size}, header says {8 + n + end}")


def _check_npy(fd: int, size: int, head: bytes) -> None:
    if len(head) < 12:
        raise Incomplete(f"npy: header cut short ({size} bytes)")
    major = head[6]
    hlen_at, fmt = (8, "<H") if major == 1 else (8, "<L")
    if major not in (1, 2, 3):
        return
    hlen = struct.unpack_from(fmt, head, hlen_at)[0]
    start = hlen_at + struct.calcsize(fmt)
    if start + hlen > size:
        raise Incomplete(f"npy: header of {hlen} bytes is cut short ({size} bytes in file)")
    try:
        header = ast.literal_eval(_pread(fd, start, hlen).decode("utf-8" if major == 3 else "latin1"))
        shape, descr = tuple(header["shape"]), header["descr"]
    except (ValueError, SyntaxError, TypeError, KeyError, UnicodeDecodeError) as e:
        raise Incomplete(f"npy: header does not parse ({type(e).__name__})") from None
    itemsize = _npy_itemsize(descr)
    if itemsize is not None and size != start + hlen + math.prod(shape) * itemsize:
        raise Incomplete(f"npy: size {size}, header says {start + hlen + math.prod(shape) * itemsize}")


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
