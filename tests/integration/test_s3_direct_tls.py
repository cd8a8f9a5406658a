"""The direct S3 client (``store/s3_http.py``) over HTTPS trusts the certificates boto3
trusts: an endpoint whose certificate is signed by a private CA named in
``AWS_CA_BUNDLE`` (on-premises S3 behind TLS) must work for PUT and GET as it works for
boto3's HEAD and LIST.  A real SeaweedFS behind a loopback TLS terminator."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import subprocess
import threading
import uuid

from support.mounts import BUCKET
from ckptfs.store import S3Store


class TLSFront:
    """Accepts TLS on 127.0.0.1 with a self-signed certificate and forwards the plain
    bytes to ``target_port``."""

    def __init__(self, target_port: int, cert: str, key: str) -> None:
        self.target_port = target_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self.listener.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass


def test_https_endpoint_signed_by_a_private_ca_in_aws_ca_bundle(seaweed, tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True,
                   capture_output=True)
    front = TLSFront(seaweed.s3_port, str(cert), str(key))
    try:
        for name, value in seaweed.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
        store = S3Store(BUCKET, uuid.uuid4().hex[:12], f"https://127.0.0.1:{front.port}",
                        timeout=10.0)
        assert not store.exists("chunks/ab/x")          # boto3 trusts the bundle
        data = os.urandom(1 << 20)
        etag = store.put("chunks/ab/x", memoryview(data),
                         sha256=hashlib.sha256(data).hexdigest())
        assert store.get("chunks/ab/x") == (data, etag)
        buf = bytearray(len(data))
        assert store.get_into("chunks/ab/x", buf) == (len(data), etag)
        assert buf == data
    finally:
        front.close()
