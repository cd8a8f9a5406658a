"""How fast is the S3 server itself on this machine?  Starts a private SeaweedFS on
loopback and measures, with plain boto3 and no ckptfs: PUT of 1 GiB as 8 MiB objects
(8 threads), GET of those objects (8 and 16 threads), and boto3's download_file of a
1 GiB object.  The bound behind ckptfs's write ratios (see docs/decisions/0002).

    .venv/bin/python tools/s3_ceiling.py
"""

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from ckptfs.bench.seaweed import SeaweedServer

MiB = 1 << 20


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="ckptfs-s3-ceiling-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    try:
        server.create_bucket("ceiling")
        env = server.env()
        client = boto3.client("s3", endpoint_url=server.endpoint_url,
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                              region_name="us-east-1",
                              config=Config(max_pool_connections=32,
                                            request_checksum_calculation="when_required",
                                            response_checksum_validation="when_required"))
        blobs = [os.urandom(8 * MiB) for _ in range(4)]
        keys = [f"c{i}" for i in range(128)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: client.put_object(Bucket="ceiling", Key=k,
                                                      Body=blobs[int(k[1:]) % 4]), keys))
        print(f"PUT 1 GiB as 8 MiB objects, 8 threads: {1024 / (time.perf_counter() - t0):.0f} MiB/s")
        for threads in (8, 16):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: client.get_object(Bucket="ceiling", Key=k)["Body"].read(),
                              keys))
            print(f"GET the same, {threads} threads: {1024 / (time.perf_counter() - t0):.0f} MiB/s")
        big = work / "big"
        big.write_bytes(os.urandom(1024 * MiB))
        cfg = TransferConfig(multipart_chunksize=8 * MiB, max_concurrency=10)
        client.upload_file(str(big), "ceiling", "big", Config=cfg)
        t0 = time.perf_counter()
        client.download_file("ceiling", "big", str(work / "dl"), Config=cfg)
        print(f"download_file 1 GiB, 10 threads: {1024 / (time.perf_counter() - t0):.0f} MiB/s")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
