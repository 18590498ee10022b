"""The S3 tier on boto3: an object per chunk, or per run of chunks, under ``<prefix>/<key>``;
also the boto3 client (endpoint, credentials, timeouts) that the awscrt tier, ``kvtier
doctor``, ``ls`` and ``purge`` use. What both S3 clients share is described in
:mod:`kvtier.tiers.s3`.

boto3 is imported lazily: only processes with the S3 tier on pay for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from kvtier.config import ConfigError, KvtierConfig
from kvtier.format import CHUNK_LIST_META, HEADER_SIZE, decode_chunk_list
from kvtier.tiers.base import ChunkReader, Stored, Tier, TierError

log = logging.getLogger(__name__)
T = TypeVar("T")


#: A connection to an S3 endpoint on the local network that takes longer than this is to a dead
#: or partitioned host: give up and let the circuit breaker count it.
CONNECT_TIMEOUT_SECS = 2.0
#: HEADs (lookups, probes) answer in milliseconds; one that takes longer waits on a hung endpoint.
#: A ``lookup_timeout_secs`` above it raises it: a lookup may wait that long, so its HEADs may too
#: (a HEAD given up at 2 s under a 5 s budget was a miss the operator had allowed for; seen in CI
#: with RGW on two busy cores).
HEAD_TIMEOUT_SECS = 2.0


def s3_client_config(cfg: KvtierConfig, pool: int, *, head: bool = False) -> Any:
    """Data client: reads of up to ``blocking_timeout_secs``, one retry. HEAD client
    (``head``): short reads, no retry. Failures beyond these are the circuit breaker's
    (kvtier.tiers.guard), not more waiting: a retry of a hung call only doubles the wait."""
    from botocore.config import Config

    timeout = cfg.blocking_timeout_secs
    return Config(
        region_name=cfg.extra_config.s3_region,
        s3={"addressing_style": "path"},
        signature_version="s3v4",
        connect_timeout=min(timeout, CONNECT_TIMEOUT_SECS),
        read_timeout=min(timeout, max(HEAD_TIMEOUT_SECS, cfg.lookup_timeout_secs))
        if head
        else timeout,
        retries={"max_attempts": 1 if head else 2, "mode": "standard"},
        max_pool_connections=pool,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def _session(cfg: KvtierConfig) -> Any:
    import boto3
    from botocore.exceptions import ProfileNotFound

    try:
        return boto3.session.Session(profile_name=cfg.aws_profile)
    except ProfileNotFound as exc:
        raise ConfigError(
            f"key 'aws_profile' in {cfg.source}: profile {cfg.aws_profile!r} not found in "
            f"~/.aws/config or ~/.aws/credentials (or $AWS_CONFIG_FILE / "
            f"$AWS_SHARED_CREDENTIALS_FILE) of this user"
        ) from exc


def _drop_expect_continue(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def _client(session: Any, cfg: KvtierConfig, pool: int, *, head: bool) -> Any:
    config = s3_client_config(cfg, pool, head=head)
    client = session.client("s3", endpoint_url=cfg.endpoint_url, config=config)
    # botocore sends PUTs with "Expect: 100-continue" and, when the server refuses one before
    # the body (NoSuchBucket, AccessDenied, quota), skips the body but keeps the connection.
    # Behind haproxy that connection then waits for the missing body bytes: the next request
    # on it either stalls to its read timeout or loses its first bytes, and RGW answers
    # MethodNotAllowed (boto/botocore#1863, #3755). Without the header a refused PUT sends
    # its body (at most one chunk) and the connection stays usable. The header is not signed.
    client.meta.events.register("before-send.s3", _drop_expect_continue)
    return client


def make_boto3_client(cfg: KvtierConfig, pool: int = 32, *, head: bool = False) -> Any:
    """A boto3 S3 client for ``cfg``; raises ConfigError naming the key to fix."""
    return _client(_session(cfg), cfg, pool, head=head)


def frozen_credentials(cfg: KvtierConfig) -> Any | None:
    """The access key, secret and token the profile of ``cfg`` resolves to (boto3's own chain:
    profile, environment, files), or None when it has none; raises ConfigError for a profile
    that does not exist. The awscrt client signs with these; ``kvtier doctor`` shows the key."""
    creds = _session(cfg).get_credentials()
    return None if creds is None else creds.get_frozen_credentials()


def error_cause(exc: BaseException) -> str:
    """A short counter label for an S3 client failure."""
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code") or "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if code and not code.isdigit() else f"http_{status or code}"
    if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):
        return "timeout"
    if isinstance(exc, ConnectionError):
        return "connection"
    if isinstance(exc, NoCredentialsError):
        return "no_credentials"
    return type(exc).__name__


class Boto3S3Tier(Tier):
    name = "s3"
    remote = True

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str,
        concurrency: int = 32,
        head_client: Any | None = None,
    ) -> None:
        self._client = client
        #: HEADs (lookups, probes) go through a client with short timeouts and no retry.
        self._head_client = head_client or client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(concurrency, 64)), thread_name_prefix="kvtier-s3"
        )

    @classmethod
    def from_config(cls, cfg: KvtierConfig) -> Boto3S3Tier:
        pool = cfg.extra_config.s3_max_io_concurrency
        if cfg.s3_bucket is None:
            raise ConfigError(f"key 'remote_url' in {cfg.source} is needed for the S3 tier")
        session = _session(cfg)
        clients = [_client(session, cfg, pool, head=head) for head in (False, True)]
        return cls(clients[0], cfg.s3_bucket, cfg.s3_prefix, pool, head_client=clients[1])

    @property
    def endpoint_url(self) -> str:
        return str(self._client.meta.endpoint_url)

    def object_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as exc:  # every client failure becomes a TierError with a cause
            raise TierError(error_cause(exc), f"S3 {what} s3://{self.bucket}/{key}: {exc}") from exc

    @staticmethod
    def _is_not_found(exc: BaseException) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def head(self, key: str) -> list[str] | None:
        """None when absent, else the object's chunk list ([] when it lists none)."""
        okey = self.object_key(key)
        try:
            resp = self._head_client.head_object(Bucket=self.bucket, Key=okey)
        except Exception as exc:
            if self._is_not_found(exc):
                return None
            raise TierError(error_cause(exc), f"S3 HEAD s3://{self.bucket}/{okey}: {exc}") from exc
        return decode_chunk_list(resp.get("Metadata", {}).get(CHUNK_LIST_META))

    def contains(self, key: str) -> bool:
        return self.head(key) is not None

    def map_keys(self, fn: Callable[[str], T], keys: Sequence[str]) -> list[T]:
        """``fn`` of each key, in parallel on this tier's thread pool, in order."""
        if len(keys) <= 1:
            return [fn(k) for k in keys]
        return list(self._pool.map(fn, keys))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.map_keys(self.contains, keys)

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        return self.map_keys(self.head, keys)

    def get(self, key: str) -> Stored | None:
        okey = self.object_key(key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=okey)
            body = resp["Body"]
            try:
                # two reads: the payload lands in its own bytes object, no copy to split it
                header: bytes = body.read(HEADER_SIZE)
                payload: bytes = body.read()
            finally:
                body.close()
            return header, payload
        except Exception as exc:
            if self._is_not_found(exc):
                return None
            raise TierError(error_cause(exc), f"S3 GET s3://{self.bucket}/{okey}: {exc}") from exc

    def probe(self) -> None:
        """HEAD the bucket (short timeout): raises TierError when it cannot be used."""
        self._call("HEAD", "", lambda: self._head_client.head_bucket(Bucket=self.bucket))

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self.put_object(key, (header, payload), "")

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        okey = self.object_key(key)
        meta = {CHUNK_LIST_META: chunk_list} if chunk_list else {}
        self._call(
            "PUT",
            okey,
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=okey, Body=ChunkReader(*parts), Metadata=meta
            ),
        )

    def delete(self, key: str) -> None:
        okey = self.object_key(key)
        self._call("DELETE", okey, lambda: self._client.delete_object(Bucket=self.bucket, Key=okey))

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Walks the bucket listing (paginated); keys are returned without the tier prefix."""
        for key, size, _ in self.list_objects(prefix):
            yield key, size

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int, float]]:
        full = self.object_key(prefix)
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    yield obj["Key"][strip:], int(obj["Size"]), obj["LastModified"].timestamp()
        except Exception as exc:
            raise TierError(error_cause(exc), f"S3 LIST s3://{self.bucket}/{full}: {exc}") from exc

    def list_dirs(self, prefix: str) -> list[str]:
        """The names one level below ``prefix`` (S3's common prefixes for the delimiter "/"),
        e.g. the layout fingerprints stored under a namespace."""
        full = self.object_key(prefix.rstrip("/")) + "/"
        paginator = self._client.get_paginator("list_objects_v2")
        names: list[str] = []
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    names.append(common["Prefix"][len(full) :].rstrip("/"))
        except Exception as exc:
            raise TierError(error_cause(exc), f"S3 LIST s3://{self.bucket}/{full}: {exc}") from exc
        return names

    def touch(self, key: str) -> None:
        """Copy the object onto itself (S3 has no touch): its metadata is read first, since a
        copy onto itself must replace it, and the copy is made only of the object that HEAD
        saw (``CopySourceIfMatch``), so a rewrite between the two keeps its own metadata. An
        object gone or rewritten meanwhile is left as it is. RGW shares the data of a copy in
        the same bucket."""
        from botocore.exceptions import ClientError

        okey = self.object_key(key)
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=okey)
            self._client.copy_object(
                Bucket=self.bucket,
                Key=okey,
                CopySource={"Bucket": self.bucket, "Key": okey},
                CopySourceIfMatch=head["ETag"],
                Metadata=head.get("Metadata", {}),
                MetadataDirective="REPLACE",
            )
        except Exception as exc:
            if self._is_not_found(exc) or (
                isinstance(exc, ClientError)
                and exc.response.get("Error", {}).get("Code") == "PreconditionFailed"
            ):
                return  # evicted by another writer, or rewritten: recent already
            raise TierError(error_cause(exc), f"S3 COPY s3://{self.bucket}/{okey}: {exc}") from exc

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete up to 1000 keys per request; return how many were deleted."""
        deleted = 0
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self.object_key(k)} for k in keys[i : i + 1000]]
            resp: dict[str, Any] = self._call(
                "DELETE",
                batch[0]["Key"],
                partial(
                    self._client.delete_objects,
                    Bucket=self.bucket,
                    Delete={"Objects": batch, "Quiet": True},
                ),
            )
            deleted += len(batch) - len(resp.get("Errors", []))
        return deleted

    def close(self) -> None:
        self._pool.shutdown(wait=True)
