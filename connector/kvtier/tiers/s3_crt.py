"""S3 tier on awscrt's native ``S3Client`` for the data path (GET, PUT, HEAD).

It costs about half the client CPU of boto3 per small object on this RGW (docs/benchmarks.md):
the request loop runs in C threads, not in Python. Listing and batch deletes (``kvtier ls`` /
``purge``) go through the boto3 tier, which also resolves the endpoint and credentials the same
way for both clients.

awscrt pitfalls handled here (measured on Ceph 16 RGW, see platform notes): it has no addressing
logic (we build ``/bucket/key`` and the Host header), its TLS mode is not taken from the URL
(disabled explicitly for http), unsigned requests go out anonymous (always sign), and this Ceph
rejects trailing streaming checksums (we request no checksum; kvtier's own header checksum
covers the payload end to end).
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import quote, urlparse

from kvtier.config import ConfigError, KvtierConfig
from kvtier.format import CHUNK_LIST_META, HEADER_SIZE, decode_chunk_list
from kvtier.tiers.base import ChunkReader, Stored, Tier, TierError
from kvtier.tiers.s3_boto3 import Boto3S3Tier, frozen_credentials


def _s3_error_code(exc: BaseException) -> str | None:
    """The S3 error code of a refused request (``<Code>`` of its XML body, as boto3 reports
    it): a 403 may be refused credentials or a full quota, which must not be told apart by
    status alone."""
    body = getattr(exc, "body", None)
    if not body:
        return None
    found = re.search(rb"<Code>([A-Za-z0-9_.-]{1,64})</Code>", bytes(body))
    return found.group(1).decode() if found else None


def _crt_cause(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    if status:
        return f"http_{status}"
    name = str(getattr(exc, "name", "") or type(exc).__name__)
    if "TIMEOUT" in name:
        return "timeout"
    if "CONNECTION_REFUSED" in name or "SOCKET" in name or "DNS" in name:
        return "connection"
    return name


class _Pending:
    """One in-flight request: collects the body (header split off) and the final status."""

    def __init__(self, method: str, okey: str) -> None:
        self.method = method
        self.okey = okey
        self.request: Any = None
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self._header = b""
        self._parts: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def on_body(self, chunk: Any, offset: int, **_: Any) -> None:
        # The buffer is only valid during the callback: copy it once, splitting the header off
        # here so the payload needs no second copy (a small object arrives in one callback).
        view = memoryview(chunk)
        with self._lock:
            if offset < HEADER_SIZE:
                cut = HEADER_SIZE - offset
                self._header += bytes(view[:cut])
                if len(view) > cut:
                    self._parts[0] = bytes(view[cut:])
            else:
                self._parts[offset - HEADER_SIZE] = bytes(view)

    def on_headers(self, status_code: int, headers: Any, **_: Any) -> None:
        self.headers = {str(k).lower(): str(v) for k, v in headers}

    def on_done(
        self, error: BaseException | None, status_code: int | None = None, **_: Any
    ) -> None:
        self.status = status_code

    def stored(self) -> Stored:
        with self._lock:
            parts = self._parts
            if len(parts) <= 1:
                return self._header, parts.get(0, b"")
            return self._header, b"".join(parts[o] for o in sorted(parts))


class CrtS3Tier(Tier):
    name = "s3"
    remote = True

    def __init__(
        self,
        admin: Boto3S3Tier,
        endpoint_url: str,
        region: str,
        credentials: tuple[str, str, str | None],
        timeout: float,
        concurrency: int,
        part_size: int = 64 << 20,
        reads_via_boto3: bool = False,
    ) -> None:
        from awscrt.auth import (
            AwsCredentialsProvider,
            AwsSignatureType,
            AwsSignedBodyHeaderType,
            AwsSignedBodyValue,
            AwsSigningAlgorithm,
            AwsSigningConfig,
        )
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode

        self._admin = admin
        self._reads_via_boto3 = reads_via_boto3
        self.bucket = admin.bucket
        self.prefix = admin.prefix
        self._timeout = timeout
        url = urlparse(endpoint_url)
        self._host = url.netloc
        self._base = url.path.rstrip("/")
        elg = EventLoopGroup(2)
        bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
        self._signing = AwsSigningConfig(
            algorithm=AwsSigningAlgorithm.V4,
            signature_type=AwsSignatureType.HTTP_REQUEST_HEADERS,
            credentials_provider=AwsCredentialsProvider.new_static(*credentials),
            region=region,
            service="s3",
            # RGW verifies x-amz-content-sha256; UNSIGNED_PAYLOAD avoids hashing every body in
            # the client while kvtier's header checksum still protects the payload.
            signed_body_value=AwsSignedBodyValue.UNSIGNED_PAYLOAD,
            signed_body_header_type=AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
        )
        self._client = S3Client(
            bootstrap=bootstrap,
            region=region,
            tls_mode=(
                S3RequestTlsMode.DISABLED if url.scheme == "http" else S3RequestTlsMode.ENABLED
            ),
            signing_config=self._signing,
            part_size=part_size,
            multipart_upload_threshold=part_size,
            # throughput target sizes the connection pool; ~1 Gbps matches what RGW on this
            # class of machine sustains (measured), max_active caps it at the configured limit.
            throughput_target_gbps=1.0,
            max_active_connections_override=max(1, concurrency),
            connect_timeout_ms=int(timeout * 1000),
        )

    @classmethod
    def from_config(cls, cfg: KvtierConfig, reads_via_boto3: bool = False) -> CrtS3Tier:
        """``reads_via_boto3``: GET and HEAD through boto3, PUT through awscrt (``auto``)."""
        frozen = frozen_credentials(cfg)
        if frozen is None:
            raise ConfigError(
                f"no S3 credentials for the S3 tier in {cfg.source}: set key 'aws_profile' to a "
                "profile with aws_access_key_id/aws_secret_access_key"
            )
        admin = Boto3S3Tier.from_config(cfg)
        return cls(
            admin,
            admin.endpoint_url,
            cfg.extra_config.s3_region,
            (frozen.access_key, frozen.secret_key, frozen.token),
            cfg.blocking_timeout_secs,
            min(cfg.extra_config.s3_max_io_concurrency, 64),
            reads_via_boto3=reads_via_boto3,
        )

    def object_key(self, key: str) -> str:
        return self._admin.object_key(key)

    def _start(
        self,
        method: str,
        okey: str,
        body: bytes | ChunkReader | None = None,
        chunk_list: str = "",
    ) -> _Pending:
        """Send one request for object key ``okey`` (already prefixed); don't wait."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3RequestType

        path = f"{self._base}/{self.bucket}/{quote(okey, safe='/~')}"
        headers = HttpHeaders([("Host", self._host)])
        if chunk_list:
            headers.add(f"x-amz-meta-{CHUNK_LIST_META}", chunk_list)
        stream = None
        if body is not None:
            headers.add("Content-Length", str(len(body)))
            headers.add("Content-Type", "application/octet-stream")
            stream = body if isinstance(body, ChunkReader) else io.BytesIO(body)
        request = HttpRequest(method, path, headers, stream)
        kind = {"GET": S3RequestType.GET_OBJECT, "PUT": S3RequestType.PUT_OBJECT}.get(
            method, S3RequestType.DEFAULT
        )
        pending = _Pending(method, okey)
        pending.request = self._client.make_request(
            type=kind,
            request=request,
            operation_name="HeadObject" if method == "HEAD" else None,
            on_headers=pending.on_headers if method == "HEAD" else None,
            on_body=pending.on_body if method == "GET" else None,
            on_done=pending.on_done,
        )
        return pending

    def _finish(self, pending: _Pending) -> tuple[int, Stored | None]:
        """Wait for a request; return (status, body). 404 is returned, other failures raise."""
        where = f"S3 {pending.method} s3://{self.bucket}/{pending.okey}"
        try:
            pending.request.finished_future.result(timeout=self._timeout)
        except FutureTimeout as exc:
            pending.request.cancel()
            raise TierError("timeout", f"{where} timed out") from exc
        except Exception as exc:  # the future carries the request's failure
            status = getattr(exc, "status_code", None) or pending.status
            if status == 404:
                return 404, None
            cause = _s3_error_code(exc) or (f"http_{status}" if status else _crt_cause(exc))
            raise TierError(cause, f"{where}: {exc}") from exc
        if pending.method != "GET":
            return pending.status or 200, None
        return pending.status or 200, pending.stored()

    def _request(
        self, method: str, key: str, body: bytes | ChunkReader | None = None, chunk_list: str = ""
    ) -> tuple[int, Stored | None]:
        return self._finish(self._start(method, self.object_key(key), body, chunk_list))

    def raw_batch(self, op: str, object_keys: Sequence[str], body: bytes) -> int:
        """Benchmark helper: every request in flight at once, as awscrt is meant to be used.

        Object keys are used as given (no prefix). Returns the number of failed requests.
        """
        method = "PUT" if op == "put" else "GET"
        pending = [self._start(method, k, body if method == "PUT" else None) for k in object_keys]
        errors = 0
        for p in pending:
            try:
                status, data = self._finish(p)
            except TierError:
                errors += 1
                continue
            got = 0 if data is None else len(data[0]) + len(data[1])
            if status == 404 or (method == "GET" and got != len(body)):
                errors += 1
        return errors

    def head(self, key: str) -> list[str] | None:
        if self._reads_via_boto3:
            return self._admin.head(key)
        pending = self._start("HEAD", self.object_key(key))
        status, _ = self._finish(pending)
        if status == 404:
            return None
        return decode_chunk_list(pending.headers.get(f"x-amz-meta-{CHUNK_LIST_META}"))

    def contains(self, key: str) -> bool:
        return self.head(key) is not None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._admin.map_keys(self.contains, keys)

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        return self._admin.map_keys(self.head, keys)

    def get(self, key: str) -> Stored | None:
        if self._reads_via_boto3:
            return self._admin.get(key)
        status, data = self._request("GET", key)
        return None if status == 404 else data

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self.put_object(key, (header, payload), "")

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        self._request("PUT", key, ChunkReader(*parts), chunk_list)

    def delete(self, key: str) -> None:
        self._admin.delete(key)

    def probe(self) -> None:
        self._admin.probe()

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self._admin.list_keys(prefix)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._admin.delete_many(keys)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int, float]]:
        return self._admin.list_objects(prefix)

    def touch(self, key: str) -> None:
        self._admin.touch(key)

    def close(self) -> None:
        self._admin.close()
