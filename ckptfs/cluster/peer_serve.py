"""Serving chunks to the other nodes of this store (the server side of peer_wire.py).

A request signed with the cluster secret (peer_auth.py) for chunk C of length n gets
C's bytes from this node's verified cache; a chunk not cached yet is fetched from the
store first — one flight however many peers ask (``ChunkCache.ensure`` with
``use_source=False``: a node serving another never asks a third).  Except when asked
as the chunk's relay (``X-Ckptfs-Relay``, the second hop): then, if ``role`` (a
collaborator: this node's role for the chunk, peer_route.py) says it is a relay, it
fetches through its cache's source (→ the owner; single flight too); if it says it is
the owner, from the store as ever; a leaf that has not got the chunk answers ``503``
(it would need a second relay: the asker goes to the owner).  An unsigned, badly
signed or stale request gets ``403`` and nothing else.  Bounded like the control socket:
at most ``max_conns`` connections (the next ones are closed at once), a head of at most
``MAX_HEAD`` bytes read within ``HEAD_TIMEOUT``, lengths up to ``MAX_CHUNK_SIZE``, and
the body sent from the cache file in pieces of ``PIECE`` bytes (memory per connection
is one piece, not one chunk).

Knows the cache and the wire; nothing of membership or of how peers fetch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..data.cache import ChunkCache
from ..errors import FsError
from ..format.remote import MAX_CHUNK_SIZE
from . import peer_auth
from .peer_wire import RELAY_METHOD, WireError, parse_head, parse_request_line, read_head, response_head

log = logging.getLogger(__name__)

HEAD_TIMEOUT = 5.0
SEND_TIMEOUT = 120.0         # a whole chunk to one asker
PIECE = 1 << 20
REFUSAL_LOG_EVERY = 60.0     # seconds between WARNINGs about refused requests


@dataclass
class ServeStats:
    chunks: int = 0          # requests answered with the chunk
    bytes: int = 0
    refused: int = 0         # not signed right (403)
    turned_away: int = 0     # over the connection bound
    failed: int = 0          # could not get the chunk (503)
    relayed: int = 0         # of ``chunks``: served as a relay, this node not the owner
    relayed_bytes: int = 0


class PeerServer:
    def __init__(self, cache: ChunkCache, secret: bytes, max_conns: int = 32,
                 clock: Callable[[], float] = time.time,
                 role: Callable[[str], str] = lambda chunk: "owner") -> None:
        self.cache = cache
        self.role = role
        self.secret = secret
        self.max_conns = max_conns
        self.clock = clock
        self.stats = ServeStats()
        self._conns = 0
        self._refusals_logged_at = -REFUSAL_LOG_EVERY

    async def serve(self, listeners: list[trio.SocketListener]) -> None:
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        if self._conns >= self.max_conns:
            self.stats.turned_away += 1
            await stream.aclose()
            return
        self._conns += 1
        try:
            await self._answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass                     # the asker went away: its problem
        finally:
            self._conns -= 1
            await stream.aclose()

    async def _answer(self, stream: trio.SocketStream) -> None:
        try:
            with trio.fail_after(HEAD_TIMEOUT):
                head, _ = await read_head(stream)
            line, fields = parse_head(head)
            chunk, length = parse_request_line(line)
        except (WireError, trio.TooSlowError) as exc:
            self._refuse(f"malformed request ({exc})")
            await stream.send_all(response_head("400 Bad Request"))
            return
        relay = fields.get("x-ckptfs-relay") == "1"
        why = peer_auth.check(self.secret, RELAY_METHOD if relay else "GET", chunk, length,
                              fields.get("x-ckptfs-time", ""),
                              fields.get("x-ckptfs-node", ""),
                              fields.get("x-ckptfs-signature", ""), self.clock())
        if why is None and not 0 < length <= MAX_CHUNK_SIZE:
            why = f"length {length} out of range"
        if why is not None:
            self._refuse(why)
            await stream.send_all(response_head("403 Forbidden"))
            return
        role = self.role(chunk) if relay else "owner"
        if role == "leaf" and not self.cache.has(chunk):
            self.stats.failed += 1
            await stream.send_all(response_head("503 Service Unavailable"))
            return
        if await self._send(stream, chunk, length, use_source=role == "relay") \
                and role == "relay":
            self.stats.relayed += 1
            self.stats.relayed_bytes += length

    async def _send(self, stream: trio.SocketStream, chunk: str, length: int,
                    use_source: bool) -> bool:
        """Send the chunk from the cache (fetched first if need be): True if it went."""
        self.cache.pin(chunk)
        try:
            try:
                path = await self.cache.ensure(chunk, length, use_source=use_source)
                fd = os.open(path, os.O_RDONLY)
            except (FsError, OSError) as exc:
                self.stats.failed += 1
                log.info("peer asked for chunk %s: cannot serve it: %s", chunk[:12], exc)
                await stream.send_all(response_head("503 Service Unavailable"))
                return False
            try:
                size = os.fstat(fd).st_size
                if size != length:
                    self.stats.failed += 1
                    await stream.send_all(response_head("404 Not Found"))
                    return False
                with trio.fail_after(SEND_TIMEOUT):
                    await stream.send_all(response_head("200 OK", length))
                    sent = 0
                    while sent < length:
                        piece = await trio.to_thread.run_sync(
                            os.pread, fd, min(PIECE, length - sent), sent)
                        if not piece:
                            raise OSError("cache file shorter than its chunk")
                        await stream.send_all(piece)
                        sent += len(piece)
            finally:
                os.close(fd)
        except trio.TooSlowError:
            return False
        finally:
            self.cache.unpin(chunk)
        self.stats.chunks += 1
        self.stats.bytes += length
        return True

    def _refuse(self, why: str) -> None:
        self.stats.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_EVERY:
            self._refusals_logged_at = now
            log.warning("peer server: refused a request (%s); %d refused so far",
                        why, self.stats.refused)
