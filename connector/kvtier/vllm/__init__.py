"""vLLM integration: the KVTierConnector (`kv_connector_module_path: kvtier.vllm.connector`).

Nothing here imports vLLM or torch at package import time: `kvtier` must stay importable
without them (the tool venv has neither).
"""
