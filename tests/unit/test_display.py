"""The human status summary names async mode's journaled metadata and the staging bound."""

from ckptfs.cli.display import status_text


def test_status_names_journaled_metadata_and_writers_waiting_for_uploads():
    doc = {"mountpoint": "/mnt/ckpt", "pid": 7, "node_id": "n1", "store": "s3://b/p",
           "durability": "async", "pending_bytes": 6 << 20,
           "fs": {"pending_uploads": 3, "pending_metadata": 2,
                  "failing_metadata": {"9": "EIO: store timeout: put dirs/root/x"},
                  "staged_bytes": 6 << 20, "max_staged": 4 << 20,
                  "writers_waiting_for_uploads": 1}}
    text = status_text(doc)
    assert "2 change(s) journaled" in text and "store timeout" in text
    assert "6.0 MiB closed, not uploaded (max 4.0 MiB); 1 writer(s) waiting" in text


def test_status_of_a_quiet_sync_mount_has_no_async_rows():
    doc = {"mountpoint": "/mnt/ckpt", "pid": 7, "durability": "sync",
           "fs": {"pending_uploads": 0, "max_staged": 4 << 20}}
    text = status_text(doc)
    assert "journaled" not in text and "closed, not uploaded" not in text


def test_status_says_when_async_uploads_give_way_to_a_writer():
    doc = {"mountpoint": "/mnt/ckpt", "pid": 7, "durability": "async",
           "pending_bytes": 6 << 20, "oldest_pending_s": 4.0,
           "fs": {"pending_uploads": 3, "uploads_held_for_writer_s": 3.5}}
    assert "giving way to a writer for" in status_text(doc)
    doc["fs"]["uploads_held_for_writer_s"] = 0.0
    assert "giving way" not in status_text(doc)


def test_status_shows_the_peers_bytes_from_them_and_from_the_store():
    doc = {"mountpoint": "/mnt/ckpt", "pid": 7, "durability": "sync", "fs": {},
           "peers": {"alive": 3, "listen": "10.0.0.5:7601", "bytes_from_peers": 48 << 20,
                     "bytes_from_store": 16 << 20, "fetch": {"errors": 2, "wrong": 1},
                     "serve": {"bytes": 32 << 20, "refused": 4}, "last_error": None}}
    text = status_text(doc)
    assert "peers       3 alive (serving on 10.0.0.5:7601)" in text
    assert "from peers 48.0 MiB, from the store 16.0 MiB; 2 peer error(s), 1 wrong" in text
    assert "served 32.0 MiB, refused 4" in text
    assert "relayed" not in text
    doc["peers"]["serve"]["relayed_bytes"] = 8 << 20          # served as a chunk's relay
    assert "served 32.0 MiB (relayed 8.0 MiB), refused 4" in status_text(doc)
    assert "peers" not in status_text({**doc, "peers": None})
