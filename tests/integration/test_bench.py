"""``ckptfs bench`` end to end on a tiny workload: the real CLI, real FUSE mounts (ckptfs
and the bare pyfuse3 passthrough baseline), the real SeaweedFS store.  Asserts what the
table reports, not how fast anything was."""

from __future__ import annotations

import os

from support.mounts import run_ckptfs

SYSTEMS = ["local", "passthrough", "boto3", "ckptfs-sync", "ckptfs-async"]


def table_rows(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("metric"))
    columns = header.split()[1:]
    rows = {}
    for line in lines[lines.index(header) + 1:]:
        if line.startswith("throughput"):
            break
        name, *cells = line.split()
        rows[name] = cells
    return columns, rows


def test_bench_table_has_passthrough_and_daemon_cpu(s3_store, tmp_path):
    work = tmp_path / "bench"
    proc = run_ckptfs("bench", "--store", s3_store.url, "--endpoint-url",
                      s3_store.seaweed.endpoint_url, "--rounds", "1", "--big-files", "1",
                      "--big-size", "24", "--small-files", "2", "--quick",
                      "--small-tree", "10",
                      "--ranks", "2", "--rank-size", "4",
                      "--work-dir", str(work), "--systems", *SYSTEMS,
                      env=s3_store.env, timeout=420)
    assert proc.returncode == 0, proc.stderr
    columns, rows = table_rows(proc.stdout)
    assert columns == SYSTEMS
    col = {name: i for i, name in enumerate(columns)}

    def cell(metric: str, system: str) -> float:
        return float(rows[metric][col[system]])   # "-" (no number) fails here

    # The passthrough baseline is measured like ckptfs: write, cold read, daemon CPU.
    for metric in ("blocked", "cold_read", "warm_read"):
        assert cell(metric, "passthrough") > 0
    for system in ("passthrough", "ckptfs-sync", "ckptfs-async"):
        assert cell("cpu_s_per_gib_write", system) >= 0
        assert cell("cpu_s_per_gib_cold_read", system) >= 0
        assert cell("peak_rss_mib", system) > 0
    # ckptfs hashes and uploads every byte: its daemon's CPU cannot read as zero.
    for system in ("ckptfs-sync", "ckptfs-async"):
        assert cell("cpu_s_per_gib_write", system) > 0
        assert cell("cpu_s_per_gib_cold_read", system) > 0
    assert rows["cpu_s_per_gib_write"][col["boto3"]] == "-"
    # The multi-rank save runs on local disk, the passthrough and both ckptfs modes.
    for system in ("local", "passthrough", "ckptfs-sync", "ckptfs-async"):
        assert cell("ranks_blocked", system) > 0
    assert rows["ranks_blocked"][col["boto3"]] == "-"
    assert "async: 2 ranks blocked / local disk" in proc.stdout
    # Daemon CPU per GiB written, split by where it went: every chunk was hashed.
    for system in ("ckptfs-sync", "ckptfs-async"):
        assert cell("cpu_s_per_gib_write_hash", system) > 0
        assert cell("cpu_s_per_gib_write_put", system) >= 0
        assert cell("cpu_s_per_gib_write_head", system) >= 0
        cell("cpu_s_per_gib_write_rest", system)       # a number (ticks: may round to 0)
    assert "sync:   of which naming chunks (hash)" in proc.stdout
    assert "async: blocked / passthrough blocked" in proc.stdout
    assert "sync: durable / parallel boto3 upload" in proc.stdout
    assert "sync: daemon CPU s/GiB write" in proc.stdout
    # Small files (issue 25): cp -a and tar x of a tree into each system, ratios printed.
    for system in ("local", "passthrough", "ckptfs-sync", "ckptfs-async"):
        assert cell("small_cp_a", system) > 0 and cell("small_tar_x", system) > 0
    assert "async: small files cp -a / passthrough" in proc.stdout
    assert "sync: small files tar x / passthrough" in proc.stdout
    # The bench leaves no mount behind, and no scratch file of its memory priming.
    assert not any(os.path.ismount(p) for p in work.glob("mnt-*"))
    assert not (work / ".prime").exists()


def test_bench_of_small_trees_only_and_of_nothing(s3_store, tmp_path):
    """``--big-files 0 --small-files 0``: no checkpoint, only the small trees (this
    divided by the empty workload's size); all three 0: one line, exit non-zero."""
    store = ("--store", s3_store.url, "--endpoint-url", s3_store.seaweed.endpoint_url)
    proc = run_ckptfs("bench", *store, "--rounds", "1", "--big-files", "0", "--small-files",
                      "0", "--ranks", "0", "--quick", "--small-tree", "10",
                      "--work-dir", str(tmp_path / "bench"),
                      "--systems", "local", "ckptfs-async", env=s3_store.env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    columns, rows = table_rows(proc.stdout)
    assert columns == ["local", "ckptfs-async"]
    assert set(rows) == {"small_cp_a", "small_tar_x"}
    assert all(float(cell) > 0 for cells in rows.values() for cell in cells)
    proc = run_ckptfs("bench", *store, "--big-files", "0", "--small-files", "0",
                      "--small-tree", "0", env=s3_store.env, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip() == ("ckptfs: bench: nothing to measure: --big-files, "
                                   "--small-files and --small-tree are all 0")
