"""The test store's own start (ckptfs/bench/seaweed.py): a port picked free and closed before
weed binds it can be taken meanwhile; weed then exits, and the server starts again on
other ports instead of failing the whole session."""

from __future__ import annotations

import itertools
import socket

import ckptfs.bench.seaweed as seaweed


def test_a_port_taken_before_weed_binds_it(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = itertools.count()
        real = seaweed.free_port
        # The S3 port of the first start is one another process holds.
        monkeypatch.setattr(seaweed, "free_port",
                            lambda: port if next(picks) == 6 else real())
        server = seaweed.SeaweedServer(tmp_path / "weed")
        try:
            server.start()
            assert server.s3_port != port
            server.create_bucket("after-a-retry")
        finally:
            server.stop()
