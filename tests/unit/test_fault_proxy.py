"""The fault proxy (tests/support/proxy.py) itself: a closed proxy's accept thread
ends, and never serves a connection meant for the next proxy.  One left blocked in
accept() on a closed listener took the next listener's connections (same descriptor
number) and forwarded them in "pass" mode through the next proxy's outage: the model
test saw `ckptfs wait` say done while the store was away (seeds 1215064, 1215156,
1215167)."""

from __future__ import annotations

import socket
import subprocess

from support.proxy import FaultProxy


def test_a_closed_proxys_accept_thread_ends_and_the_next_proxy_gets_its_connections():
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(16)
    try:
        old = FaultProxy(upstream.getsockname()[1])
        old.close()
        old._acceptor.join(timeout=5)
        assert not old._acceptor.is_alive()
        new = FaultProxy(upstream.getsockname()[1], mode="hang")
        try:
            subprocess.run(["true"], check=True)   # what woke the stale accept() before
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", new.port), timeout=5):
                    pass
            assert sum(old.accepted.values()) == 0
        finally:
            new.close()
    finally:
        upstream.close()
