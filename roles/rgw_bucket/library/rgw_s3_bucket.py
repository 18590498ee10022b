#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: an S3 bucket on Ceph RGW with one expiry lifecycle rule (boto3, path-style)."""

from __future__ import annotations

from typing import Any

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

DOCUMENTATION = r"""
---
module: rgw_s3_bucket
short_description: Create an S3 bucket on Ceph RGW and keep one expiration lifecycle rule
description:
  - Creates the bucket when missing, then makes the lifecycle rule I(lifecycle_rule_id) expire
    objects after I(expiration_days) days. Other lifecycle rules of the bucket are kept.
  - Talks path-style S3 and only sends checksums where the API requires them (Ceph RGW before
    Reef rejects the newer default checksums).
  - Supports check mode.
requirements: [boto3]
options:
  endpoint_url: {description: S3 endpoint., type: str, required: true}
  region: {description: Region (RGW zonegroup api name)., type: str, default: default}
  access_key: {description: S3 access key., type: str, required: true}
  secret_key: {description: S3 secret key., type: str, required: true, no_log: true}
  name: {description: Bucket name., type: str, required: true}
  expiration_days:
    description: Days until objects expire; 0 removes the rule.
    type: int
    required: true
  lifecycle_rule_id: {description: Id of the rule this module owns., type: str, required: true}
  lifecycle_prefix: {description: Key prefix of the rule., type: str, default: ""}
"""

RETURN = r"""
created: {description: Whether the bucket was created., type: bool}
lifecycle_changed: {description: Whether the lifecycle configuration was written., type: bool}
"""

try:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    HAS_BOTO3 = True
except ImportError:
    HAS_BOTO3 = False


def s3_client(params: dict[str, Any]) -> Any:
    options: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "retries": {"max_attempts": 5, "mode": "standard"},
    }
    try:  # botocore >= 1.36 knows these; older releases never send default checksums.
        config = Config(
            **options,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
    except TypeError:
        config = Config(**options)
    return boto3.client(
        "s3",
        endpoint_url=params["endpoint_url"],
        region_name=params["region"],
        aws_access_key_id=params["access_key"],
        aws_secret_access_key=params["secret_key"],
        config=config,
    )


def wanted_rule(params: dict[str, Any]) -> dict[str, Any]:
    return {
        "ID": params["lifecycle_rule_id"],
        "Filter": {"Prefix": params["lifecycle_prefix"]},
        "Status": "Enabled",
        "Expiration": {"Days": params["expiration_days"]},
    }


def current_rules(client: Any, bucket: str) -> list[dict[str, Any]]:
    try:
        return list(client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"])
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") == "NoSuchLifecycleConfiguration":
            return []
        raise


def same_rule(have: dict[str, Any], want: dict[str, Any]) -> bool:
    # RGW may answer with the legacy top-level Prefix instead of a Filter.
    prefix = have.get("Filter", {}).get("Prefix", have.get("Prefix", ""))
    return (
        have.get("Status") == want["Status"]
        and prefix == want["Filter"]["Prefix"]
        and have.get("Expiration", {}).get("Days") == want["Expiration"]["Days"]
    )


def create(module: AnsibleModule, client: Any, bucket: str, owned: set[str]) -> None:
    """The user may own one bucket (rgw_bucket's max-buckets): say which ones are in the way."""
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") != "TooManyBuckets":
            raise
        module.fail_json(
            msg=f"The RGW user may own only the cache bucket (max-buckets 1), and it already "
            f"owns {', '.join(sorted(owned))}: set rgw_bucket_name to that bucket, or remove it "
            "(radosgw-admin bucket rm --bucket NAME --purge-objects) to make "
            f"{bucket} the cache bucket."
        )


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "endpoint_url": {"type": "str", "required": True},
            "region": {"type": "str", "default": "default"},
            "access_key": {"type": "str", "required": True},
            "secret_key": {"type": "str", "required": True, "no_log": True},
            "name": {"type": "str", "required": True},
            "expiration_days": {"type": "int", "required": True},
            "lifecycle_rule_id": {"type": "str", "required": True},
            "lifecycle_prefix": {"type": "str", "default": ""},
        },
        supports_check_mode=True,
    )
    if not HAS_BOTO3:
        module.fail_json(msg=missing_required_lib("boto3"))
    params = module.params
    bucket = params["name"]
    created = lifecycle_changed = False
    try:
        client = s3_client(params)
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            created = True
            if not module.check_mode:
                create(module, client, bucket, existing)
        rules = [] if module.check_mode and created else current_rules(client, bucket)
        mine = [r for r in rules if r.get("ID") == params["lifecycle_rule_id"]]
        others = [r for r in rules if r.get("ID") != params["lifecycle_rule_id"]]
        if params["expiration_days"] > 0:
            want = wanted_rule(params)
            if len(mine) != 1 or not same_rule(mine[0], want):
                lifecycle_changed = True
                if not module.check_mode:
                    client.put_bucket_lifecycle_configuration(
                        Bucket=bucket, LifecycleConfiguration={"Rules": [*others, want]}
                    )
        elif mine:
            lifecycle_changed = True
            if not module.check_mode:
                if others:
                    client.put_bucket_lifecycle_configuration(
                        Bucket=bucket, LifecycleConfiguration={"Rules": others}
                    )
                else:
                    client.delete_bucket_lifecycle(Bucket=bucket)
    except (BotoCoreError, ClientError) as err:
        module.fail_json(
            msg=f"S3 call to {params['endpoint_url']} for bucket {bucket} failed: {err}. "
            "Check rgw_bucket_endpoint_url and that radosgw answers there.",
        )
    module.exit_json(
        changed=created or lifecycle_changed, created=created, lifecycle_changed=lifecycle_changed
    )


if __name__ == "__main__":
    main()
