"""Object stores: the bottom layer.

Defines the ``ObjectStore`` protocol every other layer talks to, and its
implementations: ``LocalStore`` (a directory standing in for a bucket), ``S3Store``
(boto3), ``RetryingStore`` (backoff with jitter around any store) and
``CountingStore`` (byte and request counters).  Methods are blocking; callers run
them in worker threads.  This module knows nothing about files, inodes or FUSE: it
moves opaque bytes under opaque keys.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import os
import queue
import random
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class StoreError(Exception):
    """A store operation failed for good (bad credentials, missing bucket, ...)."""


class TransientStoreError(StoreError):
    """A store operation failed in a way worth retrying (5xx, throttling, resets)."""


class NotFound(StoreError):
    """The key does not exist."""


class PreconditionFailed(StoreError):
    """A conditional write or delete found the key in another state (HTTP 412)."""


class StoreTimeout(TransientStoreError):
    """A store call did not finish within its overall deadline (``store_timeout``),
    all attempts together.  Transient: a later call may well succeed."""


class StoreClosed(TransientStoreError):
    """The store was closed (the daemon is stopping) while the call was in flight."""


def is_permanent(exc: BaseException) -> bool:
    """A store failure that retrying cannot cure (a 4xx other than 408/429: a key too
    long, an invalid argument, access denied).  Not-found and precondition failures are
    answers, not failures, and are not permanent in this sense."""
    return isinstance(exc, StoreError) and not isinstance(
        exc, (TransientStoreError, NotFound, PreconditionFailed))


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    etag: str
    mtime: float = 0.0     # last modified, seconds since the epoch


class ObjectStore(Protocol):
    """What ckptfs needs from an object store.  Keys are relative to the store's root."""

    url: str

    def check(self) -> None:
        """Raise StoreError with a one-line reason if the store cannot be used."""

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        """Store ``data`` under ``key`` atomically; return the new ETag.  ``sha256``, if
        given, is the hex digest of ``data`` (lets S3 verify it, and saves re-hashing).
        With ``if_match`` only if the key exists with that ETag, else
        ``PreconditionFailed``."""

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Store ``data`` only if ``key`` does not exist: the new ETag (a non-empty
        string), or None if the key existed."""

    def get(self, key: str) -> tuple[bytes, str]:
        """Return (body, etag); raise NotFound."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes [start, end) of the object; raise NotFound."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[ListedObject]:
        """Every object whose key starts with ``prefix``, in key order."""

    def delete(self, key: str, if_match: str | None = None) -> None:
        """Remove ``key``; deleting a missing key is not an error.  With ``if_match``
        only if the key exists with that ETag, else ``PreconditionFailed``."""


# --------------------------------------------------------------------------- local


class LocalStore:
    """A directory used as an object store.  Writes are atomic (temp file + rename);
    ``put_if_absent`` uses ``link(2)``, which fails if the target exists.  Conditional
    writes and deletes (``if_match``) compare and swap under an exclusive ``flock`` on
    ``.ckptfs-lock`` in the root, which every daemon on the machine takes for entry
    writes (chunk bodies are immutable and skip it).  Temp files live in ``.ckptfs-tmp/``
    at the root (same filesystem, so rename and link stay atomic); no key maps there or
    to the lock file, so every legal entry name is a possible key and listings never
    show the store's own files."""

    LOCK_NAME = ".ckptfs-lock"
    TMP_DIR = ".ckptfs-tmp"
    _RESERVED = (LOCK_NAME, TMP_DIR)

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    @contextmanager
    def _locked(self, key: str):
        if key.startswith("chunks/"):
            yield
            return
        fd = os.open(self.root / self.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _etag_now(self, path: Path) -> str | None:
        try:
            return _local_etag(path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or parts[0] in self._RESERVED:
            raise StoreError(f"invalid key {key!r}")
        return self.root / key

    def check(self) -> None:
        if not self.root.is_dir():
            raise StoreError(f"store directory {self.root} does not exist")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"store directory {self.root} is not writable")

    def _write_temp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = self.root / self.TMP_DIR
        tmp_dir.mkdir(exist_ok=True)
        tmp = tmp_dir / uuid.uuid4().hex
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            with self._locked(key):
                if if_match is not None and self._etag_now(path) != if_match:
                    raise PreconditionFailed(key)
                os.replace(tmp, path)
                return _local_etag(path)
        finally:
            tmp.unlink(missing_ok=True)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            with self._locked(key):
                os.link(tmp, path)
                return _local_etag(path)
        except FileExistsError:
            return None
        finally:
            tmp.unlink()

    def get(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                etag = _local_etag_fd(f.fileno())
                return f.read(), etag
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return os.pread(f.fileno(), end - start, start)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[ListedObject]:
        # Walk only the directory the prefix lives in when it ends with '/'.
        base_dir, _, _ = prefix.rpartition("/")
        start = self.root / base_dir if base_dir else self.root
        if not start.is_dir():
            return
        results: list[ListedObject] = []
        for dirpath, dirnames, filenames in os.walk(start):
            if dirpath == str(self.root):
                # The store's own files live at the root, where no key can point.
                dirnames[:] = [d for d in dirnames if d not in self._RESERVED]
                filenames = [n for n in filenames if n not in self._RESERVED]
            for name in filenames:
                full = Path(dirpath) / name
                key = str(full.relative_to(self.root))
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    results.append(ListedObject(key, st.st_size, _etag_of_stat(st),
                                                st.st_mtime))
        results.sort(key=lambda o: o.key)
        yield from results

    def delete(self, key: str, if_match: str | None = None) -> None:
        path = self._path(key)
        with self._locked(key):
            if if_match is not None and self._etag_now(path) != if_match:
                raise PreconditionFailed(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def _etag_of_stat(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _local_etag(path: Path) -> str:
    return _etag_of_stat(path.stat())


def _local_etag_fd(fd: int) -> str:
    return _etag_of_stat(os.fstat(fd))


# --------------------------------------------------------------------------- S3


def _prehashed_signer() -> str:
    """Name of a SigV4 signer that reuses a body's sha256 when the request already
    carries it (``x-amz-checksum-sha256``): every chunk is content-addressed by that
    digest, and over plain HTTP botocore would otherwise hash each 8 MiB body again.
    Registered once in botocore's table of signers, under our own name."""
    from botocore.auth import AUTH_TYPE_MAPS, S3SigV4Auth

    name = "s3v4-ckptfs-prehashed"
    if name not in AUTH_TYPE_MAPS:
        class PrehashedS3SigV4Auth(S3SigV4Auth):
            def payload(self, request):
                digest = request.headers.get("x-amz-checksum-sha256")
                if digest and not self._is_streaming_checksum_payload(request):
                    return base64.b64decode(digest).hex()
                return super().payload(request)

        AUTH_TYPE_MAPS[name] = PrehashedS3SigV4Auth
    return name


class S3Store:
    """An S3 bucket (and optional key prefix) through boto3."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None,
                 max_pool: int = 32, timeout: float = 30.0) -> None:
        """``timeout`` is the overall budget of one call (``store_timeout``): one
        attempt's socket timeouts are scaled so that no attempt alone outlives it."""
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        session = boto3.session.Session()
        # Retries are ours (RetryingStore); botocore's own are kept to a single try so
        # that back-off and accounting happen in one place.
        self.client = session.client(
            "s3", endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 1, "mode": "standard"},
                          max_pool_connections=max_pool,
                          connect_timeout=min(5.0, max(0.5, timeout / 4)),
                          read_timeout=min(30.0, max(0.5, timeout / 2)),
                          signature_version=_prehashed_signer(),
                          s3={"addressing_style": "path"},
                          # Chunks are verified end to end against their sha256; an extra
                          # CRC32 over every body in Python costs CPU the FUSE loop needs.
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"),
        )

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _translate(self, exc: Exception, key: str) -> StoreError:
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConn,
                                         NoCredentialsError)
        if isinstance(exc, NoCredentialsError):
            return StoreError("no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                              "AWS_SECRET_ACCESS_KEY or a profile)")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("PreconditionFailed", "412") or status == 412:
                return PreconditionFailed(key)
            if code in ("NoSuchKey", "404", "NotFound") and code != "NoSuchBucket":
                return NotFound(key)
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                        "403", "InvalidToken", "ExpiredToken"):
                return StoreError(f"access denied by the store ({code}): check credentials")
            if status >= 500 or status in (408, 429) or code in ("SlowDown", "Throttling",
                                                           "RequestTimeout",
                                                           "InternalError",
                                                           "ServiceUnavailable"):
                return TransientStoreError(f"{code or status} on {key}")
            return StoreError(f"{code or status}: {err.get('Message', '')} ({key})")
        if isinstance(exc, (BotoConn, BotoCoreError, OSError)):
            return TransientStoreError(f"{type(exc).__name__}: {exc}")
        return StoreError(f"{type(exc).__name__}: {exc}")

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - translated below
            err = self._translate(exc, "")
            if isinstance(err, NotFound):
                raise StoreError(f"bucket {self.bucket!r} does not exist") from None
            if isinstance(err, TransientStoreError):
                raise StoreError(f"store unreachable: {err}") from None
            raise err from None

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        extra = {}
        if sha256 is not None:
            extra["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
        if if_match is not None:
            extra["IfMatch"] = if_match
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, **extra)
            return r.get("ETag", "")
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        from botocore.exceptions import ClientError
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data,
                                       IfNoneMatch="*")
            return r.get("ETag") or '"?"'
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return None
            if code == "ConditionalRequestConflict" or status == 409:
                raise TransientStoreError(f"conditional write conflict on {key}") from None
            raise self._translate(exc, key) from None
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def get(self, key: str) -> tuple[bytes, str]:
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
            return r["Body"].read(), r.get("ETag", "")
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._k(key),
                                       Range=f"bytes={start}-{end - 1}")
            return r["Body"].read()
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except Exception as exc:  # noqa: BLE001
            err = self._translate(exc, key)
            if isinstance(err, NotFound):
                return False
            raise err from None

    def list(self, prefix: str) -> Iterator[ListedObject]:
        token: str | None = None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self._k(prefix)}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                r = self.client.list_objects_v2(**kwargs)
            except Exception as exc:  # noqa: BLE001
                raise self._translate(exc, prefix) from None
            for obj in r.get("Contents", []):
                modified = obj.get("LastModified")
                yield ListedObject(obj["Key"][len(self.prefix):], obj["Size"],
                                   obj.get("ETag", ""),
                                   modified.timestamp() if modified else 0.0)
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")

    def delete(self, key: str, if_match: str | None = None) -> None:
        extra = {"IfMatch": if_match} if if_match is not None else {}
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key), **extra)
        except Exception as exc:  # noqa: BLE001
            err = self._translate(exc, key)
            if isinstance(err, NotFound) and if_match is not None:
                raise PreconditionFailed(key) from None
            if not isinstance(err, NotFound):
                raise err from None


# --------------------------------------------------------------------------- wrappers


@dataclass
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0
    timeout: float = 60.0      # overall deadline of one call, all attempts together


class _Attempt:
    """One try of a store call, run in an ``_AttemptRunner`` thread."""

    __slots__ = ("fn", "event", "finished", "result", "error")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.event = threading.Event()   # set when finished, or to wake the waiter
        self.finished = False
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            self.error = exc
        finally:
            self.finished = True
            self.event.set()


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
    """Retries transient failures with exponential backoff and full jitter, within an
    overall deadline per call (``policy.timeout``): no attempt outlives it and no new
    attempt or sleep starts past it; then ``StoreTimeout`` names the operation and the
    key.  Permanent failures are never retried.  ``close()`` makes every call in flight
    return at once with ``StoreClosed`` (the daemon is stopping)."""

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 stats: "StoreStats | None" = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()
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
        exc = StoreTimeout(f"store timeout: {target} after {self.policy.timeout:g} s{why}")
        log.error("%s", exc)
        if self.stats:
            self.stats.error("timeout")
        return exc

    def _attempt(self, fn, deadline: float):
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
        if attempt.error is not None:
            raise attempt.error
        return attempt.result

    def _call(self, what: str, key: str, fn):
        deadline = time.monotonic() + self.policy.timeout
        attempt = 0
        last: BaseException | None = None
        while True:
            if self._closed.is_set():
                raise StoreClosed(f"store closed: {what} {key} given up (unmounting)")
            if time.monotonic() >= deadline:
                raise self._timeout(what, key, last)
            try:
                result = self._attempt(fn, deadline)
            except TransientStoreError as exc:
                last = exc
                attempt += 1
                if self.stats:
                    self.stats.error("transient")
                if attempt >= self.policy.attempts:
                    log.error("store %s %s failed after %d attempts: %s", what, key, attempt,
                              exc)
                    raise
                delay = random.uniform(0, min(self.policy.max_delay,
                                              self.policy.base_delay * 2 ** attempt))
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

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        return self._call("put", key, lambda: self.inner.put(key, data, sha256,
                                                             if_match=if_match))

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return self._call("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    def get(self, key: str) -> tuple[bytes, str]:
        return self._call("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call("get_range", key, lambda: self.inner.get_range(key, start, end))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def list(self, prefix: str) -> Iterator[ListedObject]:
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix))))

    def delete(self, key: str, if_match: str | None = None) -> None:
        self._call("delete", key, lambda: self.inner.delete(key, if_match))


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors += 1
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: dict(v) if isinstance(v, dict) else v
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

    def get_range(self, key: str, start: int, end: int) -> bytes:
        body = self.inner.get_range(key, start, end)
        self._count_get(key, len(body))
        return body

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


# --------------------------------------------------------------------------- URLs


class BadStoreURL(ValueError):
    pass


def open_store(url: str, endpoint_url: str | None = None, timeout: float = 60.0) -> ObjectStore:
    """Build the raw store a URL names (no retries, no counting); ``timeout`` is the
    overall budget of one call (an S3 client scales its socket timeouts to it)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise BadStoreURL(f"bad store URL {url!r}: use file:///absolute/path")
        if not parsed.path.startswith("/"):
            raise BadStoreURL(f"bad store URL {url!r}: the path must be absolute")
        return LocalStore(Path(urllib.parse.unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise BadStoreURL(f"bad store URL {url!r}: use s3://bucket/prefix")
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or \
            os.environ.get("AWS_ENDPOINT_URL")
        return S3Store(parsed.netloc, parsed.path, endpoint, timeout=timeout)
    raise BadStoreURL(f"bad store URL {url!r}: expected file:///path or s3://bucket/prefix")
