"""`kvtier plan`: KV sizes from real config files, the analytic hit rate against the simulation,
and both against experiment C's measured capacity sweep (docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvtier_tools.bench.presets import FULL, MixedLoad
from kvtier_tools.cli import main
from kvtier_tools.plan.shape import PlanError, load_shape
from kvtier_tools.plan.simulate import (
    SimRequest,
    TierSimulation,
    requests_from_prompts,
    run,
    simulate,
)
from kvtier_tools.plan.workload import Analytic, Workload

REPO = Path(__file__).resolve().parents[2]
BENCH_TTFT = REPO / "docs" / "img" / "bench-ttft.json"

# The well-known values of the published config.json files (no download here).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "torch_dtype": "bfloat16",
    "sliding_window": 131072,
    "use_sliding_window": False,  # Qwen2 ships a window that is off: full attention
    "max_window_layers": 28,
}
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3_MLA = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}
MISTRAL_SLIDING = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
# Experiment C's capacity sweep as measured (docs/benchmarks.md, docs/img/bench-compare.json):
# CPU tier share of the 309-chunk working set -> hit rate, without a disk tier.
C_SWEEP = {1.0: 0.754, 0.5: 0.687, 0.25: 0.514, 0.1: 0.249}
C_WORKING_SET = 309


def _model(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    return plan


# ------------------------------------------------------------------------------ KV shapes
def test_tiny_model_kv_sizes_match_the_sweeps_working_set(tiny_model_files: Path) -> None:
    shape = load_shape(str(tiny_model_files))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_size, shape.dtype) == (
        2,
        2,
        64,
        "bfloat16",
    )
    assert shape.bytes_per_token == 1024
    # compare_sweep.py counts 309 chunks as 77.27 MiB: the same bytes per stored chunk.
    assert C_WORKING_SET * shape.object_bytes(256) / 2**20 == pytest.approx(77.27, abs=0.01)


def test_qwen25_7b_and_llama3_70b(tmp_path: Path) -> None:
    qwen = load_shape(str(_model(tmp_path, "Qwen2.5-7B", QWEN25_7B) / "config.json"))
    assert qwen.head_size == 128 and qwen.bytes_per_token == 57_344  # 56 KiB per token
    assert qwen.object_bytes(256) == 64 + 256 * 57_344  # 14 MiB per chunk
    qwen_tp2 = load_shape(str(tmp_path / "Qwen2.5-7B"), tp_size=2)
    assert qwen_tp2.kv_heads_per_rank == 2 and qwen_tp2.bytes_per_token_per_rank == 28_672
    llama = _model(tmp_path, "Llama-3-70B", LLAMA3_70B)
    assert load_shape(str(llama)).bytes_per_token == 327_680  # 320 KiB per token
    tp8 = load_shape(str(llama), tp_size=8)
    assert (tp8.kv_heads_per_rank, tp8.bytes_per_token_per_rank) == (1, 40_960)
    tp16 = load_shape(str(llama), tp_size=16)  # more ranks than KV heads: vLLM replicates
    assert tp16.bytes_per_token == 2 * 327_680
    assert load_shape(str(llama), dtype="float32").bytes_per_token == 2 * 327_680


def test_plan_answers_for_qwen_and_llama(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qwen = _model(tmp_path, "Qwen2.5-7B", QWEN25_7B)
    workload = ("--prefix-tokens", "4096", "--turn-tokens", "512", "--continue-share", "0.8")
    plan = _plan(
        capsys,
        *("--model", str(qwen), "--cpu-gib", "32", "--disk-gib", "500", "--bucket-gib", "5000"),
        *("--conversations", "400", "--rate", "2", "--hosts", "4", *workload),
        *("--prefill-tps", "12000", "--cpu-mib-s", "8000", "--disk-mib-s", "2500"),
        *("--s3-mib-s", "400", "--sim-requests", "4000"),
    )
    assert [t["tier"] for t in plan["tiers"]] == ["cpu", "disk", "s3"]
    assert plan["tiers"][0]["chunks_per_rank"] == 32 * 2**30 // (64 + 256 * 57_344)
    assert plan["largest_difference_points"] < 3
    assert plan["ttft"]["with_cache_s"] < plan["ttft"]["without_cache_s"]
    assert plan["ttft"]["saved_per_hit_token_us"]["s3"] < 0  # 400 MiB/s: slower than prefill
    rgw = plan["rgw"]["analytic"]
    assert rgw["requests_per_s"] == 8 and rgw["put_mib_s"] == pytest.approx(
        rgw["put_per_s"] * (64 + 256 * 57_344) / 2**20
    )
    llama = _model(tmp_path, "Llama-3-70B", LLAMA3_70B)
    args = ["--tp", "8", "--conversations", "300", "--rate", "1", "--sim-requests", "2000"]
    assert main(["plan", "--model", str(llama), *args, *workload]) == 0
    out = capsys.readouterr().out
    assert "80 layers x 1 KV heads per rank x 128 x 2 (K, V) x 2 B = 40,960 B per token" in out
    assert "| cpu | 5 GiB per rank | 511 |" in out


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (DEEPSEEK_V3_MLA, ("MLA", "kv_lora_rank=512", "576 values per token")),
        (MISTRAL_SLIDING, ("sliding-window", "sliding_window=4096", "one full-attention group")),
        (
            {**QWEN25_7B, "layer_types": ["full_attention", "sliding_attention"] * 14},
            ("hybrid", "'sliding_attention': 14"),
        ),
        ({**LLAMA3_70B, "attention_chunk_size": 8192}, ("chunked local attention",)),
    ],
)
def test_unsupported_attention_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], words: tuple[str]
) -> None:
    model = _model(tmp_path, "m", config)
    with pytest.raises(PlanError) as err:
        load_shape(str(model))
    for word in (*words, "without kv_transfer_config"):
        assert word in str(err.value)
    args = ["plan", "--model", str(model), "--conversations", "10", "--prefix-tokens", "1000"]
    assert main([*args, "--continue-share", "0.5", "--rate", "1"]) == 2
    assert words[0] in capsys.readouterr().err


def test_bad_inputs_say_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    qwen = str(_model(tmp_path, "Qwen2.5-7B", QWEN25_7B))
    base = ["--conversations", "10", "--prefix-tokens", "1000", "--continue-share", "0.5"]
    store_json, longdoc_json = str(REPO / "no-such.json"), str(REPO / "docs/img/bench-longdoc.json")
    cases = {
        ("--model", "Qwen/Qwen2.5-7B"): "never downloads",
        ("--model", str(tmp_path)): "has no config.json",
        ("--model", qwen, "--tp", "3"): "--tp 3: vLLM needs it to divide the 28 attention heads",
        ("--model", qwen, "--dtype", "int4"): "--dtype int4: pass auto, bfloat16",
        ("--model", qwen, "--chunk-size", "200"): "multiple of --block-size (16)",
        ("--model", qwen, "--cpu-gib", "0"): "every tier is off",
        ("--model", qwen, "--continue-share", "1"): "--continue-share 1.0: pass a share in [0, 1)",
        ("--model", qwen, "--bench-store", store_json): "cannot read",
        ("--model", qwen, "--bench-ttft", longdoc_json): "not the JSON",
    }
    for args, message in cases.items():
        assert main(["plan", *base, *args, "--rate", "1"]) == 2, args
        assert message in capsys.readouterr().err, args
    assert main(["plan", "--model", qwen, *base[2:], "--rate", "1"]) == 2
    assert "pass --conversations" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match=r"cannot read .*bad\.json as JSON"):
        load_shape(str(tmp_path / "bad.json"))
    with pytest.raises(PlanError, match="no positive integer 'num_hidden_layers'"):
        load_shape(str(_model(tmp_path, "empty", {"model_type": "x"})))


def test_hub_id_resolves_only_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen2.5-7B"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN25_7B))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    shape = load_shape("Qwen/Qwen2.5-7B")
    assert shape.name == "Qwen/Qwen2.5-7B" and shape.bytes_per_token == 57_344


# ------------------------------------------------------------------- hit rate: analytic vs LRU
@pytest.mark.parametrize(
    ("conversations", "prefix", "turn", "share", "cap"),
    [
        (13, 2048, 256, 0.8, 77),
        (13, 2048, 256, 0.8, 154),
        (50, 2048, 256, 0.8, 309),
        (100, 4096, 256, 0.9, 800),
        (10, 8192, 512, 0.5, 309),
        (200, 1000, 100, 0.7, 2000),
    ],
)
def test_analytic_estimate_is_within_3_points_of_the_simulated_lru(
    conversations: int, prefix: int, turn: int, share: float, cap: int
) -> None:
    w = Workload(conversations, prefix, turn, share, 1.0)
    estimate = Analytic(w, 256, 128).estimate({"cpu": cap})
    simulated = simulate(w, {"cpu": cap}, 256, 128, requests=8000).mix
    assert estimate.hit_rate() == pytest.approx(simulated.hit_rate(), abs=0.03)


def test_s3_requests_of_estimate_and_simulation_agree() -> None:
    w = Workload(50, 2048, 256, 0.8, 1.0)
    caps = {"cpu": 200, "s3": float("inf")}
    estimate = Analytic(w, 256, 16).estimate(caps)
    simulated = simulate(w, caps, 256, 16, requests=8000).mix
    assert estimate.hit_rate() == pytest.approx(simulated.hit_rate(), abs=0.03)
    for field in ("heads", "gets", "puts"):
        assert getattr(estimate, field) == pytest.approx(getattr(simulated, field), rel=0.1)
    # A bucket that never evicts: every chunk is computed once, then read from some tier.
    assert simulated.puts == pytest.approx((1 - 0.8) * 2048 / 256 + 0.8 * 256 / 256, rel=0.05)


# ------------------------------------------------------------- experiment C, as measured
def _c_stream() -> list[Any]:
    prompts = (r.prompt for r in itertools.islice(MixedLoad(FULL, 0).stream("sweep"), 120))
    return requests_from_prompts(prompts, 256)


def test_simulating_experiment_cs_requests_reproduces_the_measured_sweep() -> None:
    requests = _c_stream()
    assert len({k for r in requests for k in r.keys}) == C_WORKING_SET
    for share, measured in C_SWEEP.items():
        cap = int(share * C_WORKING_SET)
        assert run(requests, {"cpu": cap}, 256, 128).hit_rate() == pytest.approx(
            measured, abs=0.03
        ), share
        with_disk = run(requests, {"cpu": cap, "disk": 2 * C_WORKING_SET}, 256, 128)
        assert with_disk.hit_rate() == pytest.approx(0.754, abs=0.03), share


def test_plan_of_experiment_c_brackets_the_measured_sweep(
    tiny_model_files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """C's settings (120 requests from empty, 20 % new prompts of 2048 tokens, +256 per
    continuation): the plan's analytic estimate within 6 points of its simulation, and each
    measured hit rate inside the band of the simulated runs."""
    object_mib = 262_208 / 2**20
    for share, measured in C_SWEEP.items():
        cpu_gib = int(share * C_WORKING_SET) * object_mib / 1024 + 1e-9
        plan = _plan(
            capsys,
            *("--model", str(tiny_model_files), "--cpu-gib", str(cpu_gib), "--requests", "120"),
            *("--prefix-tokens", "2048", "--turn-tokens", "256", "--continue-share", "0.8"),
            *("--rate", "19.6", "--block-size", "128", "--bench-ttft", str(BENCH_TTFT)),
        )
        assert plan["tiers"][0]["chunks_per_rank"] == int(share * C_WORKING_SET)
        assert plan["largest_difference_points"] < 6, share
        low, high = plan["simulation"]["run_spread"]
        assert low <= measured <= high, (share, low, measured, high)
        assert plan["ttft"]["prompt_tokens"] == pytest.approx(3000, rel=0.1)
        assert plan["ttft"]["with_cache_s"] < plan["ttft"]["without_cache_s"]


def test_prefill_of_another_model_is_not_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_model_files: Path
) -> None:
    doc = json.loads(BENCH_TTFT.read_text()) | {"model": str(tiny_model_files)}
    (tmp_path / "ttft.json").write_text(json.dumps(doc))
    qwen = _model(tmp_path, "Qwen2.5-7B", QWEN25_7B)
    args = ["--conversations", "20", "--prefix-tokens", "2048", "--continue-share", "0.8"]
    plan = _plan(
        capsys,
        "--model",
        str(qwen),
        *args,
        "--rate",
        "1",
        "--bench-ttft",
        str(tmp_path / "ttft.json"),
    )
    assert "no prefill throughput" in plan["ttft"]["skipped"]
    assert any("not this model" in s for s in plan["ttft"]["sources"])
    tiny_args = ["--rate", "1", "--bench-ttft", str(tmp_path / "ttft.json"), "--sim-requests", "0"]
    tiny = _plan(capsys, "--model", str(tiny_model_files), *args, *tiny_args)
    ttft = tiny["ttft"]
    assert ttft["hit_rates_from"] == "analytic estimate"
    assert ttft["without_cache_s"] == pytest.approx(
        ttft["prompt_tokens"] * 2.1793 / 16384, rel=1e-3
    )


def test_the_simulation_admits_to_s3_from_the_second_sight_as_the_connector_does() -> None:
    """``remote_admit_after: 2`` (kvtier.admission): a chunk seen once goes to the CPU tier
    only; seen again while the CPU tier holds it, it is written to S3 then (once); computed
    on its first sight, it waits for the next."""
    caps = {"cpu": 100.0, "s3": math.inf}
    one_off = SimRequest(["a0", "a1", "a2"], 3 * 256 + 1)
    first = SimRequest(["b0", "b1"], 2 * 256 + 1)
    longer = SimRequest(["b0", "b1", "b2"], 3 * 256 + 1)
    sim = TierSimulation(caps, 256, 128, admit_after=2)
    sim.request(one_off)
    sim.request(first)
    assert sim.mix.puts == 0
    sim.request(longer)  # b0, b1 from the CPU tier, now admitted; b2 computed, seen once
    assert sim.mix.puts == 2
    sim.request(longer)  # b2 admitted
    assert sim.mix.puts == 3
    assert run([one_off, first, longer, longer], caps, 256, 128).puts == 6  # every computed one


# Experiment C's first 120 requests with the S3 tier, capped or not, admission off and on, as
# measured (docs/benchmarks.md, docs/img/bench-shared-tier.json): (CPU tier, S3 cap) in
# chunks (None: no cap), remote_admit_after -> (hit rate, S3 chunks written).
C_SHARED_TIER = {
    (77, None, 1): (0.741, 351),
    (77, None, 2): (0.705, 243),
    (77, 77, 1): (0.524, 653),
    (77, 77, 2): (0.596, 403),
    (154, None, 1): (0.739, 354),
    (154, None, 2): (0.720, 240),
}


def test_simulating_experiment_c_with_the_cap_and_admission_reproduces_the_measured_runs() -> None:
    """The planner's simulation is the reference an ideal LRU gives: each measured hit rate
    within 3.5 points of it; with admission the chunks written are the ones at least two
    requests hold (the measured runs without it also write chunks twice: continuations that
    arrive while their previous turn is computed, which the one-by-one simulation has not)."""
    requests = _c_stream()
    for (cpu, cap, admit), (hit_rate, written) in C_SHARED_TIER.items():
        caps = {"cpu": float(cpu), "s3": float(cap) if cap else math.inf}
        sim = run(requests, caps, 256, 128, admit_after=admit)
        assert sim.hit_rate() == pytest.approx(hit_rate, abs=0.035), (cpu, cap, admit)
        if admit == 2 and cap is None:
            assert sim.puts == pytest.approx(written, abs=5)
    seen_twice = sum(n >= 2 for n in Counter(k for r in requests for k in r.keys).values())
    assert run(requests, {"cpu": 77.0, "s3": math.inf}, 256, 128, admit_after=2).puts == seen_twice
