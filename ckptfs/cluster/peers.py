"""Nodes of one store restore a checkpoint from each other: the wiring of the peer parts.

``Peers.run`` (a task in the daemon's nursery) binds the peer server's address (the
mount fails with one line if it cannot), then — in the background, so a store that is
away never blocks the mount — reads or creates the cluster secret, registers this node
in ``peers/``, serves chunks (peer_serve.py), and from then on renews its key and LISTs
the others every ``ttl / 3`` seconds; the cache's ``source`` is the peer fetcher
(peer_fetch.py) while this runs.  A failed renewal or listing is logged and retried at
the next round; the view it has keeps serving meanwhile (stale views only cost store
fetches, never wrong bytes).  ``leave`` removes the key at unmount.

Knows the cache and the store; nothing of FUSE or of the filesystem above the cache.
"""

from __future__ import annotations

import logging
import uuid

import trio

from ..data.cache import ChunkCache
from ..store import ObjectStore, StoreError
from . import peer_auth
from .peer_fetch import PeerSource, split_address
from .peer_members import Membership
from .peer_serve import PeerServer

log = logging.getLogger(__name__)


class Peers:
    def __init__(self, store: ObjectStore, cache: ChunkCache, node: str, listen: str,
                 advertise: str | None, ttl: float, timeout: float, fanout: int = 8) -> None:
        self.store = store
        self.cache = cache
        self.node = node
        self.listen = listen
        self.advertise = advertise or listen
        self.ttl = ttl
        self.timeout = timeout
        self.members = Membership(store, node, uuid.uuid4().hex[:12], self.advertise, ttl,
                                  fanout=fanout)
        self.server: PeerServer | None = None
        self.source: PeerSource | None = None
        self.failures = 0              # renewals or listings that failed in a row
        self.last_error: str | None = None

    async def bind(self) -> list[trio.SocketListener]:
        host, port = split_address(self.listen)
        if host in ("0.0.0.0", "::", "") and self.advertise == self.listen:
            raise OSError("a wildcard --peer-listen needs --peer-advertise (the address "
                          "other nodes reach)")
        return await trio.open_tcp_listeners(port, host=host)

    async def run(self, listeners: list[trio.SocketListener]) -> None:
        """Serve and keep membership until cancelled (bound listeners from ``bind``)."""
        interval = self.ttl / 3
        secret = None
        while secret is None:
            try:
                secret = await trio.to_thread.run_sync(peer_auth.load_secret, self.store)
            except (StoreError, ValueError) as exc:
                log.warning("peers: cannot read the cluster secret (%s); no peer fetches "
                            "until it can be read, retrying in %.0f s", exc, interval)
                await trio.sleep(interval)
        self.server = PeerServer(self.cache, secret,
                                 role=lambda chunk: self.members.route(chunk)[0].role)
        self.source = PeerSource(self.members, secret, self.node, self.timeout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.server.serve, listeners)
            await self._round()
            self.cache.source = self.source
            log.info("peers: serving chunks on %s (advertised as %s); %d peer(s) alive",
                     self.listen, self.advertise, len(self.members.live()))
            try:
                while True:
                    await trio.sleep(interval)
                    await self._round()
            finally:
                self.cache.source = None

    async def _round(self) -> None:
        """Renew this node's key and LIST the others (one LIST)."""
        try:
            await trio.to_thread.run_sync(self.members.renew)
            listing = await trio.to_thread.run_sync(self.members.listing)
        except StoreError as exc:
            self.failures += 1
            self.last_error = str(exc)
            log.warning("peers: membership round failed (%s); keeping the last view", exc)
            return
        self.failures = 0
        self.last_error = None
        doomed = self.members.apply(listing)
        if doomed:
            await trio.to_thread.run_sync(self.members.forget, doomed)

    async def leave(self, timeout: float) -> None:
        """Remove this node's key (at unmount), for at most ``timeout`` seconds."""
        try:
            with trio.move_on_after(timeout):
                await trio.to_thread.run_sync(self.members.leave, abandon_on_cancel=True)
        except StoreError as exc:
            log.info("peers: could not remove %s (%s); it dies by its ttl",
                     self.members.key, exc)

    def report(self) -> dict:
        fetch = vars(self.source.stats) if self.source else {}
        serve = vars(self.server.stats) if self.server else {}
        return {"listen": self.listen, "advertise": self.advertise,
                "node": self.node, "key": self.members.key,
                "alive": len(self.members.live()),
                "fanout": self.members.fanout,
                "peers": self.members.report(),
                "bytes_from_peers": self.cache.bytes_from_source,
                "bytes_from_store": self.cache.bytes_from_store,
                "fetch": dict(fetch), "serve": dict(serve),
                "membership_failures": self.failures, "last_error": self.last_error,
                "lists": self.members.lists}
