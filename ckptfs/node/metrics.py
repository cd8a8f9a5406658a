"""Prometheus metrics of one daemon (``--metrics-address HOST:PORT``, ``/metrics``).

One ``Metrics`` object per daemon, with its own registry (no global state).  Two kinds
of numbers:

- observed here, through small hooks at the places that know them: bytes written
  (``FuseOps.write``), time writers were blocked in ``close``/``fsync`` (``FuseOps``),
  publish and seal latency (``Filesystem.observe``), checkpoints removed by retention;
- read at scrape time from the counters the daemon keeps anyway (``Snapshot``): bytes
  uploaded, deduplicated and fetched, chunks and entries put, store errors by kind,
  cache hits, misses, evictions and corrupt chunks, pending uploads and bytes.

Every name starts with ``ckptfs_``.  Knows nothing of FUSE or the store beyond the
numbers it is handed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# Seconds: from a small file on a quiet disk to a 70 GB shard on a busy link.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
STORE_ERROR_KINDS = ("transient", "timeout", "permanent")


@dataclass
class Snapshot:
    """The scrape-time numbers, taken at once on the daemon's trio thread."""

    upload: dict            # upload.UploadStats fields
    store: dict             # store.StoreStats.snapshot()
    cache: dict             # hits, misses, evictions, corrupt_events, total, limit
    pending_uploads: int
    pending_bytes: int
    open_handles: int
    peers: dict | None = None   # cluster.peers.Peers.report() with --peer-listen


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) -> (host, port); ValueError with one line.
    Port 0: any free port (``Metrics.address`` says which)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {text!r}")
    return host, int(port)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.written = Counter("ckptfs_written_bytes", "Bytes applications wrote into the "
                               "mount", registry=r)
        self.blocked = Histogram("ckptfs_writer_blocked_seconds", "Time a writer waited in "
                                 "close (flush) or fsync", ["op"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        for op in ("close", "fsync"):
            self.blocked.labels(op=op)
        self.publish = Histogram("ckptfs_publish_seconds", "Time from the start of a "
                                 "file's publish to its entry in the store",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.seal = Histogram("ckptfs_seal_seconds", "Time a seal took, waiting for the "
                              "uploads below the directory included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.retention_removed = Counter("ckptfs_retention_removed_checkpoints",
                                         "Sealed checkpoints removed by retention",
                                         registry=r)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.address: str | None = None     # HOST:PORT served, the port bound (not 0)

    # ------------------------------------------------------------------ hooks

    def observe(self, what: str, seconds: float) -> None:
        """``Filesystem.observe``: "publish" or "seal" latency."""
        if what == "publish":
            self.publish.observe(seconds)
        elif what == "seal":
            self.seal.observe(seconds)

    def attach(self, snapshot: Callable[[], Snapshot | None]) -> None:
        """``snapshot`` is called by each scrape (in the HTTP thread); None: no numbers
        now (the daemon is stopping)."""
        self.registry.register(_Collector(snapshot))

    # ------------------------------------------------------------------ serving

    def serve(self, address: str) -> str:
        """Listen on ``address`` (OSError if it cannot be bound); returns HOST:PORT with
        the port actually bound."""
        host, port = parse_address(address)
        self._server, self._thread = start_http_server(port, host, registry=self.registry)
        port = self._server.server_address[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Collector:
    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self.snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        snap = self.snapshot()
        if snap is None:
            return
        up, store, cache = snap.upload, snap.store, snap.cache

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("ckptfs_uploaded_bytes", "Chunk bytes uploaded to the store",
                      up["bytes_uploaded"])
        yield counter("ckptfs_deduplicated_bytes", "Chunk bytes not uploaded: the store "
                      "had them", up["bytes_deduplicated"])
        yield counter("ckptfs_chunks_put", "Chunks uploaded", up["chunks_uploaded"])
        yield counter("ckptfs_chunks_deduplicated", "Chunks the store already had",
                      up["chunks_deduplicated"])
        yield counter("ckptfs_publishes", "Files published", up["publishes"])
        yield counter("ckptfs_publish_failures", "Publish attempts that failed",
                      up["publish_failures"])
        yield counter("ckptfs_entries_put", "Directory entries and inode objects written",
                      store.get("entry_puts", 0))
        yield counter("ckptfs_fetched_bytes", "Chunk bytes fetched from the store",
                      store.get("chunk_bytes_got", 0))
        yield counter("ckptfs_store_requests", "Store requests (all kinds)",
                      sum(store.get(k, 0) for k in ("puts", "gets", "lists", "deletes",
                                                    "heads")))
        yield counter("ckptfs_store_retries", "Store requests retried", store.get("retries", 0))
        errors = CounterMetricFamily("ckptfs_store_errors", "Failed store requests by kind "
                                     "(transient: retried; timeout: gave up; permanent)",
                                     labels=["kind"])
        kinds = store.get("error_kinds", {})
        for kind in sorted(set(STORE_ERROR_KINDS) | set(kinds)):
            errors.add_metric([kind], kinds.get(kind, 0))
        yield errors
        yield counter("ckptfs_cache_hits", "Chunk reads served by the node cache",
                      cache["hits"])
        yield counter("ckptfs_cache_misses", "Chunk reads that fetched from the store",
                      cache["misses"])
        yield counter("ckptfs_cache_evictions", "Chunks evicted from the node cache",
                      cache["evictions"])
        yield counter("ckptfs_corrupt_chunks", "Chunks from the store that failed "
                      "verification (refetched)", cache["corrupt_events"])
        yield gauge("ckptfs_cache_bytes", "Bytes in the node cache", cache["total"])
        yield gauge("ckptfs_cache_limit_bytes", "Node cache limit", cache["limit"])
        yield gauge("ckptfs_pending_uploads", "Closed files not yet in the store",
                    snap.pending_uploads)
        yield gauge("ckptfs_pending_upload_bytes", "Staged bytes of closed files not yet "
                    "in the store", snap.pending_bytes)
        yield gauge("ckptfs_open_handles", "Open file handles", snap.open_handles)
        yield counter("ckptfs_chunk_bytes_from_store", "Chunk bytes the cache fetched from "
                      "the store", cache.get("from_store", 0))
        yield counter("ckptfs_chunk_bytes_from_peers", "Chunk bytes the cache got from "
                      "other nodes (checked)", cache.get("from_peers", 0))
        if snap.peers is not None:
            yield from _peer_metrics(snap.peers)



def _peer_metrics(peers: dict):
    """The numbers of a node serving peers (cluster/peers.py ``report``)."""
    fetch, serve = peers["fetch"], peers["serve"]
    yield GaugeMetricFamily("ckptfs_peers_alive", "Other nodes of this store seen alive",
                            value=peers["alive"])
    for name, doc, value in (
            ("ckptfs_peer_errors", "Chunk requests to peers that failed or timed out "
             "(fetched from the store instead)", fetch.get("errors", 0)),
            ("ckptfs_peer_wrong_chunks", "Chunks from peers that failed their hash "
             "(ignored, fetched from the store)", fetch.get("wrong", 0)),
            ("ckptfs_peer_served_bytes", "Chunk bytes served to other nodes",
             serve.get("bytes", 0)),
            ("ckptfs_peer_refused", "Peer requests refused (not signed right)",
             serve.get("refused", 0))):
        yield CounterMetricFamily(name, doc, value=value)
