"""``S3Store``: an S3 bucket (and key prefix) through boto3, errors translated into the
store protocol's (transient, permanent, not found, precondition failed).  Object bytes
(PUT, GET) and HEAD go through the lean ``s3_http.ChunkHTTP`` where it can serve the endpoint
(decision 0014), boto3 otherwise.

Knows nothing above the store protocol; retries are ``retry.RetryingStore``'s.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .base import (AccessDenied, BucketMissing, ListedObject, NotFound, PreconditionFailed,
                   StoreError, TransientStoreError, copy_into)
from .s3_http import (UNSIGNED_PAYLOAD, ChunkHTTP, EndpointMismatch, b64_digest,
                      transfer_checksum)

CRC_HEADERS = ("x-amz-checksum-crc32c", "x-amz-checksum-crc32")

if TYPE_CHECKING:     # stubs from the test extra (types-boto3[s3]); boto3 ships none
    from boto3.session import Session
    from types_boto3_s3.type_defs import (DeleteObjectRequestTypeDef,
                                          ListObjectsV2RequestTypeDef,
                                          PutObjectRequestTypeDef)

log = logging.getLogger(__name__)

_BOTO3 = object()     # _via_direct: this call is boto3's to make


def _prehashed_signer() -> str:
    """Name of a SigV4 signer that reuses a body's sha256 when the request already
    carries it (``x-amz-checksum-sha256``: a chunk content-addressed by that digest), and
    sends the payload unsigned when a CRC header checks it instead (a BLAKE3-named
    chunk): over plain HTTP botocore would otherwise hash each 8 MiB body again.
    Registered once in botocore's table of signers, under our own name."""
    from botocore.auth import AUTH_TYPE_MAPS, S3SigV4Auth

    name = "s3v4-ckptfs-prehashed"
    if name not in AUTH_TYPE_MAPS:
        class PrehashedS3SigV4Auth(S3SigV4Auth):
            def payload(self, request):
                if not self._is_streaming_checksum_payload(request):
                    digest = request.headers.get("x-amz-checksum-sha256")
                    if digest:
                        return base64.b64decode(digest).hex()
                    if any(request.headers.get(h) for h in CRC_HEADERS):
                        return UNSIGNED_PAYLOAD      # the CRC checks the body instead
                return super().payload(request)

        AUTH_TYPE_MAPS[name] = PrehashedS3SigV4Auth
    return name


def _ca_bundle(session: Session) -> str | None:
    """The CA certificates file boto3's client verifies HTTPS endpoints with: botocore's
    ``ca_bundle`` setting (``AWS_CA_BUNDLE`` or the config file), else
    ``REQUESTS_CA_BUNDLE``, else botocore's default bundle (as botocore resolves it)."""
    from botocore.httpsession import get_cert_path

    configured = session._session.get_config_variable("ca_bundle") or \
        os.environ.get("REQUESTS_CA_BUNDLE")
    if configured:
        return str(configured)      # get_cert_path returns a configured path as it is
    return get_cert_path(True)


class S3Store:
    """An S3 bucket (and optional key prefix) through boto3."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None,
                 max_pool: int = 32, timeout: float = 30.0, direct: bool = True) -> None:
        """``timeout`` is the overall budget of one call (``store_timeout``): one
        attempt's socket timeouts are scaled so that no attempt alone outlives it.
        ``direct``: PUT and GET of objects go through ``ChunkHTTP`` (decision 0014)
        where the endpoint allows it (no proxy configured for it)."""
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        session = boto3.session.Session()
        # Retries are ours (RetryingStore); botocore's own are kept to a single try so
        # that back-off and accounting happen in one place.
        self.client = session.client(
            "s3", endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 1, "mode": "standard"},
                          max_pool_connections=max_pool,
                          connect_timeout=min(5.0, max(0.5, timeout / 4)),
                          read_timeout=min(30.0, max(0.5, timeout / 2)),
                          signature_version=_prehashed_signer(),
                          s3={"addressing_style": "path"},
                          # Chunks are verified end to end against their sha256; an extra
                          # CRC32 over every body in Python costs CPU the FUSE loop needs.
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"),
        )
        self.direct: ChunkHTTP | None = None
        endpoint = self.client.meta.endpoint_url
        if direct and ChunkHTTP.usable_for(endpoint):
            credentials = session.get_credentials()
            self.direct = ChunkHTTP(
                endpoint, bucket, self.client.meta.region_name or "us-east-1",
                lambda: self._frozen(credentials), self.classify,
                timeout=min(30.0, max(0.5, timeout / 2)), keep=max_pool,
                ca_bundle=_ca_bundle(session))

    @staticmethod
    def _frozen(credentials):
        if credentials is None:
            raise StoreError("no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                             "AWS_SECRET_ACCESS_KEY or a profile)")
        return credentials.get_frozen_credentials()

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _translate(self, exc: Exception, key: str) -> StoreError:
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConn,
                                         NoCredentialsError)
        if isinstance(exc, NoCredentialsError):
            return StoreError("no AWS credentials found (set AWS_ACCESS_KEY_ID/"
                              "AWS_SECRET_ACCESS_KEY or a profile)")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return self.classify(str(err.get("Code", "")), status,
                                 str(err.get("Message", "")), key)
        if isinstance(exc, (BotoConn, BotoCoreError, OSError)):
            return TransientStoreError(f"{type(exc).__name__}: {exc}")
        return StoreError(f"{type(exc).__name__}: {exc}")

    def classify(self, code: str, status: int, message: str, key: str) -> StoreError:
        """An S3 error (its ``Code``, HTTP status and ``Message``) in the store's terms;
        the one mapping for boto3's errors and ``ChunkHTTP``'s."""
        if code in ("PreconditionFailed", "412") or status == 412:
            return PreconditionFailed(key)
        if code == "NoSuchBucket":
            return BucketMissing(f"bucket {self.bucket!r} does not exist")
        if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and not code):
            return NotFound(key)
        if code in ("ConditionalRequestConflict", "OperationAborted"):
            # A conditional write met a concurrent one: S3 says retry.
            return TransientStoreError(f"{code} on {key}")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                    "403", "InvalidToken", "ExpiredToken") or (status == 403 and not code):
            return AccessDenied(f"access denied by the store ({code or status}): check "
                                "credentials")
        # BadDigest / XAmzContentSHA256Mismatch: the body arrived different from what was
        # sent (the transfer checksum caught it); the next attempt resends the buffer.
        if status >= 500 or status in (408, 429) or code in ("SlowDown", "Throttling",
                                                               "RequestTimeout",
                                                               "InternalError",
                                                               "ServiceUnavailable",
                                                               "BadDigest",
                                                               "XAmzContentSHA256Mismatch"):
            return TransientStoreError(f"{code or status} on {key}")
        return StoreError(f"{code or status}: {message} ({key})")

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - translated below
            err = self._translate(exc, "")
            if isinstance(err, NotFound):
                raise BucketMissing(f"bucket {self.bucket!r} does not exist") from None
            if isinstance(err, TransientStoreError):
                raise StoreError(f"store unreachable: {err}") from None
            raise err from None

    def put(self, key: str, data: bytes, sha256: str | None = None, *,
            if_match: str | None = None) -> str:
        try:
            return self._put(key, data, sha256, if_match)
        except NotFound:
            if if_match is None:
                raise
            # An endpoint may answer a conditional PUT on a missing key 404 NoSuchKey
            # (SeaweedFS answers 412): the store's contract is PreconditionFailed, which
            # every caller's compare-and-swap handles (it reads the entry again).
            raise PreconditionFailed(key) from None

    def _put(self, key: str, data: bytes, sha256: str | None, if_match: str | None) -> str:
        if self.direct is not None:
            done = self._via_direct(lambda d: d.put(self._k(key), data, sha256, if_match))
            if done is not _BOTO3:
                return done
        if not isinstance(data, bytes):
            data = bytes(data)
        request: PutObjectRequestTypeDef = {"Bucket": self.bucket, "Key": self._k(key),
                                            "Body": data}
        if sha256 is not None:
            request["ChecksumSHA256"] = b64_digest(sha256)
        else:       # the signer sends it unsigned: no sha256 pass over the body
            name, value = transfer_checksum(data)
            if name.endswith("crc32c"):
                request["ChecksumCRC32C"] = value
            else:
                request["ChecksumCRC32"] = value
        if if_match is not None:
            request["IfMatch"] = if_match
        try:
            r = self.client.put_object(**request)
            return r.get("ETag", "")
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        # The direct client when there is one: a new name's entry is created this way
        # at every first publish, and boto3 spends ~1.5 ms more CPU per request.  It
        # sends a CRC of the body, as the boto3 path below does.
        try:
            done = self._via_direct(lambda d: d.put(self._k(key), data, None,
                                                    if_none_match=True))
        except PreconditionFailed:
            return None
        if done is not _BOTO3:
            return done or '"?"'
        from botocore.exceptions import ClientError
        # A checksum header of the body, always: without one a store may take a PUT
        # whose writer died after its head for a complete EMPTY object (SeaweedFS did:
        # an empty directory entry after a SIGKILL; tests/integration/
        # test_store_conditional.py).
        name, value = transfer_checksum(data)
        checksum: dict[str, str] = ({"ChecksumCRC32C": value} if name.endswith("crc32c")
                                    else {"ChecksumCRC32": value})
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data,
                                       IfNoneMatch="*", **checksum)  # type: ignore[arg-type]
            return r.get("ETag") or '"?"'
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return None
            if code == "ConditionalRequestConflict" or status == 409:
                raise TransientStoreError(f"conditional write conflict on {key}") from None
            raise self._translate(exc, key) from None
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def get(self, key: str) -> tuple[bytes, str]:
        done = self._via_direct(lambda d: d.get(self._k(key)))
        if done is not _BOTO3:
            return done
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
            return r["Body"].read(), r.get("ETag", "")
        except Exception as exc:  # noqa: BLE001
            raise self._translate(exc, key) from None

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        done = self._via_direct(lambda d: d.get_into(self._k(key), buffer))
        if done is not _BOTO3:
            return done
        return copy_into(self.get(key), buffer)

    def _via_direct(self, call):
        """``call(self.direct)``, or ``_BOTO3`` if the call is boto3's to make: there is
        no direct client, or the endpoint redirects (the bucket is in another region than
        configured), and from then on every call goes through boto3, which follows it."""
        direct = self.direct
        if direct is None:
            return _BOTO3
        try:
            return call(direct)
        except EndpointMismatch as why:
            if self.direct is not None:
                self.direct = None
                log.warning("the S3 endpoint redirects object requests (%s): moving "
                            "object bytes through boto3 from now on (set the bucket's "
                            "region to use the direct client)", why)
            return _BOTO3

    def exists(self, key: str) -> bool:
        try:
            done = self._via_direct(lambda d: d.head(self._k(key)))
        except NotFound:
            return False
        if done is not _BOTO3:
            return True
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except Exception as exc:  # noqa: BLE001
            err = self._translate(exc, key)
            if isinstance(err, NotFound):
                return False
            raise err from None

    def list(self, prefix: str) -> Iterator[ListedObject]:
        token: str | None = None
        while True:
            request: ListObjectsV2RequestTypeDef = {"Bucket": self.bucket,
                                                    "Prefix": self._k(prefix)}
            if token:
                request["ContinuationToken"] = token
            try:
                r = self.client.list_objects_v2(**request)
            except Exception as exc:  # noqa: BLE001
                raise self._translate(exc, prefix) from None
            for obj in r.get("Contents", []):
                modified = obj.get("LastModified")
                yield ListedObject(obj["Key"][len(self.prefix):], obj["Size"],
                                   obj.get("ETag", ""),
                                   modified.timestamp() if modified else 0.0)
            if not r.get("IsTruncated"):
                return
            token = r.get("NextContinuationToken")

    def delete(self, key: str, if_match: str | None = None) -> None:
        request: DeleteObjectRequestTypeDef = {"Bucket": self.bucket, "Key": self._k(key)}
        if if_match is not None:
            request["IfMatch"] = if_match
        try:
            self.client.delete_object(**request)
        except Exception as exc:  # noqa: BLE001
            err = self._translate(exc, key)
            if isinstance(err, NotFound) and if_match is not None:
                raise PreconditionFailed(key) from None
            if not isinstance(err, NotFound):
                raise err from None


