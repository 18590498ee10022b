"""Benchmarks: ``kvtier bench <command>`` (:mod:`kvtier.bench.cli` registers them).

- ``kvtier bench store``: :mod:`~kvtier.bench.store`, the S3 and disk tiers against raw
  boto3/awscrt clients and plain file reads (measured in :mod:`~kvtier.bench.store_runs`);
- ``kvtier bench ttft``: :mod:`~kvtier.bench.ttft`, TTFT of one prompt set, one vLLM server
  per scenario;
- ``kvtier bench longdoc``: :mod:`~kvtier.bench.longdoc`, LMCache's long_doc_qa against a
  running server;
- ``kvtier bench compare``: :mod:`~kvtier.bench.compare`, experiments A-D
  (:mod:`~kvtier.bench.presets`) side by side, each round measured by
  :mod:`~kvtier.bench.rounds`, the capacity sweep in :mod:`~kvtier.bench.compare_sweep`,
  tables and PNGs from :mod:`~kvtier.bench.compare_report`.

Shared by them: :mod:`~kvtier.bench.load` (the load generator: requests in flight, records,
CSV and JSON), :mod:`~kvtier.bench.servers` (prompts, vLLM server flags and tier settings per
scenario, cleanup), :mod:`~kvtier.bench.plot` (matplotlib, optional). Figures go to
``docs/benchmarks.md``.
"""
