"""kvtier configuration: one YAML file (or an inline mapping), typed and validated at load.

Keys are LMCache-compatible where the meaning is the same (``chunk_size``, ``local_cpu``,
``max_local_cpu_size``, ``local_disk``, ``remote_url`` ... and ``extra_config.s3_*``), so an
operator's LMCache file loads as is. LMCache keys that mean nothing to kvtier are accepted with a
one-line warning naming them; a truly unknown key is an error that suggests the closest valid one.
Every error names the key and the file it came from.

The models are pydantic's (strict types, unknown keys forbidden, immutable); the first error
pydantic finds is worded the way the rest of kvtier words them (:func:`_config_error`).

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
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlparse

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

log = logging.getLogger(__name__)

ENV_VAR = "KVTIER_CONFIG"
INLINE_SOURCE = "kv_connector_extra_config"
_GIB = 1024**3


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the file and says what to change."""


#: Strict types (no "1" for 1, no 1 for true; an integer is a valid number), unknown keys are
#: errors, and a loaded config cannot change (it is shared by threads; derive a variant with
#: ``cfg.model_copy(update={...})``, which keeps ``source`` and does not validate again).
_MODEL = ConfigDict(extra="forbid", frozen=True, strict=True)


# ---- checks of one value: the message follows "key '<key>' in <file>" ----
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def _chunk_size(value: int) -> int:
    if not 1 <= value <= 1 << 20:
        raise ValueError("must be between 1 and 1048576")
    return value


def _directory(value: str) -> str:
    if value.startswith("file://"):
        value = urlparse(value).path  # LMCache's form
    if not value:
        raise ValueError("must be a directory path")
    return value


def _s3_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"must look like s3://bucket/prefix, got {value!r}")
    if not _BUCKET_RE.match(parsed.netloc):
        raise ValueError(f": {parsed.netloc!r} is not a valid bucket name")
    return value


def _http_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"must look like http://host:port, got {value!r}")
    return value


def _namespace(value: str) -> str:
    if not _NAMESPACE_RE.match(value):
        raise ValueError(
            ": a namespace is 1-64 characters of letters, digits, '.', '_', '-' "
            f"(it becomes a path and object-key component), got {value!r}"
        )
    return value


Namespace = Annotated[str, AfterValidator(_namespace)]


class S3Options(BaseModel):
    """``extra_config`` keys (LMCache names) that tune the S3 tier."""

    model_config = _MODEL

    #: Concurrent S3 requests (thread pool / connection pool size of the S3 client).
    s3_max_io_concurrency: int = Field(default=32, ge=1)
    #: Background S3 writes allowed in flight; further writes are dropped (counted as
    #: ``backpressure``) instead of queueing without bound behind a slow bucket.
    s3_max_inflight_reqs: int = Field(default=256, ge=1)
    #: Region used for SigV4 signing (RGW accepts any; "default" is what Ceph docs use).
    s3_region: str = "us-east-1"
    #: Extra prefix under the bucket (LMCache's meaning), before kvtier's own layout.
    s3_file_prefix: str = ""


class KvtierConfig(BaseModel):
    """Validated kvtier settings. Sizes are in GiB, as in LMCache."""

    model_config = _MODEL

    #: Tokens per stored chunk. Must match between writers and readers (it is in the key).
    chunk_size: Annotated[int, AfterValidator(_chunk_size)] = 256
    #: Keep chunks in process memory (a byte-capped LRU).
    local_cpu: bool = True
    #: CPU tier cap, GiB.
    max_local_cpu_size: float = Field(default=5.0, ge=0)
    #: Directory (e.g. the NVMe mount) for the disk tier; ``None`` disables it.
    #: LMCache's ``file:///path`` form is accepted.
    local_disk: Annotated[str, AfterValidator(_directory)] | None = None
    #: Disk tier cap, GiB.
    max_local_disk_size: float = Field(default=0.0, ge=0, validate_default=True)
    #: ``s3://bucket/prefix``; ``None`` disables the S3 tier.
    remote_url: Annotated[str, AfterValidator(_s3_url)] | None = None
    #: Only ``naive`` (raw bytes) is supported; the description is the reason an error gives.
    remote_serde: Literal["naive"] = Field(
        default="naive", description="kvtier stores raw KV bytes"
    )
    #: Also store the trailing chunk that is shorter than ``chunk_size``.
    save_unfull_chunk: bool = False
    #: Load what the S3 tier holds in the background: the request waits outside the batch
    #: (vLLM's asynchronous load) while the other requests' steps go on, instead of every
    #: request of the step waiting for its GETs. Hits from the CPU and disk tiers stay in the
    #: step (they take milliseconds).
    enable_async_loading: bool = False
    #: Timeout for one remote operation (connect + read), and the default flush timeout.
    blocking_timeout_secs: float = Field(default=10.0, ge=0)
    #: ``null`` is the defaults, as when the key is left out.
    extra_config: Annotated[S3Options, BeforeValidator(lambda v: {} if v is None else v)] = (
        S3Options()
    )
    # ---- kvtier's own keys ----
    #: AWS profile (in ``~/.aws/credentials`` / ``~/.aws/config``) for the S3 tier.
    aws_profile: str | None = None
    #: S3 endpoint, e.g. ``http://127.0.0.1:7480`` for the local RGW. ``None``: the profile's
    #: ``endpoint_url`` or AWS.
    endpoint_url: Annotated[str, AfterValidator(_http_url)] | None = None
    #: Tenant separation: chunks written under one namespace are never read under another.
    namespace: Namespace = "default"
    #: Namespaces a request may choose instead of ``namespace``, with
    #: ``"kv_transfer_params": {"kvtier_namespace": "<name>"}`` in its body (kv_verify's
    #: round trips use this, so they never touch production chunks). A request naming any
    #: other namespace is served without kvtier, and a warning says why.
    request_namespaces: tuple[Namespace, ...] = Field(default=(), strict=False)  # from a YAML list
    #: S3 client: ``boto3``, ``crt`` (awscrt S3Client) or ``auto`` (PUT via awscrt, GET/HEAD via
    #: boto3: the faster/cheaper one per operation as measured, see docs/benchmarks.md).
    s3_client: Literal["auto", "boto3", "crt"] = "auto"
    #: Consecutive chunks of a prompt stored in one S3 object (fewer, larger requests: the
    #: lookup, the reads and the writes cost a request per object, not per chunk). 0: as many
    #: as fit in 8 MiB, from the model's KV bytes per chunk (1 when one chunk is larger).
    #: Part of the layout fingerprint: hosts sharing a bucket must agree.
    remote_chunks_per_object: int = Field(default=0, ge=0, le=64)
    #: Directory where each process writes its stats snapshot (``kvtier stats`` reads it).
    #: Default: ``<local_disk>/.kvtier-stats`` when the disk tier is on, else off.
    stats_dir: str | None = None
    #: Seconds between stats snapshots written to ``stats_dir`` (also written at close).
    stats_interval_secs: float = Field(default=10.0, gt=0)
    # ---- the remote tier failing: never worse than no cache ----
    #: Seconds a new request waits for the remote tier's lookup before it is scheduled without
    #: the remote tier's chunks (the lookup runs beside the scheduler, never in its loop).
    lookup_timeout_secs: float = Field(default=0.1, gt=0)
    #: Consecutive failed calls (timeouts, refused connections, 5xx, refused credentials) after
    #: which the remote tier is not asked again until a background probe sees it answer.
    remote_failure_threshold: int = Field(default=3, ge=1)
    #: Seconds before the first probe of a remote tier that stopped answering; doubled after each
    #: failed probe, up to 60.
    remote_retry_secs: float = Field(default=2.0, gt=0)
    # ---- the remote tier bounded (kvtier.tiers.bounded) ----
    #: Cap, GiB, on the objects under ``remote_url``'s prefix, shared by every server writing
    #: there and kept by each: the least recently used objects are deleted, and writes are
    #: skipped (counted, cause ``over_cap``) while the prefix is over the cap. ``null``: no cap
    #: (the bucket's lifecycle rule and quota are then the only bounds).
    max_remote_size: float | None = Field(default=None, gt=0)
    #: Seconds between two listings of the prefix by each writer (eviction, recency of hits,
    #: the fill its writes are checked against); a writer that takes the prefix over its cap
    #: lists it at once.
    remote_evict_interval_secs: float = Field(default=30.0, gt=0)
    #: Admission (kvtier.admission): a chunk is written to the remote tier only from the
    #: ``remote_admit_after``-th request whose prompt holds its prefix on (counted by each
    #: server); before, the local tiers (CPU, disk) keep it. ``1``: every chunk, as computed.
    remote_admit_after: int = Field(default=1, ge=1)
    #: Chunks whose sights are counted (the most recently seen; ~150 bytes each): a chunk not
    #: seen again within them starts from one.
    remote_admit_window_chunks: int = Field(default=100_000, ge=1)
    #: ``true``: refuse to start when the remote tier cannot be used at start (wrong endpoint,
    #: credentials or bucket). ``false``: log the cause once, serve without it, probe it again.
    remote_required: bool = False
    #: Payload bytes (GiB) of background writes (disk, S3) allowed to wait in memory; a write
    #: beyond it is skipped and counted (``dropped_writes``), never waited for.
    max_write_backlog_size: float = Field(default=1.0, gt=0)
    #: Pinned host memory (GiB) for the saves of a CUDA worker: each chunk saved is copied
    #: from the GPU into a slot of it, which stays held until the tiers have written it.
    #: ``null``: two steps' worth of chunks (vLLM's max_num_batched_tokens, twice), so a step
    #: never waits for a slot while the tiers keep up. Unused on the CPU build.
    save_buffer_size: float | None = Field(default=None, gt=0)
    #: Seconds vLLM's thread may wait in a step for a pinned save slot to come free; beyond,
    #: the rest of that request's chunks of the step are not saved (counted:
    #: ``kvtier:save_dropped_chunks_total``). A save never holds a step up longer.
    save_wait_secs: float = Field(default=0.005, ge=0)
    #: TEST-ONLY switch: ``false`` skips payload checksum verification on read, so a negative
    #: control can show that corrupted data would otherwise reach the model. Never turn off
    #: in production.
    verify_checksums: bool = True
    #: Where the settings came from (for messages); not a config key.
    _source: str = PrivateAttr("<defaults>")

    # ---- derived values ----
    @property
    def source(self) -> str:
        return self._source

    @property
    def cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * _GIB) if self.local_cpu else 0

    @property
    def disk_bytes(self) -> int:
        return int(self.max_local_disk_size * _GIB) if self.local_disk else 0

    @property
    def remote_bytes(self) -> int | None:
        """The remote tier's cap in bytes; None: no cap."""
        if self.max_remote_size is None or not self.remote_url:
            return None
        return int(self.max_remote_size * _GIB)

    @property
    def write_backlog_bytes(self) -> int:
        return int(self.max_write_backlog_size * _GIB)

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

    # ---- checks across keys ----
    @field_validator("max_local_disk_size")
    @classmethod
    def _disk_size(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("local_disk") is not None and value <= 0:
            raise ValueError("must be > 0 when local_disk is set")
        return value


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


def _parse_s3_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    return parsed.netloc, parsed.path.lstrip("/")


#: pydantic error types, as "must be ..." of kvtier's messages.
_KINDS = {
    "bool_type": "true/false",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "model_type": "a mapping",
}
_BOUNDS = {
    "greater_than_equal": ">= {ge:g}",
    "greater_than": "> {gt:g}",
    "less_than_equal": "<= {le:g}",
}


def _config_error(exc: ValidationError, values: Mapping[str, Any], where: str) -> ConfigError:
    """pydantic's first error in kvtier's words: the key, the file, what is wrong. An unknown key
    comes before any other error (a misspelt key often explains the rest)."""
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    path = [str(p) for p in error["loc"] if isinstance(p, str)]
    key, kind = ".".join(path), error["type"]
    if kind == "extra_forbidden":
        return _unknown(path, where)
    if kind == "value_error":  # from a check above: its message says what is wrong
        text = str(error["ctx"]["error"])
        return ConfigError(f"key '{key}' in {where}{'' if text.startswith(':') else ' '}{text}")
    if kind == "tuple_type" or len(path) < len(error["loc"]):  # the list, or one of its items
        return ConfigError(f"key '{key}' in {where} must be a list of strings, got {values[key]!r}")
    if kind in _KINDS:
        return ConfigError(f"key '{key}' in {where} must be {_KINDS[kind]}, got {error['input']!r}")
    if kind in _BOUNDS:
        return ConfigError(f"key '{key}' in {where} must be {_BOUNDS[kind].format(**error['ctx'])}")
    if kind == "literal_error":
        field = KvtierConfig.model_fields[key]
        why = f" ({field.description})" if field.description else ""
        choices = ", ".join(get_args(field.annotation))
        return ConfigError(
            f"key '{key}' in {where} must be one of {choices}{why}, got {error['input']!r}"
        )
    return ConfigError(f"key '{key}' in {where}: {error['msg']}")  # pydantic's own words


def _unknown(path: list[str], where: str) -> ConfigError:
    model: type[BaseModel] = S3Options if path[0] == "extra_config" else KvtierConfig
    prefix = "extra_config." if model is S3Options else ""
    valid = list(model.model_fields)
    close = difflib.get_close_matches(path[-1], valid, n=1, cutoff=0.6)
    hint = (
        f"; did you mean '{prefix}{close[0]}'?"
        if close
        else f"; valid keys: {', '.join(sorted(prefix + k for k in valid))}"
    )
    return ConfigError(f"unknown key '{'.'.join(path)}' in {where}{hint}")


def _without_ignored(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``raw`` less the LMCache keys kvtier ignores, each named in a one-line warning."""
    values: dict[str, Any] = {}
    for key, value in ((str(k), v) for k, v in raw.items()):
        if key in _IGNORED_TOP:
            log.warning("kvtier: ignoring key '%s' in %s (%s)", key, where, _IGNORED_TOP[key])
            continue
        if key == "extra_config" and isinstance(value, Mapping):
            value = {str(k): v for k, v in value.items()}
            for ignored in [k for k in value if k in _IGNORED_EXTRA]:
                reason = _IGNORED_EXTRA[ignored]
                log.warning("kvtier: ignoring extra_config.%s in %s (%s)", ignored, where, reason)
                del value[ignored]
        values[key] = value
    return values


def _from_mapping(raw: Mapping[str, Any], where: str) -> KvtierConfig:
    values = _without_ignored(raw, where)
    try:
        cfg = KvtierConfig.model_validate(values)
    except ValidationError as exc:
        raise _config_error(exc, values, where) from exc
    cfg._source = where
    _warn(cfg)
    return cfg


def _warn(cfg: KvtierConfig) -> None:
    """Settings that load but are probably not what the operator meant."""
    bucket = cfg.s3_bucket or ""
    if ".s3." in bucket and cfg.endpoint_url is None:
        name, _, host = bucket.partition(".")
        log.warning(
            "kvtier: remote_url %r in %s looks like LMCache's virtual-hosted form; kvtier "
            "reads it as bucket %r. For bucket %r on %s write remote_url: s3://%s and "
            "endpoint_url.",
            cfg.remote_url,
            cfg.source,
            bucket,
            name,
            host,
            name,
        )
    if not cfg.local_cpu and not cfg.local_disk and not cfg.remote_url:
        log.warning("kvtier: no tier enabled in %s (local_cpu, local_disk, remote_url)", cfg.source)


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
    return list(KvtierConfig.model_fields)
