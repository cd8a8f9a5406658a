"""Prometheus metrics (issue 12 part 2): ``--metrics-address HOST:PORT`` serves
``/metrics`` from a real mount, with real values after real saves and reads.

Every daemon here binds port 0 and the test reads the port it got from status: a port
picked by the test and closed before the daemon binds it can be taken meanwhile (by
another test's daemon, or SeaweedFS), and the mount then fails."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.mounts import run_ckptfs


ANY_PORT = ("--metrics-address", "127.0.0.1:0")


def metrics_address(mount) -> str:
    """HOST:PORT the daemon serves metrics on (it bound port 0)."""
    address = mount.status()["metrics_address"]
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, address
    return address


def scrape(mount) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    url = f"http://{metrics_address(mount)}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_after_save_and_read(store, make_mount):
    a = make_mount(store, name="a", extra=ANY_PORT)
    size = 3 * 2**20 + 123
    data = os.urandom(size)
    (a.path / "model.bin").write_bytes(data)
    (a.path / "copy.bin").write_bytes(data)              # same chunks: deduplicated
    ckpt = a.path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"w" * 1000)
    run_ckptfs("commit", str(ckpt), check=True)

    m = scrape(a)
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

    b = make_mount(store, name="b", extra=ANY_PORT)
    assert metrics_address(b) != metrics_address(a)
    assert (b.path / "model.bin").read_bytes() == data
    assert (b.path / "copy.bin").read_bytes() == data
    m = scrape(b)
    assert m[("ckptfs_fetched_bytes_total", ())] >= size
    assert m[("ckptfs_cache_misses_total", ())] >= 1
    assert m[("ckptfs_cache_hits_total", ())] >= 1          # copy.bin: same chunks
    assert m[("ckptfs_cache_bytes", ())] >= size
    assert m[("ckptfs_corrupt_chunks_total", ())] == 0
    assert m[("ckptfs_uploaded_bytes_total", ())] == 0


@pytest.mark.expect_log_errors(r"failed verification", r"injected transient fault")
def test_metrics_count_store_errors_and_corrupt_chunks(local_store, make_mount, tmp_path):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"rules": []}))
    a = make_mount(local_store, name="a")
    data = os.urandom(100_000)
    (a.path / "f.bin").write_bytes(data)
    b = make_mount(local_store, name="b", faults={"control_file": str(control)},
                   extra=ANY_PORT)
    control.write_text(json.dumps({"rules": [
        {"op": "get", "prefix": "chunks/", "kind": "corrupt", "times": 1},
        {"op": "put_if_absent", "prefix": "dirs/", "kind": "transient", "times": 1}]}))
    assert (b.path / "f.bin").read_bytes() == data          # refetched after the bad one
    (b.path / "g.bin").write_bytes(b"g")                    # one retried PUT
    m = scrape(b)
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
