"""Chunk identity (remote format v2, DESIGN.md §3): what names a chunk body.

A chunk id is the digest of its bytes, in one of two spellings that live side by side in
one store:

- ``<64 hex>``: sha256, what format v1 wrote (and what a node with ``chunk_hash =
  sha256`` still writes);
- ``b3-<64 hex>``: BLAKE3 (256-bit), what format v2 writes by default: about half
  sha256's CPU per byte on this hardware (decision 0025).

Both are cryptographic: a chunk id is trusted across nodes that do not trust each other's
bytes, so a fast non-cryptographic hash (xxhash, CRC) is never an identity.  Ids of the
two algorithms never name the same chunk (no dedup across them).  The id is the last
component of the chunk's store key (``remote.chunk_key``), so anything that lists chunks
(gc) gets the id back from the key.  Knows nothing of stores, upload or caching.
"""

from __future__ import annotations

import hashlib
import re
from types import ModuleType

try:                        # a declared dependency; absent only in a stale environment
    import blake3 as _blake3_module
    _blake3: ModuleType | None = _blake3_module
except ImportError:         # pragma: no cover - reported when a b3 id is first needed
    _blake3 = None

SHA256 = "sha256"
BLAKE3 = "blake3"
ALGORITHMS = (BLAKE3, SHA256)
B3_PREFIX = "b3-"
ID_RE = re.compile(r"^(?:b3-)?[0-9a-f]{64}$")


class HashUnavailable(RuntimeError):
    """The ``blake3`` package is missing: b3 chunks can be neither made nor verified."""


def _b3() -> ModuleType:
    if _blake3 is None:
        raise HashUnavailable("the blake3 package is not installed (pip install "
                              "blake3==1.0.11; or mount with chunk_hash = sha256, which "
                              "still cannot read blake3 chunks)")
    return _blake3


def chunk_id(data, algorithm: str = BLAKE3) -> str:
    """The id of the chunk ``data`` (bytes-like) under ``algorithm``.  BLAKE3 runs on
    the calling thread only (``max_threads`` 1): chunks are hashed several at once in
    upload workers, and CPU per byte is what this choice saves."""
    if algorithm == BLAKE3:
        return B3_PREFIX + _b3().blake3(data).hexdigest()
    if algorithm == SHA256:
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"unknown chunk hash {algorithm!r}")


def blake3_hasher():
    """A fresh BLAKE3 hash to feed in pieces (one thread)."""
    return _b3().blake3(max_threads=1)


def algorithm_of(cid: str) -> str:
    return BLAKE3 if cid.startswith(B3_PREFIX) else SHA256


def is_chunk_id(value: object) -> bool:
    return isinstance(value, str) and ID_RE.match(value) is not None


def digest_hex(cid: str) -> str:
    """The hex digest inside an id (the store key's fan-out comes from it)."""
    return cid[len(B3_PREFIX):] if cid.startswith(B3_PREFIX) else cid


def chunk_ok(data, cid: str) -> bool:
    """Whether ``data`` (bytes-like) is the chunk named ``cid``."""
    return chunk_id(data, algorithm_of(cid)) == cid


def sha256_of(cid: str) -> str | None:
    """The body's sha256 when the id is one (a store can check the transfer with it, and
    a SigV4 signature can name it, for free); None for other algorithms."""
    return cid if algorithm_of(cid) == SHA256 else None
