"""kvtier: a tiered KV-cache store (CPU DRAM, local NVMe, Ceph RGW over S3) for vLLM."""

__version__ = "0.1.0"
