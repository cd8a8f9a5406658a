"""Issue 24: nodes of one store restore a checkpoint from each other (cluster/peers.py).

Real mounts on loopback ports, a real SeaweedFS reached through the byte-counting proxy
(``store_proxy``): what the proxy forwards from the server is what the store served.
The checkpoint is written beside the proxy (``s3_store``), so only restores count.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import urllib.request
import uuid

import pytest

from ckptfs.cluster import peer_auth
from ckptfs.cluster.peer_members import peer_key
from ckptfs.format.chunkid import chunk_ok
from ckptfs.store import open_store
from support.mounts import eventually, run_ckptfs

MiB = 1 << 20
CHUNK = "256K"
SIZE = 16 * MiB
# Membership renews every ttl/3 = 1 s; a chunk from a peer may take 5 s.
PEER_OPTS = ("--chunk-size", CHUNK, "--lease-ttl", "3", "--peer-timeout", "5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_mount(make_mount, spec, name, *extra):
    port = free_port()
    m = make_mount(spec, name=name, extra=(*PEER_OPTS, "--peer-listen", f"127.0.0.1:{port}",
                                           *extra))
    m.peer_port = port
    return m


def peer_mounts(make_mount, spec, prefix, n, *extra):
    """``n`` peer mounts started at once (each mount command is a Python start-up)."""
    mounts: list = [None] * n
    errors: list = []

    def start(i):
        try:
            mounts[i] = peer_mount(make_mount, spec, f"{prefix}{i}", *extra)
        except Exception as exc:        # re-raised below, on the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return mounts


def raw_store(spec):
    saved = dict(os.environ)
    try:
        os.environ.update(spec.env)
        return open_store(spec.url)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def write_checkpoint(make_mount, s3_store, size=SIZE) -> tuple[str, bytes]:
    w = make_mount(s3_store, name="writer", extra=("--chunk-size", CHUNK))
    data = os.urandom(size)
    (w.path / "ckpt").mkdir()
    (w.path / "ckpt" / "model.bin").write_bytes(data)
    return "ckpt/model.bin", data


def wait_peers(mounts, n):
    for m in mounts:
        eventually(lambda m=m: m.status()["peers"]["alive"] >= n, timeout=20)


def read_all(mounts, rel, results, started=None):
    def one(m):
        try:
            with open(m.path / rel, "rb") as f:
                h = hashlib.sha256()
                while True:
                    piece = f.read(MiB)
                    if not piece:
                        break
                    h.update(piece)
                    if started is not None:
                        started.set()
            results[m.path] = h.hexdigest()
        except OSError as exc:
            results[m.path] = exc
    threads = [threading.Thread(target=one, args=(m,)) for m in mounts]
    for t in threads:
        t.start()
    return threads


def assert_one_store_copy(nodes, proxy, data: bytes, results: dict) -> list[dict]:
    """Every node read the right bytes, the store served about one copy, and no peer
    fetch went wrong; returns each node's ``status()["peers"]``."""
    served = proxy.bytes_down
    want = hashlib.sha256(data).hexdigest()
    assert all(results[m.path] == want for m in nodes), results
    assert served <= 1.15 * len(data), f"store served {served / len(data):.2f}x"
    peers = [m.status()["peers"] for m in nodes]
    assert all(p["fetch"]["wrong"] == 0 and p["fetch"]["errors"] == 0 for p in peers)
    return peers


def test_four_fresh_nodes_restore_one_checkpoint_for_about_one_store_copy(
        s3_store, store_proxy, make_mount):
    rel, data = write_checkpoint(make_mount, s3_store)
    nodes = peer_mounts(make_mount, store_proxy, "n", 4, "--metrics-address", "127.0.0.1:0")
    wait_peers(nodes, 3)
    proxy = store_proxy.proxy
    proxy.count_reset()
    results: dict = {}
    # Three nodes read the file; the fourth prefetches it (the same fetch path).
    threads = read_all(nodes[:3], rel, results)
    run_ckptfs("prefetch", str(nodes[3].path / rel), check=True)
    for t in threads:
        t.join(120)
    for t in read_all(nodes[3:], rel, results):
        t.join(120)
    peers = assert_one_store_copy(nodes, proxy, data, results)
    assert sum(p["bytes_from_peers"] for p in peers) >= 2 * len(data)
    assert sum(p["bytes_from_store"] for p in peers) <= 1.15 * len(data)
    assert peers[3]["bytes_from_peers"] > 0              # prefetch asked the peers too
    url = f"http://{nodes[0].status()['metrics_address']}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line and not line.startswith("#"))
    assert float(values["ckptfs_chunk_bytes_from_peers_total"]) == \
        peers[0]["bytes_from_peers"]
    assert float(values["ckptfs_peers_alive"]) == 3


def test_with_a_small_fanout_four_nodes_restore_through_relays_for_one_store_copy(
        s3_store, store_proxy, make_mount):
    # --peer-fanout 2: 3 askers per chunk > 2, so ranks 1 and 2 relay to the fourth.
    rel, data = write_checkpoint(make_mount, s3_store, size=8 * MiB)
    nodes = peer_mounts(make_mount, store_proxy, "r", 4, "--peer-fanout", "2")
    wait_peers(nodes, 3)
    proxy = store_proxy.proxy
    proxy.count_reset()
    results: dict = {}
    for t in read_all(nodes, rel, results):
        t.join(120)
    peers = assert_one_store_copy(nodes, proxy, data, results)
    assert all(p["fanout"] == 2 for p in peers)
    assert sum(p["serve"]["relayed_bytes"] for p in peers) > 0     # a non-owner served
    assert sum(p["fetch"]["via_relay"] for p in peers) > 0


def test_a_node_killed_mid_restore_leaves_the_others_right_and_done(
        s3_store, store_proxy, make_mount):
    rel, data = write_checkpoint(make_mount, s3_store)
    nodes = peer_mounts(make_mount, store_proxy, "k", 3)
    wait_peers(nodes, 2)
    results: dict = {}
    started = threading.Event()
    threads = read_all(nodes[:2], rel, results, started)
    assert started.wait(60)
    victim = nodes[2]
    victim.kill()                     # SIGKILL: its share is still to be served
    for t in threads:
        t.join(120)                   # a hang guard, not a timing claim
        assert not t.is_alive()
    want = hashlib.sha256(data).hexdigest()
    assert [results[m.path] for m in nodes[:2]] == [want, want]
    reports = [m.status()["peers"] for m in nodes[:2]]
    # Each survivor failed only the asks in flight to the dead node when it died (at
    # most fetch_concurrency, 8), each then one store fetch; then the node was rested.
    assert sum(p["fetch"]["errors"] for p in reports) >= 1
    assert all(p["fetch"]["errors"] <= 8 for p in reports)
    assert all(p["fetch"]["wrong"] == 0 for p in reports)


class LyingPeer:
    """A peer server that registers itself in ``peers/`` and renews its key like a node,
    then answers every chunk request with the right length and the wrong bytes (or,
    ``silent``, reads the request and never answers)."""

    def __init__(self, store, silent=False):
        self.store = store
        self.silent = silent
        self.held: list = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.key = peer_key(uuid.uuid4().hex[:16], uuid.uuid4().hex[:12], address)
        self.requests = 0
        self.stop = False
        self.store.put(self.key, b"0")
        threading.Thread(target=self._renew, daemon=True).start()
        threading.Thread(target=self._serve, daemon=True).start()

    def _renew(self):
        seq = 0
        while not self.stop:
            seq += 1
            self.store.put(self.key, str(seq).encode())
            time.sleep(0.5)

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.silent:
                self.requests += 1
                self.held.append(conn)          # open, never answered
                continue
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = conn.recv(4096)
                    if not piece:
                        break
                    head += piece
                self.requests += 1
                length = int(head.split(b"length=")[1].split(b" ")[0])
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % length
                             + os.urandom(length))

    def close(self):
        self.stop = True
        self.sock.close()
        for conn in self.held:
            conn.close()
        self.store.delete(self.key)


def test_a_lying_peer_and_a_silent_one_are_bypassed(s3_store, store_proxy, make_mount):
    rel, data = write_checkpoint(make_mount, s3_store)
    liar = LyingPeer(raw_store(s3_store))
    mute = LyingPeer(raw_store(s3_store), silent=True)
    try:
        node = peer_mount(make_mount, store_proxy, "honest")
        wait_peers([node], 2)
        store_proxy.proxy.count_reset()
        assert (node.path / rel).read_bytes() == data
        peers = node.status()["peers"]
    finally:
        liar.close()
        mute.close()
    # Each bad peer fails only the asks in flight to it when its first answer comes (at
    # most fetch_concurrency, 8: the liar's wrong bytes, the silent one's --peer-timeout)
    # and is rested; no lie is believed, and each failed ask costs one store fetch.
    assert 1 <= peers["fetch"]["wrong"] == liar.requests <= 8
    assert 1 <= peers["fetch"]["errors"] == mute.requests <= 8
    assert peers["bytes_from_peers"] == 0
    assert store_proxy.proxy.bytes_down <= 1.15 * len(data)
    log = (node.state_dir / "ckptfs.log").read_text()
    assert "fail its hash" in log and "no answer in time" in log


def test_a_request_without_the_secret_gets_nothing(s3_store, make_mount):
    rel, data = write_checkpoint(make_mount, s3_store, size=1 * MiB)
    node = peer_mount(make_mount, s3_store, "server")
    assert (node.path / rel).read_bytes() == data        # its cache holds the chunks
    store = raw_store(s3_store)
    eventually(lambda: any(o.key == peer_auth.SECRET_KEY for o in store.list("peers/")))
    chunk = next(o for o in store.list("chunks/"))
    sha, length = chunk.key.rsplit("/", 1)[1], chunk.size

    def ask(headers: str) -> bytes:
        with socket.create_connection(("127.0.0.1", node.peer_port), timeout=10) as s:
            s.sendall(f"GET /chunk/{sha}?length={length} HTTP/1.1\r\n{headers}\r\n".encode())
            out = b""
            while True:
                piece = s.recv(1 << 20)
                if not piece:
                    return out
                out += piece

    when = f"{time.time():.3f}"
    unsigned = ask("X-Ckptfs-Node: stranger\r\n")
    forged = ask(f"X-Ckptfs-Node: stranger\r\nX-Ckptfs-Time: {when}\r\n"
                 f"X-Ckptfs-Signature: {'0' * 64}\r\n")
    secret = peer_auth.load_secret(store)
    old = f"{time.time() - 3600:.3f}"
    stale = ask(f"X-Ckptfs-Node: stranger\r\nX-Ckptfs-Time: {old}\r\nX-Ckptfs-Signature: "
                f"{peer_auth.sign(secret, 'GET', sha, length, old, 'stranger')}\r\n")
    signed = ask(f"X-Ckptfs-Node: friend\r\nX-Ckptfs-Time: {when}\r\nX-Ckptfs-Signature: "
                 f"{peer_auth.sign(secret, 'GET', sha, length, when, 'friend')}\r\n")
    for answer in (unsigned, forged, stale):
        assert answer.startswith(b"HTTP/1.1 403 ") and answer.endswith(b"\r\n\r\n")
        assert b"Content-Length: 0\r\n" in answer
    assert signed.startswith(b"HTTP/1.1 200 ")
    body = signed.split(b"\r\n\r\n", 1)[1]
    assert len(body) == length and chunk_ok(body, sha)
    assert node.status()["peers"]["serve"]["refused"] == 3
