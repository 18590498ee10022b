"""`kvtier plan`: what fits in each tier, the hit rate to expect, the TTFT saved, the load on RGW.

- ``shape.py``: KV bytes per token and per chunk from the model's own config.json (MLA,
  sliding-window and hybrid models refused: kvtier stores one full-attention KV cache group);
- ``workload.py``: the workload (conversations that grow turn by turn) and the analytic estimate
  of the hit rate per tier under LRU;
- ``simulate.py``: the same tiers simulated request by request, as the store runs them;
- ``timing.py``: prefill throughput and tier bandwidth, given or read from `kvtier bench` JSON;
- ``report.py``: the plan as a dict (``--json``) and as a table;
- ``cli.py``: the command.
"""
