"""Prometheus metrics (issue 12 part 2): ``--metrics-address HOST:PORT`` serves
``/metrics`` from a real mount, with real values after real saves and reads."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import run_ckptfs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_after_save_and_read(store, make_mount):
    port_a, port_b = free_port(), free_port()
    a = make_mount(store, name="a", extra=("--metrics-address", f"127.0.0.1:{port_a}"))
    size = 3 * 2**20 + 123
    data = os.urandom(size)
    (a.path / "model.bin").write_bytes(data)
    (a.path / "copy.bin").write_bytes(data)              # same chunks: deduplicated
    ckpt = a.path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"w" * 1000)
    run_ckptfs("commit", str(ckpt), check=True)

    m = scrape(port_a)
    assert m[("ckptfs_written_bytes_total", ())] >= 2 * size + 1000
    assert m[("ckptfs_uploaded_bytes_total", ())] >= size
    assert m[("ckptfs_deduplicated_bytes_total", ())] >= size
    assert m[("ckptfs_chunks_put_total", ())] >= 1
    assert m[("ckptfs_entries_put_total", ())] >= 4        # 3 files, 1 directory
    assert m[("ckptfs_pending_uploads", ())] == 0
    assert m[("ckptfs_pending_upload_bytes", ())] == 0
    assert m[("ckptfs_publish_seconds_count", ())] >= 3
    assert m[("ckptfs_seal_seconds_count", ())] >= 1
    assert m[("ckptfs_writer_blocked_seconds_count", (("op", "close"),))] >= 3
    assert m[("ckptfs_writer_blocked_seconds_sum", (("op", "close"),))] > 0
    assert m[("ckptfs_store_errors_total", (("kind", "transient"),))] == 0

    b = make_mount(store, name="b", extra=("--metrics-address", f"127.0.0.1:{port_b}"))
    assert (b.path / "model.bin").read_bytes() == data
    assert (b.path / "copy.bin").read_bytes() == data
    m = scrape(port_b)
    assert m[("ckptfs_fetched_bytes_total", ())] >= size
    assert m[("ckptfs_cache_misses_total", ())] >= 1
    assert m[("ckptfs_cache_hits_total", ())] >= 1          # copy.bin: same chunks
    assert m[("ckptfs_cache_bytes", ())] >= size
    assert m[("ckptfs_corrupt_chunks_total", ())] == 0
    assert m[("ckptfs_uploaded_bytes_total", ())] == 0


@pytest.mark.expect_log_errors(r"failed verification", r"injected transient fault")
def test_metrics_count_store_errors_and_corrupt_chunks(local_store, make_mount, tmp_path):
    port = free_port()
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    a = make_mount(local_store, name="a")
    data = os.urandom(100_000)
    (a.path / "f.bin").write_bytes(data)
    b = make_mount(local_store, name="b", faults={"control_file": str(control)},
                   extra=("--metrics-address", f"127.0.0.1:{port}"))
    control.write_text(json.dumps({"rules": [
        {"op": "get", "prefix": "chunks/", "kind": "corrupt", "times": 1},
        {"op": "put", "prefix": "dirs/", "kind": "transient", "times": 1}]}))
    assert (b.path / "f.bin").read_bytes() == data          # refetched after the bad one
    (b.path / "g.bin").write_bytes(b"g")                    # one retried PUT
    m = scrape(port)
    assert m[("ckptfs_corrupt_chunks_total", ())] == 1
    assert m[("ckptfs_store_errors_total", (("kind", "transient"),))] == 1


def test_bad_metrics_address_fails_the_mount(local_store, tmp_path):
    mnt = tmp_path / "m"
    mnt.mkdir()
    proc = run_ckptfs("mount", str(mnt), "--store", local_store.url, "--state-dir",
                      str(tmp_path / "s"), "--metrics-address", "nohost")
    assert proc.returncode != 0
    assert "metrics_address" in proc.stderr and "HOST:PORT" in proc.stderr, proc.stderr
    assert not os.path.ismount(mnt)
