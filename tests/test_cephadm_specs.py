"""The cephadm RGW service specs that ceph_rgw renders are valid.

Ceph's own spec classes (Debian's python3-ceph-common, Pacific, under /usr/bin/python3) judge the
rgw + ingress pair; Pacific does not know the Tentacle rgw concentrator, so that variant gets
the project's schema check (roles/ceph_rgw/library/ceph_orch_spec.py). `ceph orch apply` itself
needs a running orchestrator: none runs in CI yet (docs/cephadm.md has the module's first run
against one, by hand)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _ansible import BIN, REPO, ansible_env, run_playbook

SYSTEM_PYTHON = "/usr/bin/python3"
sys.path.insert(0, str(REPO / "roles" / "ceph_rgw" / "library"))

import ceph_orch_spec  # noqa: E402

CEPH_VALIDATE = """
import json, sys
from ceph.deployment.service_spec import ServiceSpec
for doc in json.load(sys.stdin):
    ServiceSpec.from_json(doc).validate()
"""


def render(tmp_path: Path, **extra: Any) -> subprocess.CompletedProcess[str]:
    extra_vars = {
        "ceph_rgw_mode": "cephadm",
        "ceph_cluster_mode": "cephadm",
        "ceph_rgw_cephadm_apply": False,
        "ceph_rgw_cephadm_admin_host": "localhost",
        "ceph_rgw_cephadm_spec_dir": str(tmp_path),
        "ceph_rgw_cephadm_networks": ["10.20.0.0/24"],
        "ceph_rgw_frontend_port": 80,
        "ceph_rgw_backend_base_port": 8000,
        **extra,
    }
    return run_playbook("tests/playbooks/render_rgw_specs.yml", extra_vars, timeout=180)


def rendered(tmp_path: Path, **extra: Any) -> list[dict[str, Any]]:
    done = render(tmp_path, **extra)
    assert done.returncode == 0, done.stdout[-3000:]
    return [d for d in yaml.safe_load_all((tmp_path / "rgw-kvtier.yml").read_text()) if d]


def ceph_validate(docs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SYSTEM_PYTHON, "-c", CEPH_VALIDATE],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module", autouse=True)
def _ceph_classes() -> None:
    done = subprocess.run([SYSTEM_PYTHON, "-c", "import ceph.deployment.service_spec"])
    if done.returncode != 0:
        pytest.fail("python3-ceph-common is not installed: apt-get install python3-ceph-common")


def test_squid_renders_rgw_and_ingress_that_ceph_accepts(tmp_path: Path) -> None:
    docs = rendered(
        tmp_path, ceph_rgw_cephadm_release=19, ceph_rgw_cephadm_virtual_ip="10.20.0.100/24"
    )
    rgw, ingress = docs
    assert rgw["service_type"] == "rgw" and rgw["service_id"] == "kvtier"
    assert rgw["placement"] == {"label": "rgw", "count_per_host": 2}
    assert rgw["networks"] == ["10.20.0.0/24"]
    assert rgw["spec"] == {"rgw_frontend_port": 8000}
    assert ingress["service_type"] == "ingress"
    assert ingress["spec"]["backend_service"] == "rgw.kvtier"
    assert ingress["spec"]["frontend_port"] == 80
    assert ingress["spec"]["virtual_ip"] == "10.20.0.100/24"
    done = ceph_validate(docs)
    assert done.returncode == 0, done.stderr


def test_tentacle_renders_one_rgw_spec_with_the_concentrator(tmp_path: Path) -> None:
    (rgw,) = rendered(tmp_path, ceph_rgw_cephadm_release=20)
    assert rgw["spec"] == {
        "rgw_frontend_port": 8000,
        "concentrator": "haproxy",
        "concentrator_frontend_port": 80,
        "concentrator_monitor_port": 1967,
        "concentrator_monitor_user": "admin",
    }
    assert ceph_orch_spec.schema_errors(rgw) == []
    # Why the project's own check exists: Pacific's classes do not know the concentrator.
    done = ceph_validate([rgw])
    assert done.returncode != 0 and "concentrator" in done.stderr


def test_ingress_without_virtual_ip_fails_in_preflight(tmp_path: Path) -> None:
    done = render(tmp_path, ceph_rgw_cephadm_release=19, ceph_rgw_cephadm_virtual_ip="")
    assert done.returncode != 0
    assert "needs ceph_rgw_cephadm_virtual_ip" in " ".join(done.stdout.split())
    assert not (tmp_path / "rgw-kvtier.yml").exists()


def test_ceph_classes_reject_a_broken_spec() -> None:
    """The validation can fail: Ceph's classes catch what a typo would break."""
    broken = {
        "service_type": "ingress",
        "service_id": "rgw.kvtier",
        "placement": {"label": "rgw"},
        "spec": {"backend_service": "rgw.kvtier", "frontend_port": 80, "monitor_port": 1967},
    }
    done = ceph_validate([broken])
    assert done.returncode != 0 and "No virtual_ip provided" in done.stderr


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {
                "spec": {
                    "rgw_frontend_port": 8000,
                    "concentrator": "nginx",
                    "concentrator_frontend_port": 80,
                }
            },
            "spec.concentrator must be 'haproxy'",
        ),
        (
            {"spec": {"rgw_frontend_port": 8000, "concentrator": "haproxy"}},
            "concentrator_frontend_port is required",
        ),
        (
            {
                "spec": {
                    "rgw_frontend_port": 80,
                    "concentrator": "haproxy",
                    "concentrator_frontend_port": 80,
                }
            },
            "must differ",
        ),
        (
            {"spec": {"rgw_frontend_port": 8000, "concentrator_frontend_prot": 80}},
            "unknown spec key 'concentrator_frontend_prot'",
        ),
        ({"placement": {"label": "rgw", "count_per_host": 0}}, "count_per_host must be"),
        ({"placment": {"label": "rgw"}}, "unknown key 'placment'"),
    ],
)
def test_schema_check_rejects_bad_concentrator_specs(change: dict[str, Any], message: str) -> None:
    good = {
        "service_type": "rgw",
        "service_id": "kvtier",
        "placement": {"label": "rgw", "count_per_host": 2},
        "spec": {
            "rgw_frontend_port": 8000,
            "concentrator": "haproxy",
            "concentrator_frontend_port": 80,
        },
    }
    errors = ceph_orch_spec.schema_errors({**good, **change})
    assert any(message in e for e in errors), errors


def test_module_fails_the_play_on_an_invalid_spec() -> None:
    """As Ansible runs it (on /usr/bin/python3, so with Ceph's classes), before any apply."""
    broken = {
        "service_type": "rgw",
        "service_id": "kvtier",
        "placement": {"label": "rgw", "count_per_host": 2},
        "spec": {"rgw_frontend_port": 8000, "rgw_realm": "r"},
    }
    done = subprocess.run(
        [
            str(BIN / "ansible"),
            "localhost",
            "-M",
            "roles/ceph_rgw/library",
            "-m",
            "ceph_orch_spec",
            "-a",
            json.dumps({"specs": [broken], "apply": True}),
        ],
        cwd=REPO,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Realm specified but no zone specified" in done.stdout


# What Reef 18.2.7's `ceph orch ls --service_name NAME --export --format json` printed against a
# running cephadm orchestrator (docs/cephadm.md, first probe): an unknown service is a line of
# text, not JSON, with exit status 0.
@pytest.mark.parametrize(
    ("out", "specs"),
    [
        ("\nNo services reported\n", []),
        ("", []),
        (
            '\n[{"placement": {"hosts": ["cephadm1"]}, "service_id": "r1",'
            ' "service_name": "rgw.r1", "service_type": "rgw",'
            ' "spec": {"rgw_frontend_port": 8000}}]\n',
            [
                {
                    "placement": {"hosts": ["cephadm1"]},
                    "service_id": "r1",
                    "service_name": "rgw.r1",
                    "service_type": "rgw",
                    "spec": {"rgw_frontend_port": 8000},
                }
            ],
        ),
        ("Error EINVAL: something else", None),
        ('{"not": "a list"}', None),
    ],
)
def test_exported_specs_reads_what_reef_prints(
    out: str, specs: list[dict[str, Any]] | None
) -> None:
    assert ceph_orch_spec.exported_specs(out) == specs
