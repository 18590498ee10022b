"""Config: LMCache files load, typos get a suggestion, errors name the key and the file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import ConfigError, load_config

LMCACHE_FILE = """\
chunk_size: 256
local_cpu: false
max_local_cpu_size: 100
remote_url: s3://lmcache.s3.cephlab.com
save_unfull_chunk: false
enable_async_loading: true
remote_serde: naive
blocking_timeout_secs: 100
extra_config:
  s3_max_io_concurrency: 1024
  s3_max_inflight_reqs: 1024
  s3_prefer_http2: false
  s3_region: default
  s3_enable_s3express: false
  save_chunk_meta: false
  s3_file_prefix: test
"""


def _write(tmp_path: Path, text: str, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_lmcache_file_loads_and_warns_about_ignored_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(tmp_path, LMCACHE_FILE)
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(path)
    assert cfg.chunk_size == 256
    assert cfg.local_cpu is False
    assert cfg.cpu_bytes == 0
    assert cfg.s3_bucket == "lmcache.s3.cephlab.com"
    assert cfg.s3_prefix == "test"
    assert cfg.enable_async_loading is True
    assert cfg.blocking_timeout_secs == 100.0
    assert cfg.extra_config.s3_max_io_concurrency == 1024
    assert cfg.extra_config.s3_region == "default"
    ignored = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(ignored) == 3, ignored
    for key in ("s3_prefer_http2", "s3_enable_s3express", "save_chunk_meta"):
        assert any(key in m and str(path) in m for m in ignored), key
    # the virtual-hosted LMCache URL gets a hint, not a silent reinterpretation
    assert any("virtual-hosted" in r.getMessage() for r in caplog.records)


def test_typo_suggests_the_closest_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "chunk_sise: 128\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"unknown key 'chunk_sise' in {path}; did you mean 'chunk_size'?"


def test_typo_in_extra_config(tmp_path: Path) -> None:
    path = _write(tmp_path, "extra_config:\n  s3_regoin: x\n")
    with pytest.raises(
        ConfigError, match=r"extra_config.s3_regoin.*did you mean 'extra_config.s3_region'"
    ):
        load_config(path)
    # no close key: the valid ones, not the shared "extra_config." prefix taken for a match
    path = _write(tmp_path, "extra_config:\n  zzz: x\n")
    with pytest.raises(ConfigError, match=r"'extra_config.zzz' .*; valid keys: extra_config\."):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("chunk_size: big\n", "chunk_size", "must be an integer"),
        ("chunk_size: 0\n", "chunk_size", "between 1"),
        ("local_cpu: 1\n", "local_cpu", "true/false"),
        ("max_local_cpu_size: true\n", "max_local_cpu_size", "a number"),
        ("local_disk: /x\n", "max_local_disk_size", "must be > 0"),
        ("remote_url: http://x/y\n", "remote_url", "s3://bucket/prefix"),
        ("remote_url: s3://A_B\n", "remote_url", "not a valid bucket"),
        ("remote_serde: cachegen\n", "remote_serde", "naive"),
        ("namespace: a/b\n", "namespace", "letters, digits"),
        ("request_namespaces: verify\n", "request_namespaces", "a list of strings"),
        ("request_namespaces: [ok, ../x]\n", "request_namespaces", "letters, digits"),
        ("endpoint_url: 127.0.0.1:7480\n", "endpoint_url", "http://host:port"),
        ("s3_client: curl\n", "s3_client", "auto, boto3, crt"),
        ("max_remote_size: 0\n", "max_remote_size", "> 0"),
        ("remote_evict_interval_secs: -1\n", "remote_evict_interval_secs", "> 0"),
        (
            "extra_config:\n  s3_max_io_concurrency: 0\n",
            "extra_config.s3_max_io_concurrency",
            ">= 1",
        ),
    ],
)
def test_bad_values_name_key_and_file(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"'{key}'" in msg and str(path) in msg and fragment in msg, msg


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must hold a YAML mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "a: [\n", "bad.yaml"))
    with pytest.raises(ConfigError, match="cannot read kvtier config"):
        load_config(tmp_path / "missing.yaml")


def test_env_var_and_inline_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(
        tmp_path,
        f"local_disk: file://{tmp_path}/d\nmax_local_disk_size: 1\n"
        "extra_config:\n  s3_region: r1\n  s3_file_prefix: p\n",
    )
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    cfg = load_config(None)
    assert cfg.local_disk == f"{tmp_path}/d"  # LMCache's file:// form accepted
    assert cfg.stats_path == f"{tmp_path}/d/.kvtier-stats"
    assert load_config({}).source == str(path)
    cfg2 = load_config(
        {"config_file": str(path), "chunk_size": 64, "extra_config": {"s3_region": "r2"}}
    )
    assert cfg2.chunk_size == 64
    assert cfg2.extra_config.s3_region == "r2"
    assert cfg2.extra_config.s3_file_prefix == "p"
    with pytest.raises(
        ConfigError, match=r"unknown key 'chunksize' in .*kv_connector_extra_config"
    ):
        load_config({"config_file": str(path), "chunksize": 64})
    inline = load_config({"chunk_size": 16, "remote_url": "s3://kvtier-cache/x/"})
    assert inline.source == "kv_connector_extra_config"
    assert inline.s3_prefix == "x"
    monkeypatch.delenv("KVTIER_CONFIG")
    with pytest.raises(ConfigError, match="KVTIER_CONFIG"):
        load_config(None)


def test_the_remote_cap_is_in_bytes_and_only_with_a_remote_tier(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "max_remote_size: 2\n")).remote_bytes is None
    capped = load_config(_write(tmp_path, "remote_url: s3://bucket/p\nmax_remote_size: 0.5\n"))
    assert capped.remote_bytes == 1 << 29
    assert load_config(_write(tmp_path, "remote_url: s3://bucket/p\n")).remote_bytes is None
