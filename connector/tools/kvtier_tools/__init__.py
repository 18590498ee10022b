"""kvtier's operator tools: the `kvtier` command (doctor, ls, purge, verify, bench, plan,
explain, gateway, events, model) and the harness that starts vLLM for tests and benchmarks.
A distribution of its own (connector/tools/pyproject.toml) on top of the runtime, `kvtier`,
which is all that vLLM's venv needs."""

__version__ = "0.1.0"
