"""`kvtier explain`: where prompts stop sharing a prefix, and what the cache holds of them.

- ``prompts.py``: the inputs (text files, JSONL of OpenAI completions/chat requests);
- ``render.py``: token ids as the served model makes them (the running server's ``/tokenize``,
  or the model's tokenizer and chat template offline);
- ``compare.py``: leading chunks shared, the first divergence and the text around it;
- ``held.py``: which chunks the persistent tiers hold now (read-only: stat, HEAD, LIST);
- ``cli.py``: the command.
"""
