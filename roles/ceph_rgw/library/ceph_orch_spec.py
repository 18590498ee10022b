#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: validate cephadm service specs, then `ceph orch apply` only those that differ.

The validation functions are importable without Ansible (tests run them under the system
python, which has Debian's python3-ceph-common)."""

from __future__ import annotations

import json
from typing import Any

DOCUMENTATION = r"""
---
module: ceph_orch_spec
short_description: Validate cephadm service specs and apply the ones that changed
description:
  - Checks every spec against the project's schema (unknown keys rejected) and, where Ceph's
    own spec classes are importable (python3-ceph-common), with
    C(ServiceSpec.from_json(doc).validate()).
    Ceph releases before Tentacle do not know the rgw C(concentrator) fields: such specs get the
    project's schema check only.
  - Reads each service's current spec (C(ceph orch ls --export)) and runs C(ceph orch apply)
    only for specs whose settings differ. Supports check mode.
options:
  specs:
    description: Service specs (dicts as in a cephadm spec file).
    type: list
    elements: dict
    required: true
  apply:
    description: Apply changed specs (false only validates).
    type: bool
    default: true
"""

RETURN = r"""
applied:
  description: Service names applied (or, in check mode, that would be).
  type: list
  elements: str
"""

_PLACEMENT_KEYS = {"label", "count", "count_per_host", "hosts", "host_pattern"}
_COMMON_KEYS = {
    "service_type",
    "service_id",
    "service_name",
    "placement",
    "networks",
    "unmanaged",
    "spec",
    "extra_container_args",
}
_SPEC_KEYS = {
    "rgw": {
        "rgw_frontend_port",
        "rgw_realm",
        "rgw_zone",
        "rgw_zonegroup",
        "rgw_frontend_type",
        "ssl",
        "rgw_exit_timeout_secs",
        "concentrator",
        "concentrator_frontend_port",
        "concentrator_monitor_port",
        "concentrator_monitor_user",
    },
    "ingress": {
        "backend_service",
        "frontend_port",
        "monitor_port",
        "monitor_user",
        "virtual_ip",
        "virtual_interface_networks",
        "ssl",
    },
}
_PORTS = {
    "rgw": ("rgw_frontend_port", "concentrator_frontend_port", "concentrator_monitor_port"),
    "ingress": ("frontend_port", "monitor_port"),
}
_CONCENTRATOR_KEYS = {k for k in _SPEC_KEYS["rgw"] if k.startswith("concentrator")}


def service_name(doc: dict[str, Any]) -> str:
    return f"{doc.get('service_type')}.{doc.get('service_id')}"


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """The project's own check of an rgw or ingress spec: required keys, no unknown keys, ports."""
    kind = doc.get("service_type")
    if kind not in _SPEC_KEYS:
        return [f"service_type must be one of {sorted(_SPEC_KEYS)}, got {kind!r}"]
    name = service_name(doc)
    errors = [f"{name}: unknown key {k!r}" for k in sorted(set(doc) - _COMMON_KEYS)]
    if not isinstance(doc.get("service_id"), str) or not doc["service_id"]:
        errors.append(f"{name}: service_id is required")
    placement = doc.get("placement")
    if not isinstance(placement, dict) or not placement:
        errors.append(f"{name}: placement is required")
    else:
        unknown = sorted(set(placement) - _PLACEMENT_KEYS)
        errors += [f"{name}: unknown placement key {k!r}" for k in unknown]
        cph = placement.get("count_per_host")
        if cph is not None and (not isinstance(cph, int) or cph < 1):
            errors.append(f"{name}: placement.count_per_host must be an integer >= 1")
    spec = doc.get("spec", {})
    if not isinstance(spec, dict):
        return [*errors, f"{name}: spec must be a mapping"]
    errors += [f"{name}: unknown spec key {k!r}" for k in sorted(set(spec) - _SPEC_KEYS[kind])]
    for key in _PORTS[kind]:
        port = spec.get(key)
        if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535):
            errors.append(f"{name}: spec.{key} must be a TCP port, got {port!r}")
    ports = [spec[k] for k in _PORTS[kind] if spec.get(k) is not None]
    if len(ports) != len(set(ports)):
        errors.append(f"{name}: ports {ports} must differ from each other")
    if kind == "rgw" and set(spec) & _CONCENTRATOR_KEYS:
        if spec.get("concentrator") != "haproxy":
            errors.append(f"{name}: spec.concentrator must be 'haproxy'")
        if spec.get("concentrator_frontend_port") is None:
            errors.append(f"{name}: spec.concentrator_frontend_port is required")
    if kind == "ingress":
        for key in ("backend_service", "frontend_port", "monitor_port", "virtual_ip"):
            if not spec.get(key):
                errors.append(f"{name}: spec.{key} is required")
    return errors


def ceph_errors(doc: dict[str, Any]) -> list[str] | None:
    """Errors from Ceph's own spec classes; None where they cannot judge (not installed, or a
    concentrator spec that releases before Tentacle do not know)."""
    try:
        from ceph.deployment.service_spec import ServiceSpec
    except ImportError:
        return None
    try:
        ServiceSpec.from_json(json.loads(json.dumps(doc))).validate()
    except Exception as err:  # Ceph raises SpecValidationError, TypeError, ...
        if set(doc.get("spec", {})) & _CONCENTRATOR_KEYS and "concentrator" in str(err):
            return None  # a release before Tentacle: its classes do not know the field
        return [f"{service_name(doc)}: {type(err).__name__}: {err}"]
    return []


def exported_specs(out: str) -> list[dict[str, Any]] | None:
    """The specs `ceph orch ls --service_name NAME --export --format json` printed, or None when
    its output is neither JSON nor the no-such-service answer. Reef prints "No services reported"
    (not JSON) for a service it does not hold, even with `--format json`, and exits 0."""
    text = out.strip()
    if not text or text == "No services reported":
        return []
    try:
        docs = json.loads(text)
    except ValueError:
        return None
    return docs if isinstance(docs, list) else None


def differs(want: Any, have: Any) -> bool:
    """True when a setting of `want` is missing or different in `have` (the exported spec may
    carry defaults the inventory does not set)."""
    if isinstance(want, dict):
        return not isinstance(have, dict) or any(differs(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return not isinstance(have, list) or sorted(map(str, want)) != sorted(map(str, have))
    return bool(want != have)


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "specs": {"type": "list", "elements": "dict", "required": True},
            "apply": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    specs: list[dict[str, Any]] = module.params["specs"]
    errors = [e for doc in specs for e in schema_errors(doc) + (ceph_errors(doc) or [])]
    if errors:
        module.fail_json(msg="Invalid cephadm service spec: " + "; ".join(errors), errors=errors)
    applied: list[str] = []
    for doc in specs if module.params["apply"] else []:
        name = service_name(doc)
        rc, out, err = module.run_command(
            ["ceph", "orch", "ls", "--service_name", name, "--export", "--format", "json"]
        )
        if rc != 0:
            module.fail_json(msg=f"`ceph orch ls --service_name {name}` failed: {err.strip()}")
        current = exported_specs(out)
        if current is None:
            module.fail_json(msg=f"`ceph orch ls --service_name {name}` printed: {out.strip()}")
        if current and not differs(doc, current[0]):
            continue
        applied.append(name)
        if module.check_mode:
            continue
        rc, out, err = module.run_command(
            ["ceph", "orch", "apply", "-i", "-"], data=json.dumps(doc), binary_data=True
        )
        if rc != 0:
            detail = err.strip() or out.strip()
            module.fail_json(msg=f"`ceph orch apply` of {name} failed: {detail}")
    module.exit_json(changed=bool(applied), applied=applied)


if __name__ == "__main__":
    main()
