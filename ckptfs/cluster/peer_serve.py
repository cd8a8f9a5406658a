"""Serving chunks to the other nodes of this store (the server side of peer_wire.py).

A request signed with the cluster secret (peer_auth.py) for chunk C of length n gets
C's bytes from this node's verified cache; a chunk not cached yet is fetched from the
store first — one flight however many peers ask (``ChunkCache.ensure`` with
``use_source=False``: a node serving another never asks a third).  An unsigned, badly
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
from .peer_wire import WireError, parse_head, parse_request_line, read_head, response_head

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


class PeerServer:
    def __init__(self, cache: ChunkCache, secret: bytes, max_conns: int = 32,
                 clock: Callable[[], float] = time.time) -> None:
        self.cache = cache
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
        why = peer_auth.check(self.secret, "GET", chunk, length,
                              fields.get("x-ckptfs-time", ""),
                              fields.get("x-ckptfs-node", ""),
                              fields.get("x-ckptfs-signature", ""), self.clock())
        if why is None and not 0 < length <= MAX_CHUNK_SIZE:
            why = f"length {length} out of range"
        if why is not None:
            self._refuse(why)
            await stream.send_all(response_head("403 Forbidden"))
            return
        self.cache.pin(chunk)
        try:
            try:
                path = await self.cache.ensure(chunk, length, use_source=False)
                fd = os.open(path, os.O_RDONLY)
            except (FsError, OSError) as exc:
                self.stats.failed += 1
                log.info("peer asked for chunk %s: cannot serve it: %s", chunk[:12], exc)
                await stream.send_all(response_head("503 Service Unavailable"))
                return
            try:
                size = os.fstat(fd).st_size
                if size != length:
                    self.stats.failed += 1
                    await stream.send_all(response_head("404 Not Found"))
                    return
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
            return
        finally:
            self.cache.unpin(chunk)
        self.stats.chunks += 1
        self.stats.bytes += length

    def _refuse(self, why: str) -> None:
        self.stats.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_EVERY:
            self._refusals_logged_at = now
            log.warning("peer server: refused a request (%s); %d refused so far",
                        why, self.stats.refused)
