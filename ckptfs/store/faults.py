"""A fault-injecting ``ObjectStore`` wrapper (mountpoint-s3's failure-injecting client).

Tests start a daemon with ``CKPTFS_FAULTS`` set to a JSON plan; the wrapper sits under
the retry layer, so injected transient errors exercise the real back-off.  A plan may be
changed while the daemon runs by rewriting the file named in ``"control_file"``.
Knows nothing above the store protocol.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .base import AccessDenied, ListedObject, ObjectStore, StoreError, TransientStoreError

log = logging.getLogger(__name__)


@dataclass
class FaultRule:
    op: str = "*"                  # check, put, put_if_absent, get, exists, list, delete
    prefix: str = ""               # only keys starting with this
    # transient | permanent | denied (AccessDenied, a 403) | hang (the call blocks
    # while this rule stays in the plan, up to ``delay`` or 600 s, then fails as a
    # transient error) | corrupt | no_conditional | delay | torn (a put or put_if_absent
    # leaves an EMPTY object at the key, as SeaweedFS did for a PUT whose writer was
    # SIGKILLed, then fails as a dropped connection) | lost_reply (a put, put_if_absent or
    # delete acts, then fails as a connection reset before its answer; other calls fail
    # before acting)
    kind: str = "transient"
    times: int = -1                # how many times to fire; -1 = always
    delay: float = 0.0             # seconds to sleep before the call


@dataclass
class FaultPlan:
    rules: list[FaultRule] = field(default_factory=list)
    control_file: str | None = None

    @classmethod
    def from_json(cls, text: str) -> "FaultPlan":
        doc = json.loads(text)
        return cls(rules=[FaultRule(**r) for r in doc.get("rules", [])],
                   control_file=doc.get("control_file"))


class FaultInjectingStore:
    def __init__(self, inner: ObjectStore, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.url = inner.url
        self._lock = threading.Lock()
        self._control_mtime = 0.0

    def _reload(self) -> None:
        if not self.plan.control_file:
            return
        path = Path(self.plan.control_file)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime != self._control_mtime:
            self._control_mtime = mtime
            self.plan.rules = FaultPlan.from_json(path.read_text()).rules

    def _rule(self, op: str, key: str) -> FaultRule | None:
        with self._lock:
            self._reload()
            for rule in self.plan.rules:
                if rule.op in ("*", op) and key.startswith(rule.prefix) and rule.times != 0:
                    if rule.times > 0:
                        rule.times -= 1
                    return rule
        return None

    def _before(self, op: str, key: str) -> FaultRule | None:
        rule = self._rule(op, key)
        if rule is None:
            return None
        if rule.kind == "hang":
            self._hang(rule, op, key)
        elif rule.delay:
            time.sleep(rule.delay)
        if rule.kind == "denied":
            raise AccessDenied(f"injected access denied on {op} {key}")
        if rule.kind == "transient" or (rule.kind == "lost_reply"
                                        and op not in ("put", "put_if_absent", "delete")):
            raise TransientStoreError(f"injected transient fault on {op} {key}")
        if rule.kind == "permanent":
            raise StoreError(f"injected fault on {op} {key}")
        return rule

    def _hang(self, rule: FaultRule, op: str, key: str) -> None:
        """Block like a store that never answers, until ``rule`` leaves the plan (the
        control file changed) or its bound passes; then fail as a dropped connection."""
        until = time.monotonic() + (rule.delay or 600.0)
        while time.monotonic() < until:
            with self._lock:
                self._reload()
                if not any(r is rule for r in self.plan.rules):
                    break
            time.sleep(0.05)
        raise TransientStoreError(f"injected hang on {op} {key} ended")

    def check(self) -> None:
        self._before("check", "")
        self.inner.check()

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        rule = self._before("put", key)
        if rule is not None and rule.kind == "no_conditional":
            if_match = None
        if rule is not None and rule.kind == "torn":
            self.inner.put(key, b"", if_match=if_match)
            raise TransientStoreError(f"injected torn put of {key}")
        etag = self.inner.put(key, data, sha256, if_match=if_match)
        self._lose_reply(rule, "put", key)
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        rule = self._before("put_if_absent", key)
        if rule is not None and rule.kind == "no_conditional":
            return self.inner.put(key, data)
        if rule is not None and rule.kind == "torn":
            self.inner.put_if_absent(key, b"")
            raise TransientStoreError(f"injected torn put of {key}")
        done = self.inner.put_if_absent(key, data)
        self._lose_reply(rule, "put_if_absent", key)
        return done

    def get(self, key: str) -> tuple[bytes, str]:
        rule = self._before("get", key)
        body, etag = self.inner.get(key)
        if rule is not None and rule.kind == "corrupt" and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        return body, etag

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        rule = self._before("get", key)
        n, etag = self.inner.get_into(key, buffer)
        if rule is not None and rule.kind == "corrupt" and 0 < n <= len(buffer):
            with memoryview(buffer) as view:
                view[0] ^= 0xFF
        return n, etag

    def exists(self, key: str) -> bool:
        self._before("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[ListedObject]:
        self._before("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str, if_match: str | None = None) -> None:
        rule = self._before("delete", key)
        if rule is not None and rule.kind == "no_conditional":
            if_match = None
        self.inner.delete(key, if_match)
        self._lose_reply(rule, "delete", key)

    @staticmethod
    def _lose_reply(rule: FaultRule | None, op: str, key: str) -> None:
        if rule is not None and rule.kind == "lost_reply":
            raise TransientStoreError(f"injected: the answer to {op} {key} was lost")
