"""vLLM's KV-event stream, read without vLLM: what a router in front of the fleet sees.

- ``wire.py``: msgspec mirrors of vLLM 0.32's event Structs, ``decode_batch``;
- ``index.py``: ``PrefixIndex``, the blocks each source holds per medium and how much of a
  prompt's prefix each could serve;
- ``cli.py``: ``kvtier events``, a subscriber that prints the stream and the index it builds.

msgspec and pyzmq are needed only here (``pip install pyzmq msgspec``): the connector never
imports this package.
"""
