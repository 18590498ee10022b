"""`kvtier events`: what a KV-aware router sees. Subscribes to vLLM's KV-event stream, one source
per --endpoint (the server's --kv-events-config endpoint, with the host that runs it in place of
`*`), prints each event as it comes and, at the end, the blocks each source holds per medium
as a router's index of the stream holds them (only what was stored since subscribing).

vLLM publishes its GPU prefix cache's blocks (medium GPU); kvtier's connector adds those of its
tiers (CPU, DISK, S3) to the same stream.

  vllm serve ... --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
      "endpoint": "tcp://*:5557", "topic": "kv"}'
  kvtier events --endpoint tcp://10.0.0.5:5557 --endpoint tcp://10.0.0.6:5557 --seconds 60

It stops after --count events, after --seconds, or at Ctrl-C. --json prints one JSON object per
event (all of its fields, bytes as hex), then one of "type": "Summary". Needs pyzmq and msgspec,
not vLLM.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier_tools.cli import add_command

if TYPE_CHECKING:
    from kvtier_tools.kvevents.index import PrefixIndex
    from kvtier_tools.kvevents.wire import BlockHash, KVEvent, KVEventBatch

_ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5})")


class EventsError(Exception):
    """A usage error, said to the user as it is."""


def parse_endpoint(text: str) -> str:
    """The source name of an endpoint (``HOST:PORT``); :class:`EventsError` if it is not one."""
    m = _ENDPOINT.fullmatch(text)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise EventsError(
            f"--endpoint {text!r}: expected tcp://HOST:PORT, e.g. tcp://10.0.0.5:5557"
        )
    if m["host"] == "*":
        raise EventsError(
            f"--endpoint {text!r}: '*' is what the server binds; name the host that runs it, "
            f"e.g. tcp://10.0.0.5:{m['port']}"
        )
    return f"{m['host']}:{m['port']}"


def short(block_hash: BlockHash) -> str:
    """A block hash's first 8 hex digits, enough to tell blocks apart on screen."""
    return (block_hash.hex() if isinstance(block_hash, bytes) else f"{block_hash:016x}")[:8]


def _line(source: str, seq: int, event: KVEvent) -> str:
    from kvtier_tools.kvevents.wire import AllBlocksCleared, BlockStored

    name = type(event).__name__
    if isinstance(event, AllBlocksCleared):
        return f"{source} #{seq} {name:<16} GPU  all blocks"
    hashes = event.block_hashes
    span = f"{short(hashes[0])}..{short(hashes[-1])}" if hashes else "-"
    lora = event.lora_name if isinstance(event, BlockStored) else None
    return (
        f"{source} #{seq} {name:<16} {event.medium or 'GPU':<4} {len(hashes):>4} blocks {span}"
        + (f" lora={lora}" if lora else "")
    )


def _plain(value: Any) -> Any:
    """JSON-ready: bytes as hex, tuples as lists."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _json(source: str, seq: int, batch: KVEventBatch, event: KVEvent) -> str:
    doc = {
        "source": source,
        "seq": seq,
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "type": type(event).__name__,
    }
    doc.update({f: _plain(getattr(event, f)) for f in event.__struct_fields__})
    return json.dumps(doc)


@dataclass
class _Tally:
    """Events and batches seen, and batches missed (gaps in a source's sequence numbers)."""

    events: int = 0
    batches: int = 0
    missed: dict[str, int] = field(default_factory=dict)
    _last_seq: dict[str, int] = field(default_factory=dict)

    def batch(self, source: str, seq: int) -> None:
        self.batches += 1
        last = self._last_seq.get(source)
        if last is not None and seq > last + 1:  # a lower one: the publisher restarted
            self.missed[source] = self.missed.get(source, 0) + seq - last - 1
        self._last_seq[source] = seq


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "es" if noun.endswith("ch") else "s")


def _summary(index: PrefixIndex, tally: _Tally, sources: list[str], as_json: bool) -> str:
    held = [{"source": s, "medium": m, "blocks": n} for (s, m), n in index.counts().items()]
    if as_json:
        return json.dumps(
            {
                "type": "Summary",
                "events": tally.events,
                "batches": tally.batches,
                "missed_batches": tally.missed,
                "held": held,
            }
        )
    missed = sum(tally.missed.values())
    lines = [
        f"kvtier events: {_n(tally.events, 'event')} in {_n(tally.batches, 'batch')} from "
        f"{_n(len(sources), 'source')}"
        + (f"; {_n(missed, 'batch')} missed (sequence gaps)" if missed else "")
    ]
    if not held:
        return "\n".join([*lines, "no blocks held (none stored since subscribing)"])
    lines += ["", "| source | medium | blocks held |", "|---|---|---|"]
    lines += [f"| {h['source']} | {h['medium']} | {h['blocks']:,} |" for h in held]
    return "\n".join(lines)


def _take(
    source: str, frames: list[bytes], index: PrefixIndex, tally: _Tally, args: argparse.Namespace
) -> None:
    """Decode one message (topic, seq, batch), apply and print its events, up to --count."""
    from kvtier_tools.kvevents.wire import WireError, decode_batch, decode_seq

    try:
        if len(frames) != 3:
            raise WireError(f"expected 3 frames (topic, seq, batch), got {len(frames)}")
        seq, batch = decode_seq(frames[1]), decode_batch(frames[2])
    except WireError as exc:
        print(f"warning: {source}: {exc}", file=sys.stderr)
        return
    tally.batch(source, seq)
    for event in batch.events:
        if args.count is not None and tally.events >= args.count:
            return
        index.apply_event(source, event)
        tally.events += 1
        line = _json(source, seq, batch, event) if args.json else _line(source, seq, event)
        print(line, flush=True)  # live, also through a pipe


def listen(args: argparse.Namespace, endpoints: dict[str, str]) -> int:
    """Subscribe to ``endpoints`` (source -> endpoint), print events, then the summary."""
    try:
        import zmq

        from kvtier_tools.kvevents.index import PrefixIndex
    except ImportError as exc:
        raise EventsError(
            f"kvtier events needs pyzmq and msgspec: pip install pyzmq msgspec ({exc})"
        ) from exc
    index, tally = PrefixIndex(), _Tally()
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    ctx = zmq.Context()
    poller, sources = zmq.Poller(), {}
    try:
        for source, endpoint in endpoints.items():
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode())  # a prefix, as ZMQ matches
            sock.connect(endpoint)
            poller.register(sock, zmq.POLLIN)
            sources[sock] = source
        while args.count is None or tally.events < args.count:
            timeout = None if deadline is None else (deadline - time.monotonic()) * 1000
            if timeout is not None and timeout <= 0:
                break
            for sock, _ in poller.poll(timeout):
                _take(sources[sock], sock.recv_multipart(), index, tally, args)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends the listening, not the summary
    finally:
        for sock in sources:
            sock.close(linger=0)
        ctx.term()
    print(_summary(index, tally, list(endpoints), args.json))
    return 0


def _cmd(args: argparse.Namespace) -> int:
    try:
        endpoints = {parse_endpoint(e): e for e in args.endpoint}
        return listen(args, endpoints)
    except EventsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def register(subparsers: Any) -> None:
    """Add `events` to the `kvtier` CLI."""
    p = add_command(
        subparsers, "events", "print vLLM's KV-event stream as a router sees it", __doc__
    )
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        help="tcp://HOST:PORT of a server's KV-event publisher (repeat for several)",
    )
    p.add_argument("--topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.add_argument("--count", type=int, help="stop after this many events")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=_cmd)
