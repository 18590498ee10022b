"""Benchmarks: ``kvtier bench <command>`` (:mod:`kvtier_tools.bench.cli` registers them).

- ``kvtier bench store``: :mod:`~kvtier_tools.bench.tier_clients`, the S3 and disk tiers
  against raw boto3/awscrt clients and plain file reads (measured in
  :mod:`~kvtier_tools.bench.tier_client_runs`);
- ``kvtier bench ttft``: :mod:`~kvtier_tools.bench.ttft`, TTFT of one prompt set, one vLLM server
  per scenario;
- ``kvtier bench longdoc``: :mod:`~kvtier_tools.bench.longdoc`, LMCache's long_doc_qa against a
  running server;
- ``kvtier bench compare``: :mod:`~kvtier_tools.bench.compare`, experiments A-D
  (:mod:`~kvtier_tools.bench.presets`) side by side, each round measured by
  :mod:`~kvtier_tools.bench.rounds`, the capacity sweep in :mod:`~kvtier_tools.bench.compare_sweep`,
  tables and PNGs from :mod:`~kvtier_tools.bench.compare_report`.

Shared by them: :mod:`~kvtier_tools.bench.load` (the load generator: requests in flight, records,
CSV and JSON), :mod:`~kvtier_tools.bench.servers` (prompts, vLLM server flags and tier settings per
scenario, cleanup), :mod:`~kvtier_tools.bench.plot` (matplotlib, optional). Figures go to
``docs/benchmarks.md``.
"""
