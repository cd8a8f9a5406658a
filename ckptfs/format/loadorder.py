"""The order a checkpoint loader reads the files of a directory in, so that a reader at
one file's end can have the next ones fetched ahead (core/read.py).

Shard names carry their index in decimal: ``model-00002-of-00004.safetensors`` (a
safetensors index lists its shards, and loaders read them sorted by name), DCP's
``__<rank>_<n>.distcp`` (read in rank order, where ``__10_0`` follows ``__9_0``), Megatron's
``mp_rank_NN``.  Natural order (digit runs compared as numbers, the rest byte-wise) is
that order for all of them, and plain name order for names without digits.  Knows nothing
of the namespace, the cache or FUSE.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_RUNS = re.compile(rb"(\d+)")


def natural_key(name: bytes) -> tuple:
    """A sort key comparing digit runs as numbers (``2`` before ``10``), ties broken by
    the name itself so that the order is total."""
    parts = _RUNS.split(name)
    key: list[tuple[int, int | bytes]] = []
    for i, part in enumerate(parts):
        if i % 2:
            key.append((0, int(part)))
        elif part:
            key.append((1, part))
    return (tuple(key), name)


def following(names: Iterable[bytes], name: bytes) -> list[bytes]:
    """The names after ``name`` in load order (natural order), nearest first."""
    mine = natural_key(name)
    return sorted((n for n in names if natural_key(n) > mine), key=natural_key)
