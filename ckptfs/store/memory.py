"""``MemoryStore``: an in-memory ``ObjectStore`` for unit tests of the layers above.

It keeps the protocol's promises (a new ETag per write, ``If-None-Match``/``If-Match``
conditions on PUT and DELETE, listings in key order) and lets a test see and steer each
call: every call is recorded (``calls``); hooks run before and after it (``before``,
``after``: a before hook may raise to fail the call, which then changes nothing);
``fail`` injects a number of failures; a ``gate`` holds one call before or after it
acts until the test releases it, so a race test enters its window by an event, never by
a sleep.  Calls arrive from worker threads (``trio.to_thread``), so everything here is
thread-safe and blocking; a trio test waits with ``trio.to_thread.run_sync(gate.wait_reached)``.

Unit tests only: integration tests use ``LocalStore`` and the real S3 server.  Knows
nothing above the store protocol.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .base import ListedObject, NotFound, PreconditionFailed, StoreError, copy_into

OPS = ("check", "put", "put_if_absent", "get", "exists", "list", "delete")


@dataclass
class Call:
    """One call into the store: what was asked, and (after it) how it ended."""

    op: str
    key: str
    data: bytes | None = None
    if_match: str | None = None
    result: object = None
    error: BaseException | None = None


Hook = Callable[[Call], None]


@dataclass
class _Hooked:
    fn: Hook
    op: str
    prefix: str
    when: str                       # before | after
    times: int                      # -1: always
    owner: "MemoryStore"

    def matches(self, call: Call, when: str) -> bool:
        return (self.when == when and self.times != 0 and self.op in ("*", call.op)
                and call.key.startswith(self.prefix))

    def remove(self) -> None:
        self.owner._remove(self)


@dataclass
class Gate:
    """Holds the first matching call until ``release``: ``wait_reached`` returns True once
    a call is held (``calls`` names it).  A gate holds ``times`` calls, then lets every
    call through."""

    limit: float
    calls: list[Call] = field(default_factory=list)
    _reached: threading.Event = field(default_factory=threading.Event)
    _opened: threading.Event = field(default_factory=threading.Event)

    def wait_reached(self, timeout: float) -> bool:
        return self._reached.wait(timeout)

    def release(self) -> None:
        self._opened.set()

    def _hold(self, call: Call) -> None:
        self.calls.append(call)
        self._reached.set()
        if not self._opened.wait(self.limit):
            raise StoreError(f"gate on {call.op} {call.key} was never released")


@dataclass
class _Object:
    body: bytes
    etag: str
    mtime: float


class MemoryStore:
    """A dict of objects behind one lock.  ``gate_limit`` bounds how long a gate holds a
    call that nobody releases (the call then fails instead of hanging the test)."""

    def __init__(self, url: str = "mem://", gate_limit: float = 60.0) -> None:
        self.url = url
        self.gate_limit = gate_limit
        self.calls: list[Call] = []
        self._objects: dict[str, _Object] = {}
        self._hooks: list[_Hooked] = []
        self._lock = threading.Lock()
        self._seq = 0

    # ------------------------------------------------------------------ steering

    def before(self, fn: Hook, op: str = "*", prefix: str = "", times: int = -1) -> _Hooked:
        """Run ``fn(call)`` before each matching call acts; raising fails the call."""
        return self._add(fn, op, prefix, "before", times)

    def after(self, fn: Hook, op: str = "*", prefix: str = "", times: int = -1) -> _Hooked:
        """Run ``fn(call)`` after each matching call, with ``result`` or ``error`` set."""
        return self._add(fn, op, prefix, "after", times)

    def fail(self, op: str, error: BaseException, prefix: str = "", times: int = 1) -> _Hooked:
        """The next ``times`` matching calls raise ``error`` without acting."""
        def raise_it(call: Call) -> None:
            raise error
        return self.before(raise_it, op, prefix, times)

    def gate(self, op: str, prefix: str = "", when: str = "before", times: int = 1) -> Gate:
        """Hold the next ``times`` matching calls (before they act, or after they acted
        and before they return) until ``Gate.release``."""
        gate = Gate(limit=self.gate_limit)
        self._add(gate._hold, op, prefix, when, times)
        return gate

    def _add(self, fn: Hook, op: str, prefix: str, when: str, times: int) -> _Hooked:
        if op != "*" and op not in OPS:
            raise ValueError(f"unknown store operation {op!r}")
        hooked = _Hooked(fn, op, prefix, when, times, self)
        with self._lock:
            self._hooks.append(hooked)
        return hooked

    def _remove(self, hooked: _Hooked) -> None:
        with self._lock:
            if hooked in self._hooks:
                self._hooks.remove(hooked)

    def _run_hooks(self, call: Call, when: str) -> None:
        with self._lock:
            due = [h for h in self._hooks if h.matches(call, when)]
            for h in due:
                if h.times > 0:
                    h.times -= 1
        for h in due:           # outside the lock: a hook may block or call the store
            h.fn(call)

    def _do(self, call: Call, act: Callable[[], object]):
        with self._lock:
            self.calls.append(call)
        try:
            self._run_hooks(call, "before")
            with self._lock:
                call.result = act()
        except BaseException as exc:
            call.error = exc
            self._run_hooks(call, "after")
            raise
        self._run_hooks(call, "after")
        return call.result

    def _etag(self) -> str:
        self._seq += 1
        return f'"m{self._seq}"'

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    # ------------------------------------------------------------------ the protocol

    def check(self) -> None:
        self._do(Call("check", ""), lambda: None)

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        def act() -> str:
            if if_match is not None and self._etag_of(key) != if_match:
                raise PreconditionFailed(key)
            etag = self._etag()
            self._objects[key] = _Object(bytes(data), etag, time.time())
            return etag
        return self._do(Call("put", key, data=bytes(data), if_match=if_match), act)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        def act() -> str | None:
            if key in self._objects:
                return None
            etag = self._etag()
            self._objects[key] = _Object(bytes(data), etag, time.time())
            return etag
        return self._do(Call("put_if_absent", key, data=bytes(data)), act)

    def get(self, key: str) -> tuple[bytes, str]:
        def act() -> tuple[bytes, str]:
            obj = self._objects.get(key)
            if obj is None:
                raise NotFound(key)
            return obj.body, obj.etag
        return self._do(Call("get", key), act)

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        return copy_into(self.get(key), buffer)

    def exists(self, key: str) -> bool:
        return self._do(Call("exists", key), lambda: key in self._objects)

    def list(self, prefix: str) -> Iterator[ListedObject]:
        def act() -> list[ListedObject]:
            return [ListedObject(k, len(o.body), o.etag, o.mtime)
                    for k, o in sorted(self._objects.items()) if k.startswith(prefix)]
        return iter(self._do(Call("list", prefix), act))

    def delete(self, key: str, if_match: str | None = None) -> None:
        def act() -> None:
            if if_match is not None and self._etag_of(key) != if_match:
                raise PreconditionFailed(key)
            self._objects.pop(key, None)
        self._do(Call("delete", key, if_match=if_match), act)

    def _etag_of(self, key: str) -> str | None:
        obj = self._objects.get(key)
        return obj.etag if obj is not None else None
