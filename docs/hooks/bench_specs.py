"""Which figures of the engine's result files the docs show (one process, no fleet): per file,
its page and tables. bench_tables.py renders them; every file's header and goals come too."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values


def steps_rows(caption: str, split: tuple[Col, ...], at: str = "steps") -> Rows:
    return Rows(
        "steps",
        caption,
        at,
        (),
        (
            Col("dtype", "dtype", "str"),
            Col("case", "case", "str"),
            Col("step", "step_ms", "ms_value"),
            *split,
            Col("floor", ("floor_ms", "floor_kind"), ("ms_value", "str"), sep=" "),
            Col("step / floor", "ratio", "x"),
            Col("goal", "goal_met", "met"),
        ),
    )


# What each step's time is split into: the model's share and the rest, as a step listener reads
# it (from 2026-11-25); an earlier run timed the model runner's whole execute instead.
MODEL_AND_OVERHEAD = (
    Col("model (forward + sampling)", "model_ms", "ms_value"),
    Col("overhead", "overhead_ms", "ms_value"),
    Col("overhead share", "overhead_share", "pct"),
)
_RUNNER_AND_HOST = (Col("model runner", "runner_ms", "ms_value"), Col("host", "host_ms", "ms_value"))


# bench spec's goals: each speculating method against none at each point it is held to
_SPEC_RATIOS = tuple(
    Col(
        f"{method}, {point}",
        f"points/{point}/{method}_vs_plain",
        "x",
        goal=f"{method}_{point.replace(' c=', '_c')}_tok_per_s_vs_plain_min",
    )
    for method in ("suffix", "ngram")
    for point in ("editing c=1", "chat c=1", "chat c=16", "chat c=64")
)


ENGINE_SPECS: dict[str, BenchSpec] = {
    "offline_cpu": BenchSpec(
        "benchmarks/offline_cpu.md",
        "Offline throughput and TTFT against Hugging Face static batching",
        (
            Rows(
                "systems",
                "Every request at once (medians are over requests):",
                "summaries",
                ("system",),
                (
                    Col("tok/s", "output_tok_per_s", best="max"),
                    Col("TTFT p50", "ttft_p50_s", "s", best="min"),
                    Col("TTFT p99", "ttft_p99_s", "s", best="min"),
                    Col("e2e p50", "e2e_p50_s", "s", best="min"),
                    Col("wall", "wall_s", "s", best="min"),
                ),
            ),
            Values(
                "ratios",
                "Against the best static batch:",
                (
                    Col("throughput", "ratios/throughput_ratio", "x", goal="throughput"),
                    Col("TTFT p50", "ratios/ttft_p50_ratio", "x", goal="ttft_p50"),
                    Col("baseline", "ratios/throughput_baseline", "str"),
                ),
            ),
        ),
    ),
    "cpu_steps": BenchSpec(
        "benchmarks/cpu_steps.md",
        "Engine step times on this CPU against its measured floors",
        (
            Values(
                "floors",
                "Floors measured in the same run (the best of several methods):",
                (
                    Col("read bandwidth (GB/s)", "floors/read_gb_per_s", "num"),
                    Col("fp32 matmul GFLOP/s", "floors/matmul_float32_gflop_per_s"),
                    Col("bf16 matmul GFLOP/s", "floors/matmul_bfloat16_gflop_per_s"),
                    Col("quantized matmul GOP/s", "floors/matmul_quantized_gop_per_s"),
                ),
            ),
            Rows(
                "bandwidth",
                "Bytes per second (GB/s), each method:",
                "floor_methods/read_gb_per_s",
                ("method",),
                (Col("GB/s", "", best="max"),),
            ),
            steps_rows("Step times in ms and their ratio to this run's floor:", MODEL_AND_OVERHEAD),
            Rows(
                "sampled",
                "A decode step sampled at temperature 0.7, top_p 0.95 (`-sampled`) over the greedy step "
                "of its variant and batch, timed right before it:",
                "sampled_over_greedy/*/*",
                ("variant", "case"),
                (Col("sampled over greedy", "", "x"),),
            ),
            Rows(
                "amx",
                "How many times faster torch's bf16 GEMM (oneDNN: AMX tiles where the CPU has them) "
                "multiplies a 4-bit weight's bf16 copy than our 4-bit kernel its codes, by rows x K x N "
                "(what `amx_weights` trades on; its threshold is 32 rows):",
                "amx_over_q4_kernel_by_shape",
                ("shape",),
                (Col("copy over kernel", "", "x"),),
            ),
        ),
    ),
    "cpu_steps_torch_ops": BenchSpec(
        "benchmarks/cpu_steps.md",
        "Engine step times with torch's ops alone (an earlier run, its own floors)",
        (steps_rows("Step times with torch's ops only, in ms:", _RUNNER_AND_HOST),),
    ),
    "dtype_agreement": BenchSpec(
        "benchmarks/dtype_agreement.md",
        "What bf16 changes in greedy outputs against fp32",
        (
            Values(
                "agreement",
                "Held text prompts, greedy, in both dtypes:",
                (
                    Col("prompts", "num_prompts", "int"),
                    Col("tokens per output", "max_tokens", "int"),
                    Col("outputs identical", "identical_outputs", "pct"),
                    Col("first token the same", "first_token_agrees", "pct"),
                    Col(
                        "tokens before the first difference (median)", "tokens_before_first_difference_median"
                    ),
                    Col("tokens before the first difference (mean)", "tokens_before_first_difference_mean"),
                ),
            ),
            Rows(
                "answers",
                "The chat question, answered in each dtype:",
                "chat_answers",
                ("dtype",),
                (Col("answer", "", "str"),),
            ),
        ),
    ),
    "quantization": BenchSpec(
        "benchmarks/quantization.md",
        "What the GGUF's own blocks and int8 change against the dequantized weights",
        (
            Values(
                "reference",
                "The reference: the weights dequantized, float32:",
                (Col("perplexity", "reference/perplexity", "num"),),
            ),
            Rows(
                "variants",
                "Each variant in the same run:",
                "variants",
                (),
                (
                    Col("variant", "variant", "str"),
                    Col("perplexity", "perplexity", "num"),
                    Col("against the reference", "vs_dequantized", "pct"),
                    Col("greedy prompts differing (of 8)", "greedy_differing", "int"),
                ),
            ),
        ),
    ),
    "prefix_cpu": BenchSpec(
        "benchmarks/prefix_cpu.md",
        "Prefix caching on against off, one engine",
        (
            Rows(
                "summary",
                "TTFT under Poisson arrivals (median of seeds), throughput with every request at once:",
                "summary",
                (),
                (
                    Col("workload", "workload", "str"),
                    Col("prefix cache", "system", "str"),
                    Col("TTFT p50", ("ttft_p50_s", "ttft_p50_spread_s"), ("s", "range"), sep=" "),
                    Col("TTFT p99", "ttft_p99_s", "s"),
                    Col("burst tok/s", "burst_output_tok_per_s"),
                    Col("hit rate", "hit_rate", "pct"),
                ),
            ),
            Values(
                "ratios",
                "Caching on over off:",
                (
                    Col(
                        "shared prefix TTFT p50",
                        "ratios/shared_prefix_ttft_p50_ratio",
                        "x",
                        goal="shared_prefix_ttft_p50_ratio_max",
                    ),
                    Col(
                        "shared prefix throughput",
                        "ratios/shared_prefix_throughput_ratio",
                        "x",
                        goal="shared_prefix_throughput_ratio_min",
                    ),
                    Col("multi-turn TTFT p50", "ratios/multi_turn_ttft_p50_ratio", "x"),
                    Col(
                        "nothing shared: throughput",
                        "ratios/no_shared_throughput_ratio",
                        "x",
                        goal="no_shared_throughput_ratio_min",
                    ),
                    Col(
                        "nothing shared: the cache's own work, share of the run",
                        "no_shared_prefix_cache_bookkeeping_share",
                        "pct",
                    ),
                ),
            ),
        ),
    ),
    "priority_cpu": BenchSpec(
        "benchmarks/priority_cpu.md",
        "Request priority: its cost when unused, and who gets served first",
        (
            Rows(
                "runs",
                "(a) and (b): the same workload, priority left out, 0 everywhere, half at 1:",
                "",
                ("run",),
                (
                    Col("steps", "num_steps", "int"),
                    Col("preemptions", "num_preemptions", "int"),
                    Col("schedule() p50", "schedule_us_p50", "us_value"),
                    Col("tok/s", "output_tok_per_s"),
                    Col("tok per CPU-s", "output_tok_per_cpu_s"),
                ),
                only=("a_priority_left_out", "a_priority_zero", "b_half_priority_one"),
            ),
            Values(
                "identical",
                "(a) priority 0 everywhere against priority left out:",
                (
                    Col(
                        "the same steps and tokens",
                        "a_priority_zero/identical_steps_and_tokens",
                        "yes",
                        goal="a_identical_to_no_priority",
                    ),
                ),
            ),
            Rows(
                "late",
                "(c) late priority-0 arrivals behind queued priority-1 requests: TTFT in steps (median):",
                "c_late_urgent",
                ("scheduler",),
                (
                    Col(
                        "late priority 0",
                        "high_ttft_steps_p50",
                        goal="c_high_ttft_below_low",
                        goal_row="priority",
                    ),
                    Col("queued priority 1", "low_ttft_steps_p50"),
                    Col("steps", "num_steps", "int"),
                    Col("preemptions", "num_preemptions", "int"),
                    Col("tok/s", "output_tok_per_s"),
                ),
            ),
        ),
    ),
    "spec": BenchSpec(
        "benchmarks/spec.md",
        "Speculative decoding (prompt lookup, suffix decoding) against none, on editing, JSON and chat",
        (
            Rows(
                "points",
                "Output tok/s per workload (median over seeds [spread]); c=1: decode tok/s:",
                "points",
                ("workload",),
                (
                    Col("no speculation", "plain_tok_per_s", "num"),
                    Col("prompt lookup (k=4)", "ngram_tok_per_s", "num"),
                    Col("suffix decoding", "suffix_tok_per_s", "num"),
                    Col("prompt lookup / none", "ngram_vs_plain", "x"),
                    Col("suffix / none", "suffix_vs_plain", "x"),
                ),
            ),
            Values(
                "goals",
                "Against the goals:",
                (
                    *_SPEC_RATIOS,
                    Col(
                        "identical answers",
                        "identical_outputs/share",
                        "pct",
                        goal="identical_outputs_share_min",
                    ),
                ),
            ),
            Rows(
                "pricing",
                "Steps with draft tokens, timed, against the step-time model fitted on plain decodes "
                "(context 512):",
                "verification_pricing",
                (),
                (
                    Col("decodes", "decodes", "int"),
                    Col("drafts each", "drafts", "int"),
                    Col("measured", "measured_s", "ms"),
                    Col("predicted", "predicted_s", "ms"),
                    Col("measured / predicted", "measured_vs_predicted", "x"),
                ),
            ),
        ),
    ),
    "cpu_moe": BenchSpec(
        "benchmarks/moe_cpu.md",
        "A mixture of experts' decode steps on this CPU against the floor of the experts they touch",
        (
            Values(
                "floors",
                "Floors measured in the same run (the best of several methods):",
                (
                    Col("read bandwidth (GB/s)", "floors/read_gb_per_s"),
                    Col("bf16 matmul GFLOP/s", "floors/matmul_bfloat16_gflop_per_s"),
                    Col("quantized matmul GOP/s", "floors/matmul_quantized_gop_per_s"),
                ),
            ),
            Rows(
                "steps",
                "Decode steps of `dummy:small-moe`, ~260 tokens of context each (experts read: the "
                "distinct experts the step's tokens picked, summed over the 12 layers, of all held):",
                "steps",
                (),
                (
                    Col("weights", "variant", "str"),
                    Col("decodes", "batch", "int"),
                    Col("step", "step_ms", "ms_value"),
                    Col("in the experts", "experts_ms", "ms_value"),
                    Col("experts' share", "experts_share", "pct"),
                    Col("experts read", ("experts_read", "experts_held"), ("int", "int")),
                    Col("touched-expert floor", "floor_ms", "ms_value"),
                    Col("all-expert floor", "all_experts_floor_ms", "ms_value"),
                    Col("step / floor", "ratio", "x"),
                    Col("goal", "goal_met", "met"),
                ),
            ),
        ),
    ),
    "token_budget_threads": BenchSpec(
        "benchmarks/token_budget_threads.md",
        "One TBT target on a 1-thread and a 2-thread replica: adaptive against fixed budget",
        (
            Values(
                "target",
                "The target and the budgets:",
                (
                    Col("TBT target", "target_s", "ms"),
                    Col("how it was set", "target_rule", "str"),
                    Col("fixed budget (tokens)", "fixed_budget", "int"),
                    Col("adaptive budget's cap (tokens)", "adaptive_cap", "int"),
                ),
            ),
            Rows(
                "chunk_steps",
                "Steps that carried a prompt chunk beside the decodes, per budget and thread count:",
                "chunk_steps",
                ("budget, threads",),
                (
                    Col("chunk steps", "num_chunk_steps", "int"),
                    Col("step p50", "step_p50_s", "ms"),
                    Col("step p90", "step_p90_s", "ms"),
                    Col("step max", "step_max_s", "ms"),
                    Col("within the target", "within_target", "pct"),
                    Col("chunk tokens p50", "chunk_tokens_p50", "int"),
                    Col("engine start", "startup_s", "s"),
                ),
            ),
        ),
    ),
}
