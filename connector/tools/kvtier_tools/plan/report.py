"""The plan as a dict (``kvtier plan --json``) and as the table the command prints."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.format import HEADER_SIZE, chunks_per_object
from kvtier_tools.plan.shape import KVShape
from kvtier_tools.plan.simulate import SimResult, simulate
from kvtier_tools.plan.timing import Speeds
from kvtier_tools.plan.workload import Analytic, RequestMix, Workload

_GIB = 1024**3
_MIB = 1024**2


@dataclass(frozen=True)
class Setup:
    """Where the workload runs: the model's KV shape, the chunking, the tiers, the fleet."""

    shape: KVShape
    chunk_size: int
    block_size: int
    #: Tier sizes in GiB: CPU and disk per rank (the config's caps), the bucket for the fleet.
    sizes_gib: Mapping[str, float]
    hosts: int = 1
    #: The S3 tier's admission rule (``remote_admit_after``): simulated only; the analytic
    #: estimate writes every computed chunk.
    admit_after: int = 1

    @property
    def chunks_per_object(self) -> int:
        """Chunks per S3 object, as the connector picks it for this shape (kvtier.format)."""
        payload = self.shape.object_bytes(self.chunk_size) - HEADER_SIZE
        return chunks_per_object(payload)

    def capacity_chunks(self) -> dict[str, float]:
        """Chunks of one rank each enabled tier holds (the bucket shared by hosts and ranks)."""
        obj = self.shape.object_bytes(self.chunk_size)
        share = {"cpu": 1, "disk": 1, "s3": self.hosts * self.shape.tp_size}
        return {
            tier: math.floor(gib * _GIB / share[tier] / obj) if math.isfinite(gib) else math.inf
            for tier, gib in self.sizes_gib.items()
            if gib > 0
        }


def _rates(mix: RequestMix, setup: Setup, rate: float) -> dict[str, float]:
    """What the fleet puts on RGW: HEADs come from the scheduler (rank 0's keys), GETs and
    PUTs from every rank. The mix counts chunks; runs of ``chunks_per_object`` chunks share an
    object (kvtier.format), so GETs and PUTs are at least that many times fewer (a request's
    last run may be shorter: the figures are lower bounds)."""
    fleet = rate * setup.hosts
    ranks = setup.shape.tp_size
    obj = setup.shape.object_bytes(setup.chunk_size)
    runs = setup.chunks_per_object
    return {
        "requests_per_s": fleet,
        "chunks_per_object": runs,
        "head_per_s": fleet * mix.heads,
        "get_per_s": fleet * mix.gets * ranks / runs,
        "put_per_s": fleet * mix.puts * ranks / runs,
        "get_mib_s": fleet * mix.gets * ranks * obj / _MIB,
        "put_mib_s": fleet * mix.puts * ranks * obj / _MIB,
    }


def _ttft(mix: RequestMix, setup: Setup, speeds: Speeds, basis: str) -> dict[str, Any]:
    if not speeds.prefill_tokens_per_s:
        return {
            "skipped": "no prefill throughput: pass --prefill-tps, or --bench-ttft with the JSON "
            "of `kvtier bench ttft` run with this model",
            "sources": speeds.sources,
        }
    prefill = 1 / speeds.prefill_tokens_per_s
    per_tier = {t: speeds.seconds_per_hit_token(t, setup.shape) for t in mix.hit_tokens}
    hits = sum(mix.hit_tokens.values())
    with_cache = (mix.prompt_tokens - hits) * prefill + sum(
        n * (per_tier[t] or 0.0) for t, n in mix.hit_tokens.items()
    )
    baseline = mix.prompt_tokens * prefill
    return {
        "hit_rates_from": basis,
        "prompt_tokens": mix.prompt_tokens,
        "without_cache_s": baseline,
        "with_cache_s": with_cache,
        "gain_s": baseline - with_cache,
        "saved_per_hit_token_us": {
            t: None if s is None else 1e6 * (prefill - s) for t, s in per_tier.items()
        },
        "untimed_tiers": [t for t, s in per_tier.items() if s is None],
        "sources": [s for s in speeds.sources if s.split(":")[0] in ("prefill", *per_tier)],
    }


def _mix_dict(mix: RequestMix) -> dict[str, Any]:
    out = asdict(mix)
    out["hit_rate"] = {t: mix.hit_rate(t) for t in mix.hit_tokens} | {"all": mix.hit_rate()}
    return out


def _tier_rows(
    setup: Setup, analytic: Analytic, estimate: RequestMix, sim: SimResult | None
) -> list[dict[str, Any]]:
    return [
        {
            "tier": tier,
            "gib": setup.sizes_gib[tier],
            "chunks_per_rank": cap,
            "conversations": analytic.conversations_held(cap),
            "hit_rate_analytic": estimate.hit_rate(tier),
            "hit_rate_simulated": sim.mix.hit_rate(tier) if sim else None,
        }
        for tier, cap in setup.capacity_chunks().items()
    ]


def build(
    setup: Setup, w: Workload, speeds: Speeds, sim_requests: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """Everything `kvtier plan` reports, as plain data."""
    shape, caps = setup.shape, setup.capacity_chunks()
    analytic = Analytic(w, setup.chunk_size, setup.block_size)
    estimate = analytic.estimate(caps)
    sim: SimResult | None = None
    if sim_requests > 0 and caps:
        sim = simulate(
            w, caps, setup.chunk_size, setup.block_size, sim_requests, seed, setup.admit_after
        )
    obj = shape.object_bytes(setup.chunk_size)
    diffs = []
    if sim:
        diffs = [abs(estimate.hit_rate(t) - sim.mix.hit_rate(t)) for t in caps]
        diffs.append(abs(estimate.hit_rate() - sim.mix.hit_rate()))
    return {
        "model": asdict(shape)
        | {"kv_heads_per_rank": shape.kv_heads_per_rank, "itemsize": shape.itemsize},
        "kv": {
            "bytes_per_token": shape.bytes_per_token,
            "bytes_per_token_per_rank": shape.bytes_per_token_per_rank,
            "chunk_tokens": setup.chunk_size,
            "block_size": setup.block_size,
            "object_bytes": obj,
            "objects_per_chunk": shape.tp_size,
        },
        "workload": asdict(w)
        | {
            "mean_prompt_tokens": analytic.prompt_tokens,
            "mean_prompt_chunks": analytic.prompt_chunks,
            "chunks_per_conversation": analytic.mean_stored,
            "working_set_chunks": analytic.working_set(),
            "working_set_gib": analytic.working_set() * obj * shape.tp_size / _GIB,
        },
        "hosts": setup.hosts,
        "remote_admit_after": setup.admit_after,
        "tiers": _tier_rows(setup, analytic, estimate, sim),
        "hit_rate_analytic": estimate.hit_rate(),
        "hit_rate_simulated": sim.mix.hit_rate() if sim else None,
        "largest_difference_points": 100 * max(diffs) if diffs else None,
        "analytic": _mix_dict(estimate),
        "simulation": None if sim is None else {**asdict(sim), "mix": _mix_dict(sim.mix)},
        "ttft": _ttft(sim.mix, setup, speeds, "simulation")
        if sim
        else _ttft(estimate, setup, speeds, "analytic estimate"),
        "rgw": None
        if "s3" not in caps
        else {
            "analytic": _rates(estimate, setup, w.rate),
            "simulated": _rates(sim.mix, setup, w.rate) if sim else None,
        },
    }


def _size(gib: float) -> str:
    if not math.isfinite(gib):
        return "no limit"
    if gib >= 100:
        return f"{gib:,.0f} GiB"
    return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _header(plan: dict[str, Any]) -> list[str]:
    m, kv, w = plan["model"], plan["kv"], plan["workload"]
    tp = m["tp_size"]
    heads = (
        f"{m['kv_heads_per_rank']} KV heads per rank" if tp > 1 else f"{m['num_kv_heads']} KV heads"
    )
    if w["requests"] is None:
        run = f"steady state, {w['conversations']:,} conversations open"
    else:
        limit = f"at most {w['conversations']:,}" if w["conversations"] else "no limit on"
        run = f"{w['requests']:,} requests from an empty cache ({limit} open conversations)"
    return [
        f"kvtier plan: {m['name']}, {m['dtype']}, TP {tp}, chunks of {kv['chunk_tokens']} tokens "
        f"(config {m['config_path']})",
        f"KV cache: {m['num_layers']} layers x {heads} x {m['head_size']} x 2 (K, V) x "
        f"{m['itemsize']} B = {kv['bytes_per_token_per_rank']:,} B per token"
        + (f" per rank ({kv['bytes_per_token']:,} B for all {tp} ranks)" if tp > 1 else "")
        + f"; a chunk is {kv['object_bytes'] / _MIB:,.2f} MiB"
        + (f" per rank ({tp} S3 objects)" if tp > 1 else " (one S3 object)"),
        f"workload: {run}; first prompt {w['prefix_tokens']:,} tokens, "
        f"+{w['turn_tokens']:,} per turn, {100 * w['continue_share']:.0f} % continue one, "
        f"{w['rate']:g} requests/s per host",
        f"  mean prompt {w['mean_prompt_tokens']:,.0f} tokens; a conversation holds "
        f"{w['chunks_per_conversation']:,.1f} chunks; working set {w['working_set_chunks']:,.0f} "
        f"chunks ({_size(w['working_set_gib'])})",
    ]


def _tier_table(plan: dict[str, Any]) -> list[str]:
    saved = plan["ttft"].get("saved_per_hit_token_us", {})
    lines = [
        "",
        "| tier | size | chunks per rank | conversations | hit rate, analytic | hit rate, "
        "simulated | saved per hit token |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in plan["tiers"]:
        gain = saved.get(r["tier"])
        per = "per rank" if r["tier"] != "s3" else "bucket"
        lines.append(
            f"| {r['tier']} | {_size(r['gib'])} {per} | {r['chunks_per_rank']:,} | "
            f"{r['conversations']:,.1f} | {_pct(r['hit_rate_analytic'])} | "
            f"{_pct(r['hit_rate_simulated'])} | {'-' if gain is None else f'{gain:,.1f} us'} |"
        )
    lines.append(
        f"| all | | | | {_pct(plan['hit_rate_analytic'])} | {_pct(plan['hit_rate_simulated'])} | |"
    )
    sim = plan["simulation"]
    if sim is not None:
        how = (
            f"{sim['runs']} runs of {sim['counted'] // sim['runs']:,} requests"
            if sim["runs"] > 1 or sim["warmup"] == 0
            else f"{sim['counted']:,} requests after a warm-up of {sim['warmup']:,}"
        )
        cut = " (warm-up cut short: raise --sim-requests)" if sim["warmup_cut"] else ""
        lines.append(
            f"analytic vs simulated: largest difference {plan['largest_difference_points']:.1f} "
            f"points (simulation: {how}{cut})"
        )
        if sim["run_spread"] and sim["runs"] > 1:
            lo, hi = sim["run_spread"]
            lines.append(
                f"one run of {sim['counted'] // sim['runs']:,} requests varies: 80 % of the "
                f"simulated runs hit between {_pct(lo)} and {_pct(hi)}"
            )
    return lines


def _ttft_lines(plan: dict[str, Any]) -> list[str]:
    t = plan["ttft"]
    if "skipped" in t:
        return ["", f"TTFT: {t['skipped']}"]
    lines = [
        "",
        f"TTFT (mean prompt {t['prompt_tokens']:,.0f} tokens, hit rates from the "
        f"{t['hit_rates_from']}): {t['without_cache_s']:.3f} s without kvtier, "
        f"{t['with_cache_s']:.3f} s with it ({t['gain_s']:.3f} s saved, "
        f"{100 * t['gain_s'] / t['without_cache_s']:.0f} %)",
    ]
    lines += [f"  {s}" for s in t["sources"]]
    slower = [k for k, v in t["saved_per_hit_token_us"].items() if v is not None and v < 0]
    if slower:
        lines.append(
            f"  {', '.join(slower)}: a hit takes longer than recomputing it at this prefill rate "
            "(only worth it for what the faster tiers cannot hold, or across hosts)"
        )
    if t["untimed_tiers"]:
        lines.append(
            f"  no bandwidth for {', '.join(t['untimed_tiers'])}: their loads taken as free"
        )
    return lines


def _rgw_lines(plan: dict[str, Any]) -> list[str]:
    rgw = plan["rgw"]
    if rgw is None:
        return []
    runs = next((r["chunks_per_object"] for r in rgw.values() if r is not None), 1)
    per = "per chunk" if runs == 1 else f"per {runs} chunks (at most; GET/PUT: lower bounds)"
    lines = ["", f"RGW ({plan['hosts']} host(s), one S3 object {per} and rank):"]
    admit = plan["remote_admit_after"]
    for name, r in rgw.items():
        if r is not None:
            rule = ""
            if admit > 1:
                rule = " (every chunk)" if name == "analytic" else f" (admitted on sight {admit})"
            lines.append(
                f"  {name}{rule}: fleet {r['requests_per_s']:g} requests/s -> "
                f"HEAD <= {r['head_per_s']:,.1f}/s, "
                f"GET {r['get_per_s']:,.1f}/s ({r['get_mib_s']:,.1f} MiB/s), "
                f"PUT {r['put_per_s']:,.1f}/s ({r['put_mib_s']:,.1f} MiB/s)"
            )
    return lines


def format_plan(plan: dict[str, Any]) -> str:
    return "\n".join(_header(plan) + _tier_table(plan) + _ttft_lines(plan) + _rgw_lines(plan))
