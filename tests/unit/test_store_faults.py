"""The fault-injecting store wrapper (ckptfs/store/faults.py): the kinds of outage the
model-based test puts a local store into -- a 403 and a store that never answers -- and
the control file that ends them while a daemon runs."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ckptfs.store import AccessDenied, MemoryStore, NotFound, TransientStoreError
from ckptfs.store.faults import FaultInjectingStore, FaultPlan


def _store(tmp_path, rules: list[dict]) -> tuple[FaultInjectingStore, object]:
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": rules}))
    plan = FaultPlan.from_json(json.dumps({"rules": [], "control_file": str(control)}))
    inner = MemoryStore()
    inner.put("k", b"v")
    return FaultInjectingStore(inner, plan), control


def test_a_denied_rule_raises_access_denied(tmp_path):
    store, _ = _store(tmp_path, [{"kind": "denied"}])
    with pytest.raises(AccessDenied):
        store.get("k")


def test_a_hang_rule_blocks_until_the_control_file_drops_it(tmp_path):
    store, control = _store(tmp_path, [{"kind": "hang"}])
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(store.get("k"))
        except TransientStoreError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive() and not outcome, outcome     # still hanging
    time.sleep(0.02)                                        # a new mtime
    control.write_text(json.dumps({"rules": []}))
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome[0], TransientStoreError), outcome
    assert store.get("k")[0] == b"v"                       # the next call goes through


def test_a_torn_rule_leaves_an_empty_object_and_fails_like_a_dropped_connection(tmp_path):
    store, _ = _store(tmp_path, [{"op": "put_if_absent", "kind": "torn", "times": 1},
                                 {"op": "put", "kind": "torn", "times": 1}])
    with pytest.raises(TransientStoreError):
        store.put_if_absent("new", b"entry")
    assert store.get("new")[0] == b""
    assert store.put_if_absent("new", b"entry") is None      # the key is taken now
    with pytest.raises(TransientStoreError):
        store.put("k", b"w")
    assert store.get("k")[0] == b""


def test_a_lost_reply_rule_acts_then_fails_and_reads_fail_before_acting(tmp_path):
    store, _ = _store(tmp_path, [{"kind": "lost_reply", "times": 4}])
    with pytest.raises(TransientStoreError):
        store.put("k", b"w")
    with pytest.raises(TransientStoreError):
        store.put_if_absent("new", b"n")
    with pytest.raises(TransientStoreError):
        store.get("k")                                     # a read fails before acting
    with pytest.raises(TransientStoreError):
        store.delete("new")
    assert store.get("k")[0] == b"w"                       # the writes landed
    with pytest.raises(NotFound):
        store.get("new")                                   # and so did the delete
