"""Peer membership judged by the observer's clock, rendezvous owners, signed requests
(cluster/peer_members.py, cluster/peer_auth.py), over the in-memory store."""

from __future__ import annotations

from ckptfs.cluster import peer_auth
from ckptfs.cluster.peer_members import REST, Membership, peer_key
from ckptfs.store import ListedObject
from ckptfs.store.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def listed(*pairs: tuple[str, str]) -> list[ListedObject]:
    return [ListedObject(key, 1, etag) for key, etag in pairs]


def test_a_peer_is_dead_when_its_key_stops_changing_by_the_observer_s_clock():
    clock = Clock()
    me = Membership(MemoryStore(), "me", "b0", "h:1", ttl=3.0, clock=clock)
    other = peer_key("other", "b1", "h:2")
    me.apply(listed((other, "e1")))
    assert [p.node for p in me.live()] == ["other"]
    clock.now += 5.9                         # unchanged, but within 2 x ttl
    me.apply(listed((other, "e1")))
    assert [p.node for p in me.live()] == ["other"]
    clock.now += 0.2
    me.apply(listed((other, "e1")))
    assert me.live() == []                   # 6.1 s unchanged: dead
    me.apply(listed((other, "e2")))          # renewed: alive again
    assert [p.node for p in me.live()] == ["other"]
    clock.now += 31
    assert me.apply(listed((other, "e2"))) == [(other, "e2")]    # long dead: forgotten


def test_this_node_s_earlier_boots_are_its_own_to_delete_and_the_secret_is_no_peer():
    me = Membership(MemoryStore(), "me", "b0", "h:1", ttl=3.0, clock=Clock())
    old = peer_key("me", "bOLD", "h:1")
    assert me.apply(listed((old, "x"), (me.key, "y"), (peer_auth.SECRET_KEY, "z"))) == \
        [(old, "x")]
    assert me.peers == {}


def test_rendezvous_moves_only_the_dead_node_s_share():
    clock = Clock()
    views = {}
    for name in ("a", "b", "c", "d"):
        m = Membership(MemoryStore(), name, "b", f"{name}:1", ttl=3.0, clock=clock)
        m.apply(listed(*((peer_key(o, "b", f"{o}:1"), "e") for o in "abcd" if o != name)))
        views[name] = m
    chunks = [f"{i:064x}" for i in range(400)]

    def owner(view, chunk):
        peer = view.owner(chunk)
        return view.node if peer is None else peer.node
    # Every node agrees on each chunk's owner, and the owners share the work.
    before = {c: owner(views["a"], c) for c in chunks}
    assert all(owner(v, c) == before[c] for v in views.values() for c in chunks)
    assert all(60 < list(before.values()).count(n) < 140 for n in "abcd")
    # d fails: a rests it; only d's chunks move.
    d = next(p for p in views["a"].peers.values() if p.node == "d")
    views["a"].rest(d)
    after = {c: owner(views["a"], c) for c in chunks}
    assert {c for c in chunks if after[c] != before[c]} == \
        {c for c in chunks if before[c] == "d"}
    clock.now += REST + 0.1                  # rested long enough: d is asked again
    views["a"].apply(listed(*((peer_key(o, "b", f"{o}:1"), "e2") for o in "bcd")))
    assert {c: owner(views["a"], c) for c in chunks} == before


def test_alone_a_node_owns_everything_and_asks_nobody():
    me = Membership(MemoryStore(), "me", "b0", "h:1", ttl=3.0, clock=Clock())
    me.apply([])
    assert me.owner("ab" * 32) is None


def test_a_signature_holds_for_its_request_within_the_window_only():
    secret = b"s" * 64
    sig = peer_auth.sign(secret, "GET", "c" * 64, 10, "1000.000", "n1")
    ok = dict(method="GET", chunk="c" * 64, length=10, when="1000.000", node="n1",
              signature=sig)
    assert peer_auth.check(secret, now=1100.0, **ok) is None
    assert peer_auth.check(secret, now=1000.0 + peer_auth.WINDOW + 1, **ok) is not None
    for change in (dict(chunk="d" * 64), dict(length=11), dict(node="n2"),
                   dict(when="1000.001"), dict(signature="0" * 64)):
        assert peer_auth.check(secret, now=1000.0, **{**ok, **change}) is not None
    assert peer_auth.check(b"t" * 64, now=1000.0, **ok) is not None


def test_the_secret_is_made_once_and_shared():
    store = MemoryStore()
    assert peer_auth.load_secret(store) == peer_auth.load_secret(store)
