"""Fetching a chunk from the peers (the cache's ``ChunkSource``).

Asks whom peer_route.py names for the chunk — its owner, or with many nodes one of its
relays (the second hop) — signed (peer_auth.py), within ``timeout`` seconds for the whole
answer (twice that from a relay, which may itself wait on the owner), straight into the
cache's buffer; the bytes count only if the cache's own check passes (run in a worker
thread).  Anything else — a refused connection, a timeout, a broken answer, wrong bytes,
a 503 — and it asks the next peer of the route (at most one more), then returns False
and the cache goes to the store: a bad peer costs each asker at most one more fetch per
chunk, and mostly a peer's, not the store's.  No peer to ask (this node owns the chunk,
or is alone): False at once.  A peer that failed or lied is rested (not asked
meanwhile) and named in one WARNING; a peer that honestly could not get the chunk (503)
is not.

Knows the wire, the signatures and membership; nothing of the cache's files.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from . import peer_auth
from .peer_members import REST, Membership, Peer
from .peer_wire import RELAY_HEADER, RELAY_METHOD, WireError, parse_head, read_head, request_line

log = logging.getLogger(__name__)


@dataclass
class FetchStats:
    chunks: int = 0          # chunks a peer gave, checked good
    bytes: int = 0
    errors: int = 0          # no answer in time, connection failed, protocol broken
    wrong: int = 0           # bytes that failed the check (a lying or rotten peer)
    misses: int = 0          # the peer could not get the chunk (503/404)
    via_relay: int = 0       # of ``chunks``: from a relay (the second hop), not the owner
    second_tries: int = 0    # of ``chunks``: from the next peer after the first failed


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class PeerSource:
    def __init__(self, members: Membership, secret: bytes, node: str, timeout: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.members = members
        self.secret = secret
        self.node = node
        self.timeout = timeout
        self.clock = clock
        self.stats = FetchStats()

    async def fetch(self, sha: str, length: int, buf: mmap.mmap,
                    check: Callable[[memoryview], bool]) -> bool:
        route, live = self.members.route(sha)
        for tried, (node, relay) in enumerate(route.asks):
            peer = live[node]
            if await self._try(peer, relay, sha, length, buf, check):
                self.stats.chunks += 1
                self.stats.bytes += length
                self.stats.via_relay += relay
                self.stats.second_tries += tried > 0
                return True
        return False

    async def _try(self, peer: Peer, relay: bool, sha: str, length: int, buf: mmap.mmap,
                   check: Callable[[memoryview], bool]) -> bool:
        """One ask: True if ``peer`` gave the chunk and it checked good."""
        try:
            with trio.fail_after(self.timeout * (2 if relay else 1)):
                answered = await self._get(peer, relay, sha, length, buf)
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                OSError, WireError, ValueError) as exc:
            why = "no answer in time" if isinstance(exc, trio.TooSlowError) else str(exc)
            self.stats.errors += 1
            self._rest(peer, f"failed to serve chunk {sha[:12]} ({why})")
            return False
        if not answered:
            self.stats.misses += 1
            return False

        def verify() -> bool:
            with memoryview(buf) as whole, whole[:length] as view:
                return check(view)

        if not await trio.to_thread.run_sync(verify):
            self.stats.wrong += 1
            self._rest(peer, f"served chunk {sha} with bytes that fail its hash: ignored")
            return False
        return True

    def _rest(self, peer: Peer, what: str) -> None:
        self.members.rest(peer)
        log.warning("peer %s at %s %s; asking the next peer or the store, resting the "
                    "peer %.0f s",
                    peer.node, peer.address, what, REST)

    async def _get(self, peer: Peer, relay: bool, sha: str, length: int,
                   buf: mmap.mmap) -> bool:
        """Receive the chunk into ``buf``: True, or False if the peer says it cannot
        serve it; raises for anything broken."""
        host, port = split_address(peer.address)
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            when = f"{self.clock():.3f}"
            sig = peer_auth.sign(self.secret, RELAY_METHOD if relay else "GET", sha, length,
                                 when, self.node)
            await stream.send_all((
                f"{request_line(sha, length)}\r\nHost: {peer.address}\r\n"
                f"X-Ckptfs-Node: {self.node}\r\nX-Ckptfs-Time: {when}\r\n"
                f"X-Ckptfs-Signature: {sig}\r\n{RELAY_HEADER if relay else ''}"
                f"Connection: close\r\n\r\n").encode())
            head, rest = await read_head(stream)
            line, fields = parse_head(head)
            parts = line.split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                raise WireError("not an HTTP answer")
            if parts[1] in ("404", "503"):
                return False
            if parts[1] != "200":
                raise WireError(f"answered {line.strip()!r}")
            if fields.get("content-length") != str(length):
                raise WireError(f"answered {fields.get('content-length')} bytes, "
                                f"not {length}")
            if len(rest) > length:
                raise WireError("more bytes than the chunk")
            with memoryview(buf) as whole:
                whole[:len(rest)] = rest
                got = len(rest)
                while got < length:
                    piece = await stream.receive_some(min(1 << 20, length - got))
                    if not piece:
                        raise WireError(f"connection closed after {got} of {length} bytes")
                    whole[got:got + len(piece)] = piece
                    got += len(piece)
        return True
