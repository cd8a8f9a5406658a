"""Reused page-aligned buffers for whole chunks.

On the machines ckptfs runs on, touching a fresh page costs more CPU than copying into a
page already touched (decision 0011: a fresh 8 MiB buffer ~0.8 CPU s per GiB of system
time, a reused one ~0.01).  Uploads read a chunk back from staging into a reused buffer,
hash it and send it from there; fetches receive a chunk into one, verify it, write its
cache file with ``O_DIRECT`` (which needs an aligned source) and serve reads from it.

The rule that keeps reuse safe: a buffer goes back to the pool only when nobody can write
into it or read from it any more.  A store call that timed out may still be running in
its thread (``store.retry``), so a buffer whose call failed is never given back: it is
dropped and freed when the late call lets go of it.  Knows nothing of chunks' meaning.
"""

from __future__ import annotations

import mmap
import threading

PAGE = 4096


class BufferPool:
    """Anonymous ``mmap`` buffers of ``size`` bytes (page-aligned), at most ``keep`` of
    them kept free.  A request larger than ``size`` gets a buffer of its own (a chunk
    from a node with bigger chunks), freed instead of kept.  Thread-safe."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.created = 0          # buffers ever mapped (tests read it)

    def take(self, n: int) -> mmap.mmap:
        """A buffer of at least ``n`` bytes (its length may be larger: use a view)."""
        if n <= self.size:
            with self._lock:
                if self._free:
                    return self._free.pop()
                self.created += 1
            return mmap.mmap(-1, self.size)
        with self._lock:
            self.created += 1
        return mmap.mmap(-1, -(-n // PAGE) * PAGE)

    def give(self, buf: mmap.mmap) -> None:
        """Return a buffer nobody uses any more."""
        if len(buf) == self.size:
            with self._lock:
                if len(self._free) < self.keep:
                    self._free.append(buf)
                    return
        try:
            buf.close()
        except BufferError:       # a view of it is still alive somewhere: GC frees it
            pass
