"""Which figures of bench.gpu's result files the docs show, per device: the H100's last run
predates async scheduling and the served part; the H200's has every part but served_options."""

from __future__ import annotations

from docs.hooks.bench_specs import MODEL_AND_OVERHEAD, steps_rows
from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values

_GPU_STEPS = (
    Values(
        "device",
        "The device, and what this run measured of it (the floors use the spec sheet):",
        (
            Col("device", "parts/steps/device/name", "str"),
            Col("copy, bytes read + written (B/s)", "parts/steps/device/measured_bytes_per_s"),
            Col("bf16 matmul (FLOP/s)", "parts/steps/device/measured_bf16_flops_per_s"),
            Col("spec sheet HBM (B/s)", "parts/steps/device/bytes_per_s"),
        ),
    ),
    steps_rows(
        "Llama-3-8B-shaped steps (bf16, 512 tokens of context per decode), in ms:",
        MODEL_AND_OVERHEAD,
        at="parts/steps/steps",
    ),
)
_OFFLINE_CAPTION = "Offline, 1000 ShareGPT-shaped requests (anchor: vLLM's 6,582.87 output tok/s on an H100):"
_OFFLINE_COLS = (
    Col("wall", "wall_s", "s"),
    Col("steps", "steps", "int"),
    Col("model", "model_s", "s"),
    Col("steps' host side", "overhead_s", "s"),
    Col("decode-only steps", ("decode_only_steps", "decode_only_s"), ("int", "s")),
    Col("decodes a step", "mean_decodes_per_step"),
)


def _offline(caption: str, goal: str | None, *extra: Col, name: str = "offline") -> Rows:
    return Rows(
        name,
        caption,
        "parts/offline",
        ("run",),
        (Col("output tok/s", "output_tok_per_s", best="max", goal=goal), *_OFFLINE_COLS, *extra),
    )


def _exactness(at: str, caption: str, *extra: Col) -> Rows:
    return Rows(
        at.rsplit("/", 1)[-1],
        caption,
        at,
        (),
        (
            Col("dtype", "dtype", "str"),
            Col("CUDA graphs", "cuda_graphs", "yes"),
            *extra,
            Col("identical outputs", ("identical", "prompts"), ("int", "int"), sep=" of "),
            Col("KV blocks returned", "kv_blocks_returned", "yes"),
            Col("passed (divergences only at near-ties)", "passed", "yes"),
        ),
    )


def _gpu_spec(device: str) -> BenchSpec:
    """bench.gpu's file for one device, as the H100's last run wrote it (before async scheduling
    and the served part)."""
    return BenchSpec(
        "benchmarks/gpu.md",
        f"bench.gpu on an {device}: exactness, step times against the HBM and FLOP floors, offline",
        (
            _exactness(
                "parts/exactness/against_transformers",
                "Our engine against transformers, greedy (random SmolLM2-shaped checkpoint):",
            ),
            *_GPU_STEPS,
            _offline(_OFFLINE_CAPTION, "offline >= 6,600 output tok/s (eager or graphs, the better)"),
        ),
    )


def _served_figures(prefix: str = "") -> tuple[Col, ...]:
    """A run's figures (prefix "median/": the median of its seeds) and its failed requests."""
    return (
        Col("output tok/s", f"{prefix}output_tok_per_s"),
        Col("TTFT p50 / p99", (f"{prefix}ttft_p50_s", f"{prefix}ttft_p99_s"), "ms"),
        Col("TBT p50 / p99", (f"{prefix}tbt_p50_s", f"{prefix}tbt_p99_s"), "ms"),
        Col("failed", "failed", "int"),
    )


_IDLE_GOAL = "offline: the device idle (wall less model time) <= 10% of the wall time (graphs, async)"


def _gpu_served_spec(device: str) -> BenchSpec:
    """bench.gpu's file with every part: async scheduling in the exactness and offline parts, and
    the served part."""
    systems = ("engine_alone", "served")
    return BenchSpec(
        "benchmarks/gpu.md",
        f"bench.gpu on an {device}: exactness, steps against the floors, offline, served through Ray Serve",
        (
            Values(
                "measured_at",
                "When each part was measured:",
                tuple(
                    Col(part, f"measured_at/{part}", "str")
                    for part in ("exactness", "steps", "offline", "served", "moe")
                ),
            ),
            _exactness(
                "parts/exactness/against_transformers",
                "Our engine against transformers, greedy (random SmolLM2-shaped checkpoint):",
                Col("async scheduling", "async_scheduling", "yes"),
            ),
            _exactness(
                "parts/exactness/async_against_sync",
                "Async scheduling against synchronous steps, greedy (and how many of its submissions"
                " waited for the device, under CUDA's sync debug mode):",
                Col(
                    "submissions that waited",
                    ("submissions_that_waited", "submissions"),
                    ("int", "int"),
                    sep=" of ",
                ),
            ),
            *_GPU_STEPS,
            _offline(
                _OFFLINE_CAPTION + " `graphs` runs async scheduling, `graphs_sync` synchronous steps,"
                " `graphs_1024` vLLM's sizes on an H100 (1,024 requests at once, a 16,384-token budget;"
                " a run that has it); the device idle is the wall time less the model's:",
                None,  # the goal's verdict is in the goals table: its name changed after this file's run
                Col("device idle", "device_idle_share", "pct", goal=_IDLE_GOAL, goal_row="graphs"),
            ),
            Rows(
                "served_closed",
                "Served through Ray Serve (one replica, streamed `/v1/completions`) and the engine alone,"
                " the same requests, closed loops:",
                "parts/served/*/*",
                ("system / run",),
                _served_figures(),
                only=tuple(f"{system}/{run}" for system in systems for run in ("c1", "c64")),
            ),
            Rows(
                "served_poisson",
                "Poisson arrivals (requests/s), medians of 3 seeds:",
                "parts/served/*/*",
                ("system / rate",),
                _served_figures("median/"),
                only=tuple(f"{system}/poisson_{rate}" for system in systems for rate in (4, 8, 16)),
            ),
            Values(
                "served_vs_alone",
                "Served over the engine alone:",
                (
                    *_vs_alone_cols("parts/served/served_vs_alone/", goals=True),
                    *(
                        Col(
                            f"Poisson {rate}/s output tok/s",
                            f"parts/served/served_vs_alone/poisson_{rate}_tok_per_s_ratio",
                            "x",
                        )
                        for rate in (4, 8, 16)
                    ),
                ),
            ),
            *_cores_rows("served_cores", "the c=64 run"),
            *_MOE,
        ),
    )


def _cores_rows(name: str, run: str) -> tuple[Rows, ...]:
    """Where the host's cores went during the served part's c=64 run, served and alone."""
    return tuple(
        Rows(
            f"{name}_{system}",
            f"Where the host's cores went during {run}, {label}: CPU seconds per process (the largest"
            " six, then the rest), and their share of the run's core-seconds:",
            f"parts/served/{system}/c64/cpu/by_process/*",
            ("process",),
            (Col("CPU s", "cpu_s"), Col("share of the cores", "share_of_cores", "pct")),
        )
        for system, label in (("served", "served"), ("engine_alone", "the engine alone"))
    )


_MOE = (
    Rows(
        "moe_steps",
        "Qwen3-30B-A3B-shaped decode steps (bf16, 512 tokens of context per decode; experts read: the"
        " distinct experts the step's tokens picked, summed over the layers), in ms:",
        "parts/moe/steps",
        (),
        (
            Col("case", "case", "str"),
            Col("step", "step_ms", "ms_value"),
            Col("experts read", "experts_read", "int"),
            Col("touched-expert floor", "floor_ms", "ms_value"),
            Col("step / floor", "ratio", "x"),
            Col("goal", "goal_met", "met"),
        ),
    ),
    Values(
        "moe_offline",
        "The mixture offline (CUDA graphs, async scheduling), the dense model's workload:",
        (
            Col("output tok/s", "parts/moe/offline_graphs/output_tok_per_s"),
            Col("wall", "parts/moe/offline_graphs/wall_s", "s"),
            Col("steps", "parts/moe/offline_graphs/steps", "int"),
            Col("model", "parts/moe/offline_graphs/model_s", "s"),
            Col("decodes a step", "parts/moe/offline_graphs/mean_decodes_per_step"),
            Col("device idle", "parts/moe/offline_graphs/device_idle_share", "pct"),
        ),
    ),
)


def _vs_alone_cols(at: str, goals: bool) -> tuple[Col, ...]:
    """A served run's closed loops over the engine alone's (`at`: where gpu_served.comparison's
    figures are), with the served goals where `goals`."""

    def col(header: str, key: str, unit: str, goal: str) -> Col:
        return Col(header, at + key, unit, goal=goal if goals else None)

    return (
        col(
            "c=64 output tok/s",
            "high_concurrency_tok_per_s_ratio",
            "x",
            "served at the highest concurrency: output tok/s >= 0.95x the engine alone's",
        ),
        col(
            "c=1 TTFT p50, extra",
            "c1_ttft_p50_extra_s",
            "ms",
            "served c=1 TTFT p50 <= the engine alone's + 10 ms",
        ),
        col("c=1 TBT p50", "c1_tbt_p50_ratio", "x", "served c=1 TBT p50 <= 1.1x the engine alone's"),
        col("failed requests", "failed_requests", "int", "no request failed, served or alone"),
    )


def _rehearsal_spec() -> BenchSpec:
    """bench.gpu --rehearse's file: the served parts on this CPU, a tiny model's short steps
    standing in for a GPU's."""
    systems = ("engine_alone", "served")
    vs_alone = _vs_alone_cols("vs_alone/", goals=False)
    return BenchSpec(
        "benchmarks/gpu.md",
        "bench.gpu --rehearse on this CPU: the served parts at the GPU plan's concurrency, a tiny model",
        (
            Values(
                "rehearsal_measured_at",
                "When each part was measured:",
                tuple(
                    Col(part, f"measured_at/{part}", "str")
                    for part in ("offline", "overlap", "served", "served_options")
                ),
            ),
            _offline(
                "Offline, the GPU plan's ShareGPT-shaped requests with a GPU's batch (token budget and"
                " requests at once as shown), on the CPU's attention (no graphs), `eager` with async"
                " scheduling, `eager_sync` without; the steps' host side is the engine's own work"
                " around the model, and the wall time less the model's is the host's share:",
                None,
                Col("host share", "device_idle_share", "pct"),
                Col("garbage collector", "gc_pause_s", "s"),
                Col("requests", "requests", "int"),
                Col("budget / at once", ("budget", "max_num_seqs"), ("int", "int")),
                name="rehearsal_offline",
            ),
            Rows(
                "rehearsal_overlap",
                "The GPU plan's offline workload (1000 requests, lengths capped at 1024) over a stand-in"
                " device: a thread that sleeps each step's time on an H100 (the simulator's roofline for"
                " Llama-3-8B, its per-step overhead left out), steps in the order submitted; the host's"
                " side is all the engine's own. `async` with async scheduling, `sync` without:",
                "parts/overlap",
                ("run",),
                (
                    Col("device idle", "device_idle_share", "pct"),
                    Col("of it between steps", "device_idle_between_steps_s", "s"),
                    Col("wall", "wall_s", "s"),
                    Col("device busy", "device_busy_s", "s"),
                    Col("steps", "steps", "int"),
                    Col("steps in flight, at most", "most_steps_in_flight", "int"),
                    Col("decodes a step", "mean_decodes_per_step"),
                    Col("garbage collector", "gc_pause_s", "s"),
                ),
            ),
            Rows(
                "rehearsal_closed",
                "Served through Ray Serve (one replica: the API in its process, the engine core in a"
                " child process, as on a GPU) and the engine alone (built the same way), the same"
                " requests, closed loops (the last round):",
                "parts/served/*/*",
                ("system / run",),
                _served_figures(),
                only=tuple(f"{system}/{run}" for system in systems for run in ("c1", "c64")),
            ),
            *_cores_rows("rehearsal_cores", "the last round's c=64 run"),
            Values(
                "rehearsal_vs_alone",
                "Served over the engine alone, the median of the rounds:",
                _vs_alone_cols("parts/served/served_vs_alone/", goals=True),
            ),
            Rows(
                "rehearsal_rounds",
                "Each round (the engine alone, then served) on its own:",
                "parts/served/rounds_vs_alone",
                ("round",),
                _vs_alone_cols("", goals=False),
                labels=tuple((str(index), str(index + 1)) for index in range(3)),
            ),
            Rows(
                "rehearsal_options",
                "Served with other settings (`engine.core_process: false`, the core on a thread of the"
                " replica's process; `ingress: separate`, an Ingress in front of an EngineReplica), over"
                " the engine alone's closed loops in the same part:",
                "parts/served_options",
                ("setting",),
                vs_alone,
                only=("core_thread", "separate"),
            ),
        ),
    )


GPU_SPECS: dict[str, BenchSpec] = {
    "gpu_h100": _gpu_spec("H100"),
    "gpu_h200": _gpu_served_spec("H200"),
    "gpu_rehearsal": _rehearsal_spec(),
}
