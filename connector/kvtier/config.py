"""kvtier configuration: one YAML file (or an inline mapping), typed and validated at load.

Keys are LMCache-compatible where the meaning is the same (``chunk_size``, ``local_cpu``,
``max_local_cpu_size``, ``local_disk``, ``remote_url`` ... and ``extra_config.s3_*``), so an
operator's LMCache file loads as is. LMCache keys that mean nothing to kvtier are accepted with a
one-line warning naming them; a truly unknown key is an error that suggests the closest valid one.
Every error names the key and the file it came from.

Sources, in :func:`load_config`:

* ``None``: the path in ``$KVTIER_CONFIG``.
* a path: that YAML file.
* a mapping (vLLM's ``kv_connector_extra_config``): an optional ``config_file`` key naming the
  YAML file, plus inline keys that override the file's.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

ENV_VAR = "KVTIER_CONFIG"
INLINE_SOURCE = "kv_connector_extra_config"
_GIB = 1024**3


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the file and says what to change."""


@dataclass(frozen=True)
class S3Options:
    """``extra_config`` keys (LMCache names) that tune the S3 tier."""

    #: Concurrent S3 requests (thread pool / connection pool size of the S3 client).
    s3_max_io_concurrency: int = 32
    #: Background S3 writes allowed in flight; further writes are dropped (counted as
    #: ``backpressure``) instead of queueing without bound behind a slow bucket.
    s3_max_inflight_reqs: int = 256
    #: Region used for SigV4 signing (RGW accepts any; "default" is what Ceph docs use).
    s3_region: str = "us-east-1"
    #: Extra prefix under the bucket (LMCache's meaning), before kvtier's own layout.
    s3_file_prefix: str = ""


@dataclass(frozen=True)
class KvtierConfig:
    """Validated kvtier settings. Sizes are in GiB, as in LMCache."""

    #: Tokens per stored chunk. Must match between writers and readers (it is in the key).
    chunk_size: int = 256
    #: Keep chunks in process memory (a byte-capped LRU).
    local_cpu: bool = True
    #: CPU tier cap, GiB.
    max_local_cpu_size: float = 5.0
    #: Directory (e.g. the NVMe mount) for the disk tier; ``None`` disables it.
    #: LMCache's ``file:///path`` form is accepted.
    local_disk: str | None = None
    #: Disk tier cap, GiB.
    max_local_disk_size: float = 0.0
    #: ``s3://bucket/prefix``; ``None`` disables the S3 tier.
    remote_url: str | None = None
    #: Only ``naive`` (raw bytes) is supported.
    remote_serde: str = "naive"
    #: Also store the trailing chunk that is shorter than ``chunk_size``.
    save_unfull_chunk: bool = False
    #: Let the connector load KV asynchronously (the connector decides how).
    enable_async_loading: bool = False
    #: Timeout for one remote operation (connect + read), and the default flush timeout.
    blocking_timeout_secs: float = 10.0
    extra_config: S3Options = field(default_factory=S3Options)
    # ---- kvtier's own keys ----
    #: AWS profile (in ``~/.aws/credentials`` / ``~/.aws/config``) for the S3 tier.
    aws_profile: str | None = None
    #: S3 endpoint, e.g. ``http://127.0.0.1:7480`` for the local RGW. ``None``: the profile's
    #: ``endpoint_url`` or AWS.
    endpoint_url: str | None = None
    #: Tenant separation: chunks written under one namespace are never read under another.
    namespace: str = "default"
    #: Namespaces a request may choose instead of ``namespace``, with
    #: ``"kv_transfer_params": {"kvtier_namespace": "<name>"}`` in its body (kv_verify's
    #: round trips use this, so they never touch production chunks). A request naming any
    #: other namespace is served without kvtier, and a warning says why.
    request_namespaces: tuple[str, ...] = ()
    #: S3 client: ``boto3``, ``crt`` (awscrt S3Client) or ``auto`` (PUT via awscrt, GET/HEAD via
    #: boto3: the faster/cheaper one per operation as measured, see docs/benchmarks.md).
    s3_client: str = "auto"
    #: Directory where each process writes its stats snapshot (``kvtier stats`` reads it).
    #: Default: ``<local_disk>/.kvtier-stats`` when the disk tier is on, else off.
    stats_dir: str | None = None
    #: Seconds between stats snapshots written to ``stats_dir`` (also written at close).
    stats_interval_secs: float = 10.0
    #: TEST-ONLY switch: ``false`` skips payload checksum verification on read, so a negative
    #: control can show that corrupted data would otherwise reach the model. Never turn off
    #: in production.
    verify_checksums: bool = True
    #: Where the settings came from (for messages); not a config key.
    source: str = field(default="<defaults>", compare=False)

    # ---- derived values ----
    @property
    def cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * _GIB) if self.local_cpu else 0

    @property
    def disk_bytes(self) -> int:
        return int(self.max_local_disk_size * _GIB) if self.local_disk else 0

    @property
    def s3_bucket(self) -> str | None:
        return _parse_s3_url(self.remote_url)[0] if self.remote_url else None

    @property
    def s3_prefix(self) -> str:
        """Object key prefix in the bucket: url path, then ``s3_file_prefix``, no edge slashes."""
        if not self.remote_url:
            return ""
        parts = [_parse_s3_url(self.remote_url)[1], self.extra_config.s3_file_prefix]
        return "/".join(p.strip("/") for p in parts if p.strip("/"))

    @property
    def stats_path(self) -> str | None:
        if self.stats_dir:
            return self.stats_dir
        if self.local_disk:
            return os.path.join(self.local_disk, ".kvtier-stats")
        return None


# LMCache keys that kvtier accepts and ignores, with the reason printed in the warning.
_IGNORED_TOP: dict[str, str] = {
    "use_layerwise": "kvtier always moves whole chunks",
    "enable_blending": "CacheBlend is not implemented",
    "enable_p2p": "no peer-to-peer transfer in kvtier",
    "enable_controller": "no LMCache controller in kvtier",
    "lmcache_instance_id": "kvtier needs no instance id",
    "numa_mode": "not used on kvtier's CPU tier",
    "local_disk_path_sharding": "kvtier shards disk paths itself",
}
_IGNORED_EXTRA: dict[str, str] = {
    "s3_prefer_http2": "kvtier's S3 clients use HTTP/1.1 (RGW/beast)",
    "s3_enable_s3express": "S3 Express is AWS-only; kvtier targets Ceph RGW/S3",
    "save_chunk_meta": "kvtier always writes its own chunk header",
}
_SERDES = ("naive",)
_S3_CLIENTS = ("auto", "boto3", "crt")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _parse_s3_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    return parsed.netloc, parsed.path.lstrip("/")


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown key '{key}' in {where}{hint}")


def _typed(key: str, value: Any, kind: type, where: str) -> Any:
    """Check a value's type; ints are accepted as floats, bools never as numbers."""
    ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if kind is not bool and isinstance(value, bool):
        ok = False
    if not ok:
        raise ConfigError(f"key '{key}' in {where} must be {_kind_name(kind)}, got {value!r}")
    if kind is list:
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"key '{key}' in {where} must be a list of strings, got {value!r}")
        return tuple(value)
    return float(value) if kind is float else value


def _kind_name(kind: type) -> str:
    names = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list of strings",
    }
    return names.get(kind, kind.__name__)


_TOP_TYPES: dict[str, type] = {
    "chunk_size": int,
    "local_cpu": bool,
    "max_local_cpu_size": float,
    "local_disk": str,
    "max_local_disk_size": float,
    "remote_url": str,
    "remote_serde": str,
    "save_unfull_chunk": bool,
    "enable_async_loading": bool,
    "blocking_timeout_secs": float,
    "aws_profile": str,
    "endpoint_url": str,
    "namespace": str,
    "request_namespaces": list,
    "s3_client": str,
    "stats_dir": str,
    "stats_interval_secs": float,
    "verify_checksums": bool,
}
_EXTRA_TYPES: dict[str, type] = {
    "s3_max_io_concurrency": int,
    "s3_max_inflight_reqs": int,
    "s3_region": str,
    "s3_file_prefix": str,
}
_NULLABLE = {"local_disk", "remote_url", "aws_profile", "endpoint_url", "stats_dir"}


def _build_extra(raw: Any, where: str) -> S3Options:
    if raw is None:
        return S3Options()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"key 'extra_config' in {where} must be a mapping, got {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key)
        if key in _IGNORED_EXTRA:
            log.warning(
                "kvtier: ignoring extra_config.%s in %s (%s)", key, where, _IGNORED_EXTRA[key]
            )
            continue
        if key not in _EXTRA_TYPES:
            raise _unknown(
                f"extra_config.{key}", [f"extra_config.{k}" for k in _EXTRA_TYPES], where
            )
        values[key] = _typed(f"extra_config.{key}", value, _EXTRA_TYPES[key], where)
    opts = S3Options(**values)
    for key in ("s3_max_io_concurrency", "s3_max_inflight_reqs"):
        if getattr(opts, key) < 1:
            raise ConfigError(f"key 'extra_config.{key}' in {where} must be >= 1")
    return opts


def _from_mapping(raw: Mapping[str, Any], where: str) -> KvtierConfig:
    values: dict[str, Any] = {}
    valid = [*_TOP_TYPES, "extra_config"]
    for key, value in raw.items():
        key = str(key)
        if key in _IGNORED_TOP:
            log.warning("kvtier: ignoring key '%s' in %s (%s)", key, where, _IGNORED_TOP[key])
            continue
        if key == "extra_config":
            values[key] = _build_extra(value, where)
            continue
        if key not in _TOP_TYPES:
            raise _unknown(key, valid, where)
        if value is None and key in _NULLABLE:
            values[key] = None
            continue
        values[key] = _typed(key, value, _TOP_TYPES[key], where)
    cfg = KvtierConfig(**values, source=where)
    _check_meaning(cfg, where)
    return cfg


def _check_meaning(cfg: KvtierConfig, where: str) -> None:
    """Checks across values, each naming the key to change."""
    if cfg.chunk_size < 1 or cfg.chunk_size > 1 << 20:
        raise ConfigError(f"key 'chunk_size' in {where} must be between 1 and 1048576")
    for key in ("max_local_cpu_size", "max_local_disk_size", "blocking_timeout_secs"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"key '{key}' in {where} must be >= 0")
    if cfg.stats_interval_secs <= 0:
        raise ConfigError(f"key 'stats_interval_secs' in {where} must be > 0")
    if cfg.local_disk is not None:
        if cfg.local_disk.startswith("file://"):
            object.__setattr__(cfg, "local_disk", urlparse(cfg.local_disk).path)
        if not cfg.local_disk:
            raise ConfigError(f"key 'local_disk' in {where} must be a directory path")
        if cfg.max_local_disk_size <= 0:
            raise ConfigError(
                f"key 'max_local_disk_size' in {where} must be > 0 when local_disk is set"
            )
    if cfg.remote_serde not in _SERDES:
        raise ConfigError(
            f"key 'remote_serde' in {where} must be one of {', '.join(_SERDES)} "
            f"(kvtier stores raw KV bytes), got {cfg.remote_serde!r}"
        )
    if cfg.s3_client not in _S3_CLIENTS:
        raise ConfigError(
            f"key 's3_client' in {where} must be one of {', '.join(_S3_CLIENTS)}, "
            f"got {cfg.s3_client!r}"
        )
    for key, name in [("namespace", cfg.namespace)] + [
        ("request_namespaces", n) for n in cfg.request_namespaces
    ]:
        if not _NAMESPACE_RE.match(name):
            raise ConfigError(
                f"key '{key}' in {where}: a namespace is 1-64 characters of letters, digits,"
                f" '.', '_', '-' (it becomes a path and object-key component), got {name!r}"
            )
    if cfg.remote_url is not None:
        parsed = urlparse(cfg.remote_url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError(
                f"key 'remote_url' in {where} must look like s3://bucket/prefix, "
                f"got {cfg.remote_url!r}"
            )
        if not _BUCKET_RE.match(parsed.netloc):
            raise ConfigError(
                f"key 'remote_url' in {where}: {parsed.netloc!r} is not a valid bucket name"
            )
        if ".s3." in parsed.netloc and cfg.endpoint_url is None:
            bucket, _, host = parsed.netloc.partition(".")
            log.warning(
                "kvtier: remote_url %r in %s looks like LMCache's virtual-hosted form; kvtier "
                "reads it as bucket %r. For bucket %r on %s write remote_url: s3://%s and "
                "endpoint_url.",
                cfg.remote_url,
                where,
                parsed.netloc,
                bucket,
                host,
                bucket,
            )
    if cfg.endpoint_url is not None:
        parsed = urlparse(cfg.endpoint_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(
                f"key 'endpoint_url' in {where} must look like http://host:port, "
                f"got {cfg.endpoint_url!r}"
            )
    if not cfg.local_cpu and not cfg.local_disk and not cfg.remote_url:
        log.warning("kvtier: no tier enabled in %s (local_cpu, local_disk, remote_url)", where)


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read kvtier config {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a YAML mapping of kvtier keys, got {type(data).__name__}"
        )
    return data


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> KvtierConfig:
    """Load and validate kvtier's settings; raise :class:`ConfigError` with a fix-it message."""
    if source is None:
        env = os.environ.get(ENV_VAR)
        if not env:
            raise ConfigError(
                f"no kvtier config: set ${ENV_VAR} to a YAML file or pass config_file in "
                f"{INLINE_SOURCE}"
            )
        source = env
    if isinstance(source, Mapping):
        inline = {str(k): v for k, v in source.items()}
        file_value = inline.pop("config_file", None)
        if file_value is None and not inline and os.environ.get(ENV_VAR):
            return load_config(os.environ[ENV_VAR])
        if file_value is None:
            return _from_mapping(inline, INLINE_SOURCE)
        if not isinstance(file_value, (str, os.PathLike)):
            raise ConfigError(f"key 'config_file' in {INLINE_SOURCE} must be a path")
        path = Path(file_value)
        merged = _read_yaml(path)
        if "extra_config" in inline and isinstance(merged.get("extra_config"), Mapping):
            inline_extra = inline.pop("extra_config")
            if not isinstance(inline_extra, Mapping):
                raise ConfigError(f"key 'extra_config' in {INLINE_SOURCE} must be a mapping")
            merged["extra_config"] = {**merged["extra_config"], **inline_extra}
        merged.update(inline)
        where = f"{path} (with overrides from {INLINE_SOURCE})" if inline else str(path)
        return _from_mapping(merged, where)
    path = Path(source)
    return _from_mapping(_read_yaml(path), str(path))


def config_keys() -> list[str]:
    """All accepted top-level keys (for docs and the CLI)."""
    return [f.name for f in fields(KvtierConfig) if f.name != "source"]
