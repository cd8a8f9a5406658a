"""Wrappers around any store: ``RetryingStore`` (backoff with jitter within an overall
deadline per call) and ``CountingStore`` with its ``StoreStats`` (request and byte
counters behind ``ckptfs status``).

Knows nothing above the store protocol.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .retrypolicy import RetryPolicy
from .base import (ListedObject, NotFound, ObjectStore, PreconditionFailed, StoreClosed,
                   StoreError, StoreTimeout,
                   TransientStoreError)

# The retry layer's lines keep the logger name they have always had (``ckptfs.store``):
# operators and the log checks match on it.
log = logging.getLogger("ckptfs.store")


def store_policy(deadline: float = 60.0) -> RetryPolicy:
    """The store's retries: six tries, full-jitter backoff from 0.2 s doubling up to 5 s,
    all within ``deadline`` (``store_timeout``)."""
    return RetryPolicy(attempts=6, base_delay=0.2, max_delay=5.0, jitter=True,
                       deadline=deadline)


class _Attempt:
    """One try of a store call, run in an ``_AttemptRunner`` thread."""

    __slots__ = ("fn", "event", "finished", "result", "error", "cpu")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.event = threading.Event()   # set when finished, or to wake the waiter
        self.finished = False
        self.result = None
        self.error: BaseException | None = None
        self.cpu = 0.0                   # the attempt thread's CPU seconds (set when finished)

    def run(self) -> None:
        started = time.thread_time()
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.error = exc
        finally:
            self.cpu = time.thread_time() - started
            self.finished = True
            self.event.set()


def _name_os_thread(name: bytes) -> None:
    """Give the calling thread its name in /proc (``comm``): a new thread otherwise
    inherits its creator's, and per-thread CPU (tools/profile_paths.py) is misattributed."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class _AttemptRunner:
    """Worker threads that run attempts, so that a caller stops waiting at its deadline
    even when a socket read or a hung file system never returns.  A late attempt keeps
    its thread until it ends (bounded by the store's own socket timeouts); idle threads
    are reused and leave after ``idle_exit`` seconds.  Daemon threads: an attempt still
    stuck at exit never holds the process up."""

    def __init__(self, idle_exit: float = 30.0) -> None:
        self.idle_exit = idle_exit
        self._tasks: queue.SimpleQueue[_Attempt] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0          # idle threads not yet promised a task

    def submit(self, fn) -> _Attempt:
        attempt = _Attempt(fn)
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._work, daemon=True, name="ckptfs-store").start()
        self._tasks.put(attempt)
        return attempt

    def _work(self) -> None:
        _name_os_thread(b"ckptfs-store")
        while True:
            try:
                attempt = self._tasks.get(timeout=self.idle_exit)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:
                        self._idle -= 1
                        return
                continue
            attempt.run()
            with self._lock:
                self._idle += 1


class RetryingStore:
    """Retries transient failures by its ``RetryPolicy`` (``store_policy()``: backoff
    with full jitter), within the policy's overall deadline per call: no attempt outlives
    it and no new attempt or sleep starts past it; then ``StoreTimeout`` names the operation and the
    key.  Permanent failures are never retried.  ``close()`` makes every call in flight
    return at once with ``StoreClosed`` (the daemon is stopping)."""

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 stats: "StoreStats | None" = None) -> None:
        self.inner = inner
        self.policy = policy or store_policy()
        if self.policy.deadline is None:
            raise ValueError("a RetryingStore needs a policy with a deadline")
        self._deadline: float = self.policy.deadline
        self.stats = stats
        self.url = inner.url
        self._runner = _AttemptRunner()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._waiting: set[_Attempt] = set()

    def close(self) -> None:
        """Give up every call in flight (their threads end on their own) and refuse new
        ones: used when the daemon stops with uploads still pending."""
        self._closed.set()
        with self._lock:
            waiting = list(self._waiting)
        for attempt in waiting:
            attempt.event.set()

    def _timeout(self, what: str, key: str, last: BaseException | None) -> StoreTimeout:
        why = f" (last error: {last})" if last is not None else ""
        target = f"{what} {key}" if key else what
        exc = StoreTimeout(f"store timeout: {target} after {self.policy.deadline:g} s{why}")
        log.error("%s", exc)
        if self.stats:
            self.stats.error("timeout")
        return exc

    def _attempt(self, what: str, fn, deadline: float):
        """Run ``fn`` once; return its result, raise its error, or return ``_LATE`` if the
        deadline passed (or the store was closed) first."""
        attempt = self._runner.submit(fn)
        with self._lock:
            self._waiting.add(attempt)
        try:
            attempt.event.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with self._lock:
                self._waiting.discard(attempt)
        if not attempt.finished:
            return _LATE
        if self.stats:
            self.stats.add_cpu(what, attempt.cpu)
        if attempt.error is not None:
            raise attempt.error
        return attempt.result

    def _call(self, what: str, key: str, fn):
        deadline = time.monotonic() + self._deadline
        attempt = 0
        last: BaseException | None = None
        while True:
            if self._closed.is_set():
                raise StoreClosed(f"store closed: {what} {key} given up (unmounting)")
            if time.monotonic() >= deadline:
                raise self._timeout(what, key, last)
            try:
                result = self._attempt(what, fn, deadline)
            except TransientStoreError as exc:
                last = exc
                attempt += 1
                if self.stats:
                    self.stats.error("transient")
                if self.policy.gives_up(attempt):
                    log.error("store %s %s failed after %d attempts: %s", what, key, attempt,
                              exc)
                    raise
                delay = self.policy.delay(attempt)
                if time.monotonic() + delay >= deadline:
                    raise self._timeout(what, key, last) from None
                log.warning("store %s %s failed (%s); retry %d in %.2fs", what, key, exc,
                            attempt, delay)
                if self.stats:
                    self.stats.add(retries=1)
                self._closed.wait(delay)
                continue
            except (NotFound, PreconditionFailed):
                raise
            except StoreError:
                if self.stats:
                    self.stats.error("permanent")
                raise
            if result is _LATE:
                if self._closed.is_set():
                    raise StoreClosed(f"store closed: {what} {key} given up (unmounting)")
                raise self._timeout(what, key, last)
            return result

    def check(self) -> None:
        self._call("check", "", self.inner.check)

    # A conditional write retried after a transient error may find its own first
    # attempt's work: the request acted and only its reply was lost (a reset, a
    # timeout).  The retry's 412 (or "exists", or a conditional delete's 412 on a key now
    # gone) would then tell the caller that another node got there first -- an rmdir
    # took its own claim for another node's and waited out the claim's TTL.  Such an
    # answer is checked against the store: every entry body is unique (its ``rev``), so
    # the body there being this call's means this call wrote it.

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        if if_match is None:
            return self._call("put", key, lambda: self.inner.put(key, data, sha256))
        tries = _Tries(lambda: self.inner.put(key, data, sha256, if_match=if_match))
        try:
            return self._call("put", key, tries)
        except PreconditionFailed:
            if tries.count > 1 and (mine := self._holds(key, data)) is not None:
                return mine
            raise

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        tries = _Tries(lambda: self.inner.put_if_absent(key, data))
        done = self._call("put_if_absent", key, tries)
        if not done and tries.count > 1:
            return self._holds(key, data)
        return done

    def _holds(self, key: str, data: bytes) -> str | None:
        """The ETag of ``key`` if it holds ``data`` (a lost reply's write), else None."""
        try:
            body, etag = self.get(key)
        except NotFound:
            return None
        return etag if bytes(body) == bytes(data) else None

    def get(self, key: str) -> tuple[bytes, str]:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        """As ``get``, into ``buffer``.  After a ``StoreTimeout`` or ``StoreClosed`` an
        attempt may still be writing into ``buffer``: the caller must not reuse it."""
        return self._call("get", key, lambda: self.inner.get_into(key, buffer))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str) -> Iterator[ListedObject]:
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str, if_match: str | None = None) -> None:
        tries = _Tries(lambda: self.inner.delete(key, if_match))
        try:
            self._call("delete", key, tries)
        except PreconditionFailed:
            if if_match is None or tries.count < 2 or self.exists(key):
                raise
            # Gone: an earlier try deleted it (or another node did: gone either way).


class _Tries:
    """A store call counting its tries (more than one: an earlier one may have acted)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.count = 0

    def __call__(self):
        self.count += 1
        return self.fn()


_LATE = object()


@dataclass
class StoreStats:
    """Counters shared by CountingStore and the retry loop; thread-safe."""

    bytes_put: int = 0
    bytes_got: int = 0
    puts: int = 0
    gets: int = 0
    lists: int = 0
    deletes: int = 0
    heads: int = 0
    errors: int = 0
    retries: int = 0
    chunk_bytes_put: int = 0
    chunk_bytes_got: int = 0
    entry_puts: int = 0                 # dirs/ entries and inodes/ objects
    error_kinds: dict[str, int] = field(default_factory=dict)   # transient|timeout|permanent
    # CPU seconds of the threads that ran each kind of request (put, get, list, ...):
    # building, signing and checksumming it, sending and receiving its bytes.
    cpu_s: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def add_cpu(self, what: str, seconds: float) -> None:
        with self._lock:
            self.cpu_s[what] = self.cpu_s.get(what, 0.0) + seconds

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int | dict[str, int] | dict[str, float]]:
        with self._lock:
            return {k: ({n: round(x, 3) if isinstance(x, float) else x for n, x in v.items()}
                        if isinstance(v, dict) else v)
                    for k, v in vars(self).items() if not k.startswith("_")}


class CountingStore:
    """Counts requests and bytes moved; the numbers behind ``ckptfs status`` and tests."""

    def __init__(self, inner: ObjectStore, stats: StoreStats) -> None:
        self.inner = inner
        self.stats = stats
        self.url = inner.url

    def check(self) -> None:
        self.inner.check()

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        etag = self.inner.put(key, data, sha256, if_match=if_match)
        self._count_put(key, len(data))
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        done = self.inner.put_if_absent(key, data)
        if done:
            self._count_put(key, len(data))
        return done

    def _count_put(self, key: str, n: int) -> None:
        self.stats.add(puts=1, bytes_put=n, chunk_bytes_put=n if key.startswith("chunks/") else 0,
                       entry_puts=1 if key.startswith(("dirs/", "inodes/")) else 0)

    def get(self, key: str) -> tuple[bytes, str]:
        body, etag = self.inner.get(key)
        self._count_get(key, len(body))
        return body, etag

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        n, etag = self.inner.get_into(key, buffer)
        self._count_get(key, n)
        return n, etag

    def _count_get(self, key: str, n: int) -> None:
        self.stats.add(gets=1, bytes_got=n, chunk_bytes_got=n if key.startswith("chunks/") else 0)

    def exists(self, key: str) -> bool:
        self.stats.add(heads=1)
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[ListedObject]:
        self.stats.add(lists=1)
        return self.inner.list(prefix)

    def delete(self, key: str, if_match: str | None = None) -> None:
        self.stats.add(deletes=1)
        self.inner.delete(key, if_match)


