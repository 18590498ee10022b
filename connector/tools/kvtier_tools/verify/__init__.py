"""`kvtier verify`: cold → restart → warm → purge → cold against one running vLLM server.

The check operators run after every change (the ``kv_verify`` role runs it on each serving
host). It works in its own namespace: every request carries
``kv_transfer_params: {"kvtier_namespace": <namespace>}``, which the server's kvtier config must
list in ``request_namespaces``, so production chunks are never read, written or purged.

Steps (each a list of checks; the first failing step ends the run, the report says which check
failed, what was expected and what was measured):

1. channel: a minimal chat completion through the gateway profile (the active one unless
   ``--gateway-profile`` names another) answers with ``choices``; skipped only when asked.
2. cold: purge the namespace from the disk and S3 tiers, send N documents of random token ids
   (a new seed per run, so nothing anywhere can be cached); 0 tokens come from kvtier.
3. restart: restart vLLM (empties its prefix cache and CPU tier), purge the namespace from the
   host's disk tier, so the next round can only be served from Ceph; the bucket holds one object
   per chunk of the documents.
4. warm: first the first document under another ``cache_salt`` (another tenant): kvtier looks
   it up and serves it 0 tokens; then the same requests (every request of a verification
   carries the first tenant's salt); S3 served >= ``min_s3_share`` of the prompt tokens, median TTFT
   warm/cold <= ``max_warm_cold_ratio``, outputs token-identical to a second pass of the cold
   round served by vLLM's own prefix cache (same arithmetic as after a load: bit-exact KV
   gives the same tokens; a full prefill may flip a near-tie in bf16).
5. cold again: restart, purge the namespace from every tier, same requests: 0 tokens from
   kvtier, median TTFT back near the first cold round (above the geometric mean of the cold and
   warm medians), identical outputs.

The namespace is purged again at the end, whatever happened. One verification per namespace
runs on a host at a time (a lock file in /run/lock); a second one exits with an error.
Counters come from the server's ``/metrics`` (deltas around each round): traffic of other
clients during a round adds to them, so verify a host while it is drained of user traffic.
"""

# The package, by what changes independently:
#   settings.py  what a run is given (Settings) and VerifyError
#   rounds.py    talking to the server: requests, rounds of documents, /metrics, restarts
#   checks.py    Step and Check, and each check (expected vs measured) as a small function
#   steps.py     the run loop: steps 1-5, each a function, and the purges around them
#   report.py    the JSON report, its Markdown, the first failure
#   lock.py      one verification per namespace and host
#   cli.py       `kvtier verify`: arguments, their checks, the run, the files written
#   fleet.py     `kvtier verify-fleet`: one host prefills, its peers load from Ceph
#   fleet_cli.py `kvtier verify-fleet`: arguments, peers and their keys, the run, the files
