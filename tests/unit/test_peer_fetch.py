"""Two nodes' caches serving each other over loopback (cluster/peer_serve.py,
cluster/peer_fetch.py, the cache's source seam), over one in-memory store."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from ckptfs.cluster.peer_auth import load_secret
from ckptfs.cluster.peer_fetch import PeerSource
from ckptfs.cluster.peer_members import Membership, peer_key, score
from ckptfs.cluster.peer_serve import PeerServer
from ckptfs.data.cache import ChunkCache
from ckptfs.format.remote import chunk_key
from ckptfs.store import ListedObject
from ckptfs.store.memory import MemoryStore

SIZE = 64 << 10


def chunk_owned_by(store: MemoryStore, owner: str, other: str) -> tuple[str, bytes]:
    """A chunk in the store whose rendezvous owner is ``owner``."""
    while True:
        data = os.urandom(SIZE)
        sha = hashlib.sha256(data).hexdigest()
        if score(owner, sha) > score(other, sha):
            store.put(chunk_key(sha), data)
            return sha, data


@pytest.mark.trio
async def test_two_nodes_asking_each_other_at_once_do_not_wait_on_each_other(tmp_path):
    # One fetch slot each: a wait for a peer must not hold the slot the peer's request
    # needs for the store (it did: both waited out --peer-timeout, then the store).
    store = MemoryStore()
    secret = load_secret(store)
    x, x_data = chunk_owned_by(store, "b", "a")        # a asks b for x
    y, y_data = chunk_owned_by(store, "a", "b")        # b asks a for y
    caches, sources, listeners = {}, {}, {}
    for name in "ab":
        caches[name] = ChunkCache(tmp_path / name, store, 1 << 30, trio.CapacityLimiter(1))
        listeners[name] = await trio.open_tcp_listeners(0, host="127.0.0.1")
    for name, other in (("a", "b"), ("b", "a")):
        members = Membership(store, name, "boot", "unused", ttl=30.0)
        port = listeners[other][0].socket.getsockname()[1]
        members.apply([ListedObject(peer_key(other, "boot", f"127.0.0.1:{port}"), 1, "e")])
        sources[name] = caches[name].source = PeerSource(members, secret, name, timeout=3.0)
    async with trio.open_nursery() as servers:
        for name in "ab":
            servers.start_soon(PeerServer(caches[name], secret).serve, listeners[name])
        with trio.fail_after(30):
            async with trio.open_nursery() as readers:
                readers.start_soon(caches["a"].ensure, x, SIZE)
                readers.start_soon(caches["b"].ensure, y, SIZE)
        servers.cancel_scope.cancel()
    assert caches["a"].path(x).read_bytes() == x_data
    assert caches["b"].path(y).read_bytes() == y_data
    assert [vars(sources[n].stats) for n in "ab"] == \
        [{"chunks": 1, "bytes": SIZE, "errors": 0, "wrong": 0, "misses": 0,
          "via_relay": 0, "second_tries": 0}] * 2
    assert [caches[n].bytes_from_source for n in "ab"] == [SIZE, SIZE]
