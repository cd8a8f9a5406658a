"""The second hop and the next peer (cluster/peer_route.py through peer_fetch.py and
peer_serve.py): caches serving each other over loopback, over one in-memory store."""

from __future__ import annotations

import hashlib
import os

import pytest
import trio

from ckptfs.cluster.peer_auth import load_secret
from ckptfs.cluster.peer_fetch import PeerSource
from ckptfs.cluster.peer_members import Membership, peer_key
from ckptfs.cluster.peer_route import ranking
from ckptfs.cluster.peer_serve import PeerServer
from ckptfs.cluster.peer_wire import read_head, response_head
from ckptfs.data.cache import ChunkCache
from ckptfs.format.remote import chunk_key
from ckptfs.store import ListedObject
from ckptfs.store.memory import MemoryStore

SIZE = 64 << 10


def store_gets(store: MemoryStore, sha: str) -> int:
    return sum(1 for c in store.calls if c.op == "get" and c.key == chunk_key(sha))


async def lying_server(stream: trio.SocketStream) -> None:
    """Answers every chunk request with the right length of wrong bytes."""
    async with stream:
        head, _ = await read_head(stream)
        length = int(head.split(b"length=")[1].split(b" ")[0])
        await stream.send_all(response_head("200 OK", length) + bytes(length))


async def cluster(tmp_path, store, names, fanout, liars=()):
    """Caches, sources and servers of ``names`` (``liars`` only lie), all in each
    other's view; returns (caches, sources, servers, listeners)."""
    secret = load_secret(store)
    listeners = {n: await trio.open_tcp_listeners(0, host="127.0.0.1") for n in names}
    caches, sources, servers = {}, {}, {}
    for name in names:
        if name in liars:
            continue
        members = Membership(store, name, "boot", "unused", ttl=30.0, fanout=fanout)
        members.apply([ListedObject(peer_key(o, "boot", "127.0.0.1:%d" %
                                             listeners[o][0].socket.getsockname()[1]),
                                    1, "e") for o in names if o != name])
        caches[name] = ChunkCache(tmp_path / name, store, 1 << 30, trio.CapacityLimiter(2))
        sources[name] = caches[name].source = PeerSource(members, secret, name, timeout=5.0)
        servers[name] = PeerServer(caches[name], secret,
                                   role=lambda c, m=members: m.route(c)[0].role)
    return caches, sources, servers, listeners


@pytest.mark.trio
async def test_four_nodes_with_fanout_two_go_through_a_relay_and_the_store_once(tmp_path):
    store = MemoryStore()
    data = os.urandom(SIZE)
    sha = hashlib.sha256(data).hexdigest()
    store.put(chunk_key(sha), data)
    names = ["a", "b", "c", "d"]
    ranked = ranking(sha, names)          # 3 askers > fanout 2: ranks 1, 2 relay for 3
    caches, sources, servers, listeners = await cluster(tmp_path, store, names, fanout=2)
    async with trio.open_nursery() as nursery:
        for n in names:
            nursery.start_soon(servers[n].serve, listeners[n])
        with trio.fail_after(30):
            # The leaf first (its relay must fetch from the owner for it), then the rest.
            await caches[ranked[3]].ensure(sha, SIZE)
            async with trio.open_nursery() as readers:
                for n in ranked[:3]:
                    readers.start_soon(caches[n].ensure, sha, SIZE)
        nursery.cancel_scope.cancel()
    assert all(caches[n].path(sha).read_bytes() == data for n in names)
    assert store_gets(store, sha) == 1
    assert caches[ranked[0]].bytes_from_store == SIZE
    assert sources[ranked[3]].stats.via_relay == 1
    relayed = {n: servers[n].stats.relayed for n in names}
    assert sum(relayed.values()) == 1 and relayed[ranked[0]] == 0, relayed
    relay = next(n for n, v in relayed.items() if v)
    assert relay in ranked[1:3]
    assert servers[relay].stats.relayed_bytes == SIZE
    assert caches[relay].bytes_from_source == SIZE          # from the owner, not the store


@pytest.mark.trio
async def test_a_lying_owner_sends_its_askers_to_the_next_peer_not_each_to_the_store(
        tmp_path):
    store = MemoryStore()
    data = os.urandom(SIZE)
    sha = hashlib.sha256(data).hexdigest()
    store.put(chunk_key(sha), data)
    names = ["a", "b", "c", "d"]
    ranked = ranking(sha, names)
    liar = ranked[0]
    caches, sources, servers, listeners = await cluster(
        tmp_path, store, names, fanout=8, liars=(liar,))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, lying_server, listeners[liar])
        for n in ranked[1:]:
            nursery.start_soon(servers[n].serve, listeners[n])
        with trio.fail_after(30):
            async with trio.open_nursery() as readers:
                for n in ranked[1:]:
                    readers.start_soon(caches[n].ensure, sha, SIZE)
        nursery.cancel_scope.cancel()
    assert all(caches[n].path(sha).read_bytes() == data for n in ranked[1:])
    # Every asker was lied to once; the next-ranked node alone went to the store.
    assert [sources[n].stats.wrong for n in ranked[1:]] == [1, 1, 1]
    assert store_gets(store, sha) == 1
    assert caches[ranked[1]].bytes_from_store == SIZE
    assert [sources[n].stats.second_tries for n in ranked[2:]] == [1, 1]
