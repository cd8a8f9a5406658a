"""Whom a node asks for a chunk (cluster/peer_route.py): owner, relays, the next peer."""

from __future__ import annotations

import math
from collections import Counter

from ckptfs.cluster.peer_route import ranking, relay_count, route

NODES = [f"n{i}" for i in range(9)]
CHUNKS = [f"{i:064x}" for i in range(200)]


def routes(nodes, chunk, fanout, rested=frozenset()):
    return {me: route(chunk, me, [n for n in nodes if n != me], set(rested), fanout)
            for me in nodes}


def test_relays_only_above_the_fanout_and_about_sqrt_of_the_askers():
    assert [relay_count(n, 8) for n in (1, 2, 8, 9)] == [0, 0, 0, 0]
    assert relay_count(10, 8) == 3
    assert relay_count(4, 2) == 2
    assert relay_count(1001, 8) == math.ceil(math.sqrt(1000)) == 32


def test_up_to_the_fanout_everyone_asks_the_owner_then_the_next_ranked():
    for chunk in CHUNKS[:20]:
        ranked = ranking(chunk, NODES)
        r = routes(NODES, chunk, fanout=8)
        assert r[ranked[0]].role == "owner" and r[ranked[0]].asks == ()
        assert r[ranked[1]].asks == ((ranked[0], False),)
        for me in ranked[2:]:
            assert r[me].asks == ((ranked[0], False), (ranked[1], False))


def test_above_it_relays_ask_the_owner_and_leaves_ask_one_relay_then_the_owner():
    load: Counter = Counter()
    for chunk in CHUNKS:
        ranked = ranking(chunk, NODES)
        relays = ranked[1:4]                       # 8 askers > fanout 2: ceil(sqrt 8) = 3
        r = routes(NODES, chunk, fanout=2)
        assert r[ranked[0]].role == "owner" and r[ranked[0]].asks == ()
        for me in relays:
            assert r[me].role == "relay"
            assert r[me].asks[0] == (ranked[0], False)          # never via a relay
            assert all(not relay for _, relay in r[me].asks)
        for me in ranked[4:]:
            assert r[me].role == "leaf"
            (first, relay), second = r[me].asks
            assert first in relays and relay
            assert second == (ranked[0], False)
            load[relays.index(first)] += 1
    # Leaves spread over the relays: each relay rank serves about a third of the asks.
    assert sum(load.values()) == 5 * len(CHUNKS)
    assert all(n > 0.25 * 5 * len(CHUNKS) for n in load.values()), load


def test_a_rested_peer_is_skipped_and_at_most_one_more_peer_is_asked():
    for chunk in CHUNKS[:50]:
        ranked = ranking(chunk, NODES)
        owner = ranked[0]
        r = routes(NODES, chunk, fanout=2, rested={owner})
        # Roles do not move (every node computes the same ones) ...
        assert r[owner].role == "owner"
        for me in ranked[1:]:
            asks = r[me].asks
            assert owner not in [n for n, _ in asks]
            assert len(asks) <= 2
        # ... and the next-ranked node is where the owner's askers go: the store once.
        assert r[ranked[1]].asks == ()
        assert r[ranked[2]].asks == ((ranked[1], False),)
        # A leaf whose relay is rested asks the owner, then the next-ranked.
        leaf = ranked[5]
        relay = r[leaf].asks[0][0] if r[leaf].asks[0][1] else None
        if relay is not None:
            again = route(chunk, leaf, [n for n in NODES if n != leaf], {relay}, 2)
            assert again.asks[0] == (owner, False)
            assert relay not in [n for n, _ in again.asks]
