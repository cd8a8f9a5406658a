"""Whom a node asks for a chunk: the owner, a relay (the second hop), the next peer.

Pure functions over node ids, no I/O.  The ranking of chunk c is the live members and
this node by rendezvous score, highest first (peer_members.score): rank 0 owns c and
fetches it from the store.  With more askers than ``fanout`` (N − 1 > fanout, N the
nodes ranked), ranks 1..k are c's *relays*, k = ceil(sqrt(N − 1)): a relay asks the
owner; every other node (a *leaf*) asks one relay, chosen by hashing its own id with c,
and says so (``relay=True``: "you may fetch it from your owner"); an ask without it is
served from the server's cache or the store only, so no chain is longer than two hops.
With N − 1 ≤ fanout every node asks the owner, as before relays existed.

After the first choice comes at most one more peer — the next-ranked live, unrested peer
above this node — and then the store: when a peer fails, its askers mostly agree on the
next one, so the cluster pays about one store fetch for it, not one per asker.  Rested
peers (failed or lied lately) are never asked, but still count in the ranking (so every
node computes the same roles).

Knows node ids and hashes; nothing of sockets, the store or the cache.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

Role = Literal["owner", "relay", "leaf"]


def score(node: str, chunk: str) -> int:
    digest = hashlib.blake2b(f"{node}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranking(chunk: str, nodes: list[str]) -> list[str]:
    """``nodes`` (ids, unique) best first for ``chunk``."""
    return sorted(nodes, key=lambda n: (score(n, chunk), n), reverse=True)


def relay_count(nodes: int, fanout: int) -> int:
    """How many relays a chunk has among ``nodes`` nodes (0: everyone asks the owner)."""
    askers = nodes - 1
    if askers <= fanout:
        return 0
    return min(askers, math.isqrt(askers - 1) + 1)          # ceil(sqrt(askers))


@dataclass(frozen=True)
class Route:
    role: Role
    asks: tuple[tuple[str, bool], ...]       # (node, may relay), in order; then the store


def route(chunk: str, me: str, others: list[str], rested: set[str],
          fanout: int) -> Route:
    """This node's role for ``chunk`` and whom it asks (at most two peers)."""
    ranked = ranking(chunk, [me, *others])
    k = relay_count(len(ranked), fanout)
    i = ranked.index(me)
    role: Role = "owner" if i == 0 else "relay" if i <= k else "leaf"
    asks: list[tuple[str, bool]] = []
    if role == "leaf" and k:
        relay = ranked[1 + score(f"{me}\0relay", chunk) % k]
        if relay not in rested:
            asks.append((relay, True))
    for node in ranked[:i]:
        if len(asks) == 2:
            break
        if node not in rested and all(node != a for a, _ in asks):
            asks.append((node, False))
    return Route(role, tuple(asks))
