"""Local-first holds for every way the store goes away, and nothing journaled is ever
dropped (issue 21, items 1 and 10; decision 0016, the fault model).

An async node whose store refuses connections, resets them, answers 503, 403
(``AccessDenied``: credentials rotated, a token expired) or 404 ``NoSuchBucket`` keeps
saving, renaming and sealing on the node; ``ckptfs wait`` does not say done while
anything is pending and names the outage; once the store answers again everything
reaches it, and a fresh node sees it all."""

from __future__ import annotations

import json
import os

import pytest

from support.mounts import eventually, fresh, run_ckptfs

MiB = 1 << 20

OUTAGE_ERRORS = (r"store error: ", r"store timeout: ", r"failed after \d+ attempts",
                 r"store unavailable", r"access denied", r"does not exist",
                 r"lost its marker")


def save_run(root, weights: bytes) -> None:
    """What a training job does meanwhile: a file, a directory renamed into place, an
    HF-style checkpoint written in place and sealed by ``trainer_state.json``."""
    run = root / "run"
    (run / "new.bin").write_bytes(b"new")
    tmp = run / "tmp-1"
    tmp.mkdir()
    (tmp / "model.bin").write_bytes(weights)
    os.rename(tmp, run / "ckpt-1")
    hf = run / "checkpoint-7"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(weights[:MiB])
    (hf / "trainer_state.json").write_text("{}")


def check_run(root, weights: bytes, sealed: bool = True) -> None:
    """``sealed``: the in-place checkpoint's seal has reached the store (until then it is
    staged: unlisted, reachable by its name, decision 0012)."""
    run = root / "run"
    listed = ["checkpoint-7", "ckpt-1", "new.bin"] if sealed else ["ckpt-1", "new.bin"]
    assert sorted(os.listdir(run)) == listed, os.listdir(run)
    assert (run / "new.bin").read_bytes() == b"new"
    assert (run / "ckpt-1" / "model.bin").read_bytes() == weights
    assert (run / "checkpoint-7" / "model.safetensors").read_bytes() == weights[:MiB]
    assert sorted(os.listdir(run / "checkpoint-7")) == ["model.safetensors",
                                                         "trainer_state.json"]


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS)
@pytest.mark.parametrize("fault", ["403", "nobucket", "refuse", "503"])
def test_async_work_survives_any_store_outage(fault, store_proxy, s3_store, make_mount):
    mnt = make_mount(store_proxy, durability="async",
                     extra=("--store-timeout", "3", "--metadata-ttl", "0.2"))
    root = mnt.path
    (root / "run").mkdir()
    run_ckptfs("wait", str(root), check=True, timeout=60)

    store_proxy.proxy.mode = fault
    weights = os.urandom(3 * MiB)
    save_run(root, weights)           # every step succeeds on the node
    check_run(root, weights, sealed=False)

    waited = run_ckptfs("wait", str(root), "--timeout", "4", timeout=60)
    assert waited.returncode != 0, waited
    status = mnt.status()
    outage = status["fs"].get("store_unavailable")
    assert outage, status["fs"]
    assert "waiting" in outage, outage

    store_proxy.proxy.mode = "pass"
    run_ckptfs("wait", str(root), check=True, timeout=180)
    fs = mnt.status()["fs"]
    assert fs["pending_metadata"] == 0 and not fs.get("store_unavailable"), fs
    check_run(root, weights)

    other = make_mount(s3_store, name="fresh")
    assert eventually(lambda: (other.path / "run" / "checkpoint-7").exists()), \
        os.listdir(other.path / "run")
    check_run(other.path, weights)


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS)
def test_a_remount_during_an_access_denied_outage_keeps_the_journal(
        store_proxy, s3_store, make_mount):
    """Stopped while the store says 403: the journal stays; the next mount (whose
    check at start fails) ... is refused with one line, and the one after the outage
    replays everything."""
    mnt = make_mount(store_proxy, durability="async", extra=("--store-timeout", "3"))
    root = mnt.path
    (root / "run").mkdir()
    run_ckptfs("wait", str(root), check=True, timeout=60)
    store_proxy.proxy.mode = "403"
    weights = os.urandom(2 * MiB)
    save_run(root, weights)
    proc = run_ckptfs("umount", str(root), "--timeout", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stay journaled" in proc.stderr, proc.stderr
    store_proxy.proxy.mode = "pass"
    mnt.start("--store-timeout", "3", durability="async")
    run_ckptfs("wait", str(root), check=True, timeout=180)
    other = make_mount(s3_store, name="fresh")
    check_run(other.path, weights)
    assert json.loads(run_ckptfs("status", "--json", str(root), check=True).stdout)[
        "fs"]["pending_metadata"] == 0


def _client(seaweed):
    import boto3
    env = seaweed.env()
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        region_name=env["AWS_DEFAULT_REGION"])


def _empty_and_delete_bucket(seaweed, bucket: str) -> None:
    client = _client(seaweed)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


def _bucket_exists(seaweed, bucket: str) -> bool:
    client = _client(seaweed)
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except Exception:  # noqa: BLE001 - botocore's ClientError: no bucket
        return False


def _entry_keys(seaweed, bucket: str) -> list[str]:
    client = _client(seaweed)
    try:
        pages = list(client.get_paginator("list_objects_v2").paginate(Bucket=bucket))
    except Exception:  # noqa: BLE001 - botocore's ClientError: no bucket
        return []
    return [o["Key"] for p in pages for o in p.get("Contents", []) if "/dirs/" in o["Key"]]


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS, r"lost its marker", r"upload failed",
                               r"publish")
@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_bucket_deleted_under_the_mount_stops_publishing_loudly(durability, seaweed,
                                                                   make_mount):
    """SeaweedFS (like some S3 stores with auto-create) re-creates a deleted bucket on the
    next PUT: without a look for the store's marker, writes would go on into an empty
    store that lost ``ckptfs.json`` and every older entry (issue 21 item 11)."""
    from support.mounts import StoreSpec
    bucket = f"lost-{durability}"
    seaweed.create_bucket(bucket)
    spec = StoreSpec("s3", f"s3://{bucket}/p", env=seaweed.env(), seaweed=seaweed)
    mnt = make_mount(spec, durability=durability, extra=("--store-timeout", "3"))
    (mnt.path / "before.bin").write_bytes(b"before")
    run_ckptfs("wait", str(mnt.path), check=True, timeout=60)

    _empty_and_delete_bucket(seaweed, bucket)
    assert eventually(lambda: mnt.status()["fs"].get("store_unavailable"), timeout=40), \
        mnt.status()["fs"]
    assert "ckptfs.json" in mnt.status()["fs"]["store_unavailable"]

    if durability == "sync":
        with pytest.raises(OSError):          # close() says it is not saved
            (mnt.path / "after.bin").write_bytes(b"after")
    else:
        (mnt.path / "after.bin").write_bytes(b"after")     # kept on the node
        waited = run_ckptfs("wait", str(mnt.path), "--timeout", "4", timeout=60)
        assert waited.returncode != 0 and "ckptfs.json" in waited.stderr, waited.stderr
        assert (mnt.path / "after.bin").read_bytes() == b"after"
    assert _entry_keys(seaweed, bucket) == []       # nothing published into the new bucket
    log = (mnt.state_dir / "ckptfs.log").read_text()
    assert log.count("the store lost its marker ckptfs.json (the bucket was") == 1, log

    # A remount of this state dir refuses to start over an empty store (it would make a
    # new marker and publish into it as if nothing had been lost).
    run_ckptfs("umount", str(mnt.path), "--timeout", "3", check=True, timeout=120)
    seaweed.create_bucket(bucket) if not _bucket_exists(seaweed, bucket) else None
    proc = run_ckptfs("mount", str(mnt.path), "--store", spec.url, "--state-dir",
                      str(mnt.state_dir), "--durability", durability, env=spec.env)
    assert proc.returncode != 0, proc
    assert "lost its marker" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS, r"fetch", r"chunk")
@pytest.mark.parametrize("fault", ["403", "refuse", "503"])
def test_sync_mode_answers_what_it_knows_and_fails_an_uncached_read_in_bounded_time(
        fault, store_proxy, s3_store, make_mount):
    """Sync mode, the store away: listings and lookups of what the node knows answer from
    local metadata; a read that needs the store fails with EIO within store_timeout."""
    mnt = make_mount(store_proxy, extra=("--store-timeout", "3", "--metadata-ttl", "0.2"))
    writer = make_mount(s3_store, name="writer")
    (mnt.path / "run").mkdir()
    (mnt.path / "run" / "mine.bin").write_bytes(b"mine")
    (writer.path / "run" / "theirs.bin").write_bytes(os.urandom(MiB))
    assert eventually(lambda: "theirs.bin" in os.listdir(mnt.path / "run"))
    os.stat(mnt.path / "run" / "theirs.bin")

    store_proxy.proxy.mode = fault
    for _ in range(3):
        assert sorted(os.listdir(mnt.path / "run")) == ["mine.bin", "theirs.bin"]
        assert os.stat(mnt.path / "run" / "theirs.bin").st_size == MiB
        assert (mnt.path / "run" / "mine.bin").read_bytes() == b"mine"
    import time
    started = time.monotonic()
    with pytest.raises(OSError) as info:
        (mnt.path / "run" / "theirs.bin").read_bytes()
    took = time.monotonic() - started
    assert info.value.errno == 5, info.value
    print(f"uncached read with the store answering {fault}: EIO after {took:.1f} s")
    assert took < 3 + 30, took       # store_timeout, and a generous margin for the VM
    store_proxy.proxy.mode = "pass"
    assert len((mnt.path / "run" / "theirs.bin").read_bytes()) == MiB


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS)
@pytest.mark.parametrize("content", [b"", b'{"hidden_size": 8}\n'], ids=["empty", "same"])
def test_a_late_removal_leaves_another_nodes_save_of_the_same_bytes(store, make_mount,
                                                                    tmp_path, content):
    """Node A (async) removes ``run/_SUCCESS`` while the store refuses its deletes; node
    B then saves ``run/_SUCCESS`` again with the same bytes and is told it is saved.
    When A's removal reaches the store, B's save must stay: on B, on A, on a fresh node
    (decision 0016, stop 41: identities told the two saves apart by content only)."""
    control = tmp_path / "faults-a.json"
    control.write_text(json.dumps({"rules": []}))
    a = make_mount(store, name="a", durability="async", faults={"control_file": str(control)})
    b = make_mount(store, name="b", durability="async")
    (a.path / "run").mkdir()
    (a.path / "run" / "_SUCCESS").write_bytes(content)
    run_ckptfs("wait", str(a.path), check=True, timeout=120)
    assert (b.path / "run" / "_SUCCESS").read_bytes() == content
    control.write_text(json.dumps({"rules": [{"op": "delete", "kind": "transient"}]}))
    os.unlink(a.path / "run" / "_SUCCESS")
    assert run_ckptfs("wait", str(a.path), "--timeout", "2").returncode != 0, \
        "A said its removal was in the store while the store refused it"
    with open(b.path / "run" / "_SUCCESS", "wb") as f:       # B's view: still there
        f.write(content)
    run_ckptfs("wait", str(b.path), check=True, timeout=120)
    control.write_text(json.dumps({"rules": []}))
    run_ckptfs("wait", str(a.path), check=True, timeout=120)
    for node in (b, fresh(make_mount, store)):
        assert sorted(os.listdir(node.path / "run")) == ["_SUCCESS"], node.name
        assert (node.path / "run" / "_SUCCESS").read_bytes() == content
    eventually(lambda: sorted(os.listdir(a.path / "run")) == ["_SUCCESS"], timeout=30)


@pytest.mark.expect_log_errors(*OUTAGE_ERRORS)
@pytest.mark.parametrize("crash", [False, True], ids=["", "A SIGKILLed meanwhile"])
def test_a_late_rename_leaves_another_nodes_newer_save(store, make_mount, tmp_path, crash):
    """Node A (async) renames ``run/tmp`` over ``run/model.bin`` while the store refuses
    its writes; node B then saves ``run/model.bin`` and is told it is saved.  When A's
    rename reaches the store, B's save stays under the name and ``tmp`` is gone -- the
    serial order "A renames, then B saves over the name" -- on A, on B, on a fresh node
    (decision 0016; before, the late move wrote over B's save).  Also when A's daemon
    is SIGKILLed with the move pending and started again on its state."""
    control = tmp_path / "faults-a.json"
    control.write_text(json.dumps({"rules": []}))
    a = make_mount(store, name="a", durability="async", faults={"control_file": str(control)})
    b = make_mount(store, name="b", durability="async")
    (a.path / "run").mkdir()
    (a.path / "run" / "model.bin").write_bytes(b"the version both nodes know")
    (a.path / "run" / "tmp").write_bytes(b"A's renamed file")
    run_ckptfs("wait", str(a.path), check=True, timeout=120)
    assert (b.path / "run" / "model.bin").read_bytes() == b"the version both nodes know"
    control.write_text(json.dumps({"rules": [{"op": "put", "kind": "transient"}]}))
    os.rename(a.path / "run" / "tmp", a.path / "run" / "model.bin")
    assert run_ckptfs("wait", str(a.path), "--timeout", "2").returncode != 0, \
        "A said its rename was in the store while the store refused it"
    (b.path / "run" / "model.bin").write_bytes(b"B's newer save")
    run_ckptfs("wait", str(b.path), check=True, timeout=120)
    if crash:
        a.kill()
    control.write_text(json.dumps({"rules": []}))
    if crash:
        a.start(durability="async")
    run_ckptfs("wait", str(a.path), check=True, timeout=120)

    def shows_b(node) -> bool:
        return sorted(os.listdir(node.path / "run")) == ["model.bin"] and \
            (node.path / "run" / "model.bin").read_bytes() == b"B's newer save"
    for node in (a, b, fresh(make_mount, store)):
        assert eventually(lambda: shows_b(node), timeout=30), \
            (node.name, sorted(os.listdir(node.path / "run")))
