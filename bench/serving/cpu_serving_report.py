"""What bench.serving.cpu_serving judges and shows: the servers' names, its goals, its table and its plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.driver import pyplot
from bench.serving.serving_rounds import ahead_on_every_figure, figures

POISSON_RATE = 0.5
OURS = "stallfree"
OURS_PROCESS = "stallfree, core in its own process"  # the app with core_process true
ALONE = "engine alone"
VLLM, Q4, RAY_LLM = "vLLM CPU", "llama.cpp Q4_1", "Ray Serve LLM"
GOALS = {
    "c16_output_tok_per_s_vs_engine_alone_min": 0.9,
    "c16_output_tok_per_s_vs_vllm_min": 1.5,
    "c16_tbt_p99_vs_vllm_max": 0.5,
    "ttft_p50_vs_every_peer_max": 0.8,  # at c=1 and at c=16
    "c1_tbt_p50_vs_llama_cpp_q4_1_max": 0.9,  # the same Q4_1 file, served natively
    "c16_output_tok_per_s_vs_llama_cpp_q4_1_min": 1.5,
    "overhead_per_token_s_max": 0.001,
    "overhead_per_request_s_max": 0.020,
    "poisson_tbt_p99_vs_vllm_max": 0.5,  # median of the rounds' seeds
    "ahead_of_ray_serve_llm_on_every_figure": True,
}


def goals_met(
    ratios: dict[str, dict[str, float]],
    overhead: dict[str, float],
    served_over_alone: float,
    quoted: set[str],
) -> dict[str, bool]:
    """On the app as shipped. A goal against a peer not measured in this run (`quoted`: figures
    of another day, maybe another CPU) is unmet, not judged, as bench.quality's answer benches
    leave theirs; against every peer, it is met only when every peer was measured and passed."""
    g = GOALS

    def against(peer: str, met: Callable[[dict[str, float]], bool]) -> bool:
        if peer in quoted:
            print(f"{peer} not measured: its goals are unmet, not judged")
            return False
        return met(ratios.get(peer, {}))

    def every_peer(figure: str) -> bool:
        measured = [name for name in ratios if name not in (OURS_PROCESS, ALONE)]
        passed = all(ratios[name].get(figure, 1e9) <= g["ttft_p50_vs_every_peer_max"] for name in measured)
        return passed and not quoted

    return {
        "served c=16 tok/s >= 0.9x the engine alone's": served_over_alone
        >= g["c16_output_tok_per_s_vs_engine_alone_min"],
        "ahead of Ray Serve LLM on every figure": against(RAY_LLM, ahead_on_every_figure),
        "c=16 output tok/s >= 1.5x vLLM CPU's": against(
            VLLM, lambda r: r.get("c16_output_tok_per_s", 0.0) >= g["c16_output_tok_per_s_vs_vllm_min"]
        ),
        "c=16 TBT p99 <= 0.5x vLLM CPU's": against(
            VLLM, lambda r: r.get("c16_tbt_p99_s", 1e9) <= g["c16_tbt_p99_vs_vllm_max"]
        ),
        "c=16 TTFT p50 <= 0.8x every peer's": every_peer("c16_ttft_p50_s"),
        "c=1 TBT p50 <= 0.9x llama.cpp Q4_1's": against(
            Q4, lambda r: r.get("c1_tbt_p50_s", 1e9) <= g["c1_tbt_p50_vs_llama_cpp_q4_1_max"]
        ),
        "c=16 output tok/s >= 1.5x llama.cpp Q4_1's": against(
            Q4,
            lambda r: r.get("c16_output_tok_per_s", 0.0) >= g["c16_output_tok_per_s_vs_llama_cpp_q4_1_min"],
        ),
        "c=1 TTFT p50 <= 0.8x every peer's": every_peer("c1_ttft_p50_s"),
        "serving overhead <= 1 ms per token": overhead["per_token_s"] <= g["overhead_per_token_s_max"],
        "serving overhead <= 20 ms per request": overhead["per_request_s"] <= g["overhead_per_request_s_max"],
        "Poisson TBT p99 (median of seeds) <= 0.5x vLLM CPU's": against(
            VLLM, lambda r: r.get("poisson_tbt_p99_s", 1e9) <= g["poisson_tbt_p99_vs_vllm_max"]
        ),
    }


COLUMNS = (  # (header, figure, scale)
    ("c=1 tok/s", "c1_output_tok_per_s", 1), ("c=1 TTFT p50", "c1_ttft_p50_s", 1e3),
    ("c=1 TBT p50", "c1_tbt_p50_s", 1e3), ("c=16 tok/s", "c16_output_tok_per_s", 1),
    ("c=16 TTFT p50", "c16_ttft_p50_s", 1e3), ("c=16 TBT p50", "c16_tbt_p50_s", 1e3),
    ("c=16 TBT p99", "c16_tbt_p99_s", 1e3), ("Poi TBT p99", "poisson_tbt_p99_s", 1e3),
)  # fmt: skip


def print_table(results: dict, body: dict) -> None:
    print(f"{'server':<36}" + "".join(f"{h:>14}" for h, _, _ in COLUMNS))
    for name, r in results.items():
        f = figures(r)
        label = name + (" (quoted)" if "quoted" in r else "")
        cells = (f"{f[key] * scale:>14.1f}" if key in f else f"{'-':>14}" for _, key, scale in COLUMNS)
        print(f"{label:<36}" + "".join(cells))
    print(f"(tok/s, and ms; medians of {body['workload']['rounds']} rounds; Poisson {POISSON_RATE}/s offers "
          f"{body['workload']['poisson_offered_tok_per_s']:.1f} tok/s; quoted: bench/peers.py)")  # fmt: skip
    for name, by_figure in body["ratios_ours_over_peer"].items():
        print(f"ours / {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in by_figure.items()))
        for index, by_round in enumerate(
            body["ratios_by_round"].get(name, {}).get("c16_output_tok_per_s", [])
        ):
            print(f"    round {index + 1}: c16 tok/s {by_round:.2f}x")
    for name, moved in body["rounds_disagree"].items():
        print(f"ROUNDS DISAGREE, ours / {name}: " + ", ".join(f"{k} by {v:.0%}" for k, v in moved.items()))
    ms = {key: value * 1e3 for key, value in body["serving_overhead"].items()}
    print(
        f"serving overhead (c=1, median of rounds): per token {ms['per_token_s']:.2f} ms (client TBT "
        f"mean {ms['client_tbt_mean_s']:.1f} ms, engine alone {ms['engine_alone_tbt_mean_s']:.1f} ms); "
        f"per request {ms['per_request_s']:.1f} ms; served c=16 / engine alone "
        f"{body['served_c16_over_engine_alone']:.2f}x; tokens per stream message "
        f"{body['tokens_per_stream_message'].get(OURS, float('nan')):.2f}"
    )


def plot(path: Path, raw: dict[str, dict[str, list[dict]]]) -> None:
    """From each measured server's requests (bench.driver.raw_path's side file holds them)."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, run in zip(axes, ("c1", "c16", "poisson"), strict=True):
        for name, by_run in raw.items():
            gaps = sorted(g for t in by_run[run] for g in t["token_intervals_s"])
            axis.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
        axis.set_xscale("log")
        axis.set_xlabel("time between tokens (s)")
        axis.set_title(run)
    axes[0].set_ylabel("fraction of token intervals")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
