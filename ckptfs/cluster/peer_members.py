"""Which nodes of this store serve chunks, and which of them owns a chunk.

Membership lives in the store, with no coordinator: each serving node keeps one object
``peers/<node id>_<boot id>_<address>`` (the address URL-quoted), rewritten every
``ttl / 3`` with a new sequence number so its ETag changes.  One LIST of ``peers/`` per
refresh tells everything: who (from the key) and whether it is alive (from the ETag).
As with the seal leases (leases_common.py), a peer is judged by the observer's own
monotonic clock, never by a remote one: a key whose ETag has not changed for
``DEAD_FACTOR × ttl`` since this node saw it change is dead; one dead ten times that
long is deleted (conditionally on its ETag) by whoever notices.  A node's keys of
earlier boots are its own to delete.

Placement is rendezvous hashing over the live peers and this node: each chunk's owner is
the member with the highest hash of (node id, chunk id), so a member's death moves only
its share; above ``fanout`` askers the next-ranked members relay it (peer_route.py).  A
peer that failed or lied is *rested* for ``REST`` seconds: it is not asked meanwhile
(the next member in the chunk's ranking is).

Knows the store's keys and listing; nothing of sockets, the cache or signatures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote

from ..store import ListedObject, ObjectStore
from .leases_common import DEAD_FACTOR
from .peer_route import Route, route, score

__all__ = ["Membership", "Peer", "peer_key", "parse_key", "score", "REST"]

PEER_ROOT = "peers/"
FORGET_FACTOR = 10.0        # dead this many ttl: its key is deleted
REST = 30.0                 # seconds a failing or lying peer is skipped


@dataclass
class Peer:
    node: str
    boot: str
    address: str
    key: str
    etag: str
    changed_at: float            # observer's monotonic clock: when its ETag last changed
    rested_until: float = 0.0    # monotonic


def peer_key(node: str, boot: str, address: str) -> str:
    return f"{PEER_ROOT}{node}_{boot}_{quote(address, safe='')}"


def parse_key(key: str) -> tuple[str, str, str] | None:
    """(node, boot, address) of a member key; None for anything else (the secret)."""
    name = key[len(PEER_ROOT):]
    parts = name.split("_", 2)
    if not key.startswith(PEER_ROOT) or len(parts) != 3 or not all(parts):
        return None
    return parts[0], parts[1], unquote(parts[2])


class Membership:
    """This node's member key and its view of the others."""

    def __init__(self, store: ObjectStore, node: str, boot: str, address: str, ttl: float,
                 clock: Callable[[], float] = time.monotonic, fanout: int = 8) -> None:
        self.store = store
        self.node = node
        self.boot = boot
        self.address = address
        self.ttl = ttl
        self.clock = clock
        self.fanout = fanout
        self.key = peer_key(node, boot, address)
        self.seq = 0
        self.peers: dict[str, Peer] = {}         # key -> peer (not this node)
        self.lists = self.puts = 0

    # -- blocking store calls (worker threads)
    def renew(self) -> None:
        self.seq += 1
        body = json.dumps({"node": self.node, "boot": self.boot, "address": self.address,
                           "seq": self.seq, "wall": time.time()}).encode()
        self.store.put(self.key, body)
        self.puts += 1

    def leave(self) -> None:
        self.store.delete(self.key)

    def listing(self) -> list[ListedObject]:
        self.lists += 1
        return list(self.store.list(PEER_ROOT))

    def forget(self, keys: list[tuple[str, str]]) -> None:
        """Delete keys judged long dead (or this node's earlier boots), if unchanged."""
        for key, etag in keys:
            try:
                self.store.delete(key, if_match=etag)
            except Exception:       # changed meanwhile, or gone: its owner's business
                pass

    # -- on the trio thread
    def apply(self, listing: list[ListedObject]) -> list[tuple[str, str]]:
        """Take a LIST of ``peers/`` in; returns the keys to ``forget``."""
        now = self.clock()
        seen: dict[str, Peer] = {}
        doomed = []
        for obj in listing:
            parsed = parse_key(obj.key)
            if parsed is None or obj.key == self.key:
                continue
            node, boot, address = parsed
            if node == self.node:
                doomed.append((obj.key, obj.etag))     # this node, an earlier boot
                continue
            old = self.peers.get(obj.key)
            if old is None:
                seen[obj.key] = Peer(node, boot, address, obj.key, obj.etag, now)
                continue
            if old.etag != obj.etag:
                old.etag, old.changed_at = obj.etag, now
            elif now - old.changed_at > FORGET_FACTOR * self.ttl:
                doomed.append((obj.key, obj.etag))
            seen[obj.key] = old
        self.peers = seen
        return doomed

    def alive(self, peer: Peer) -> bool:
        return self.clock() - peer.changed_at <= DEAD_FACTOR * self.ttl

    def live(self) -> list[Peer]:
        """The other members alive now (rested ones too)."""
        live = [p for p in self.peers.values() if self.alive(p)]
        # Two boots of one node alive at once (a restart before the old key died): the
        # newest-changed one counts.
        newest: dict[str, Peer] = {}
        for p in live:
            if p.node not in newest or p.changed_at > newest[p.node].changed_at:
                newest[p.node] = p
        return list(newest.values())

    def owner(self, chunk: str) -> Peer | None:
        """The peer to ask for ``chunk``: its owner by rendezvous hashing among the live
        members and this node, skipping rested peers; None when this node owns it (or
        is alone): then the store."""
        now = self.clock()
        ranked = sorted(((score(p.node, chunk), p.node, p) for p in self.live()
                         if p.rested_until <= now), reverse=True, key=lambda t: t[:2])
        mine = score(self.node, chunk)
        if not ranked or (mine, self.node) > ranked[0][:2]:
            return None
        return ranked[0][2]

    def route(self, chunk: str) -> tuple[Route, dict[str, Peer]]:
        """This node's role for ``chunk``, whom to ask in order (peer_route.py), and the
        live peers by node id."""
        now = self.clock()
        live = {p.node: p for p in self.live()}
        rested = {n for n, p in live.items() if p.rested_until > now}
        return route(chunk, self.node, list(live), rested, self.fanout), live

    def rest(self, peer: Peer) -> None:
        peer.rested_until = self.clock() + REST

    def report(self) -> list[dict]:
        now = self.clock()
        return [{"node": p.node, "address": p.address,
                 "alive": self.alive(p),
                 "unchanged_s": round(now - p.changed_at, 1),
                 "rested_s": round(max(0.0, p.rested_until - now), 1)}
                for p in sorted(self.peers.values(), key=lambda p: p.node)]
