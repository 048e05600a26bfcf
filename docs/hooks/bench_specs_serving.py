"""Which figures of the serving-throughput result files the docs show (CPU serving beside its
peers, structured outputs' cost and quality): per file, its page and tables. bench_tables.py
renders them."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values

_SERVERS = "server"
_SERVING = (
    Col("c=1 tok/s", "c1/output_tok_per_s", best="max"),
    Col(
        "c=1 TTFT p50",
        "c1/ttft_p50_s",
        "ms",
        best="min",
        goal="c=1 TTFT p50 <= 0.8x every peer's",
        goal_row="stallfree",
    ),
    Col(
        "c=1 TBT p50",
        "c1/tbt_p50_s",
        "ms",
        best="min",
        goal="c=1 TBT p50 <= 0.9x llama.cpp Q4_1's",
        goal_row="stallfree",
    ),
    Col(
        "c=16 tok/s",
        "c16/output_tok_per_s",
        best="max",
        goal="c=16 output tok/s >= 1.5x vLLM CPU's",
        goal_row="stallfree",
    ),
    Col(
        "c=16 TTFT p50",
        "c16/ttft_p50_s",
        "s",
        best="min",
        goal="c=16 TTFT p50 <= 0.8x every peer's",
        goal_row="stallfree",
    ),
    Col("c=16 TBT p50", "c16/tbt_p50_s", "ms", best="min"),
    Col(
        "c=16 TBT p99",
        "c16/tbt_p99_s",
        "ms",
        best="min",
        goal="c=16 TBT p99 <= 0.5x vLLM CPU's",
        goal_row="stallfree",
    ),
    Col("Poisson TTFT p50", "poisson/median/ttft_p50_s", "ms", best="min"),
    Col(
        "Poisson TBT p99",
        "poisson/spread/tbt_p99_s",
        "ms",
        best="min",
        goal="Poisson TBT p99 (median of seeds) <= 0.5x vLLM CPU's",
        goal_row="stallfree",
    ),
)
_HEADLINE = ("c=1 tok/s", "c=1 TBT p50", "c=16 tok/s", "c=16 TTFT p50", "c=16 TBT p99", "Poisson TBT p99")

# bench.serving.serve_options' tables, for a run of every option and for one of a single option
SERVE_OPTIONS_TABLES = (
    Values(
        "alone",
        "c=16 through the app as shipped, against the engine alone in process:",
        (
            Col("engine alone tok/s", "engine_alone_c16_output_tok_per_s", "num"),
            Col("shipped tok/s (median of its runs)", "shipped_c16_output_tok_per_s_median", "num"),
            Col("shipped / alone", "shipped_c16_over_engine_alone", "x"),
            Col("best option", "best_option", "str"),
            Col("best option / alone", "best_c16_over_engine_alone", "x"),
        ),
    ),
    Rows(
        "options",
        "Each option over the shipped app (median of the ratios taken within each round):",
        "option_over_shipped",
        ("option",),
        (
            Col("c=16 tok/s", "c16_tok_per_s_ratio_median", "x"),
            Col("c=1 TBT p50", "c1_tbt_p50_ratio_median", "x"),
            Col("c=16 TTFT p50", "c16_ttft_p50_ratio_median", "x"),
            Col("c=16 TBT p99", "c16_tbt_p99_ratio_median", "x"),
            Col("earns the default", "adopt", "yes"),
        ),
    ),
)

SERVING_SPECS: dict[str, BenchSpec] = {
    "cpu_serving": BenchSpec(
        "benchmarks/cpu_serving.md",
        "Serving over HTTP on this CPU, beside llama.cpp, vLLM's CPU backend and Ray Serve LLM",
        (
            Rows(
                "servers",
                "Each server alone on the machine, in turn, in interleaved rounds: the median of the"
                " rounds (Poisson: of the rounds' seeds [spread]):",
                "results",
                (_SERVERS,),
                (Col("source", "source", "str"), *_SERVING),
            ),
            Rows(
                "headline",
                "",
                "results",
                (_SERVERS,),
                tuple(c for c in _SERVING if c.header in _HEADLINE),
                measured_only=True,
            ),
            Rows(
                "ratios",
                "Ours over each other server: the ratio taken within each round, then its median:",
                "ratios_ours_over_peer",
                ("peer",),
                (
                    Col("c=1 tok/s", "c1_output_tok_per_s", "x"),
                    Col("c=1 TTFT p50", "c1_ttft_p50_s", "x"),
                    Col("c=1 TBT p50", "c1_tbt_p50_s", "x"),
                    Col("c=16 tok/s", "c16_output_tok_per_s", "x"),
                    Col("c=16 TTFT p50", "c16_ttft_p50_s", "x"),
                    Col("c=16 TBT p50", "c16_tbt_p50_s", "x"),
                    Col("c=16 TBT p99", "c16_tbt_p99_s", "x"),
                    Col("Poisson TBT p99", "poisson_tbt_p99_s", "x"),
                ),
            ),
            Rows(
                "rounds",
                "Ours over each other server, round by round (each round takes every server in turn):",
                "ratios_by_round",
                ("server",),
                (
                    Col("c=1 TBT p50", "c1_tbt_p50_s", "x", agg="each"),
                    Col("c=16 tok/s", "c16_output_tok_per_s", "x", agg="each"),
                    Col("c=16 TBT p99", "c16_tbt_p99_s", "x", agg="each"),
                    Col("Poisson TBT p99", "poisson_tbt_p99_s", "x", agg="each"),
                ),
            ),
            Rows(
                "disagree",
                "Figures that moved by more than 15% between rounds ((max - min) / median; a figure"
                " not listed agreed across the rounds):",
                "rounds_disagree/*/*",
                ("server", "figure"),
                (Col("moved", "", "pct"),),
            ),
            Rows(
                "cores",
                "Where the 2 cores went during each server's c=16 run (the last round's): CPU seconds per"
                " process (the largest six, then the rest), and their share of the run's core-seconds:",
                "c16_cpu/*/by_process/*",
                ("server", "process"),
                (Col("CPU s", "cpu_s"), Col("share of the cores", "share_of_cores", "pct")),
            ),
            Values(
                "engine_alone",
                "The engine alone at c=16 (the same requests straight into an in-process engine, its core"
                " on a thread):",
                (
                    Col("engine alone tok/s", "results/engine alone/c16/output_tok_per_s"),
                    Col("engine alone TBT p50", "results/engine alone/c16/tbt_p50_s", "ms"),
                    Col(
                        "served / engine alone",
                        "served_c16_over_engine_alone",
                        "x",
                        goal="served c=16 tok/s >= 0.9x the engine alone's",
                    ),
                ),
            ),
            Values(
                "overhead",
                "Serving overhead at c=1 (the same requests straight into an in-process engine):",
                (
                    Col("mean TBT, over HTTP", "serving_overhead/client_tbt_mean_s", "ms"),
                    Col("mean TBT, engine alone", "serving_overhead/engine_alone_tbt_mean_s", "ms"),
                    Col(
                        "per streamed token",
                        "serving_overhead/per_token_s",
                        "ms",
                        goal="serving overhead <= 1 ms per token",
                    ),
                    Col("mean TTFT, over HTTP", "serving_overhead/client_ttft_mean_s", "ms"),
                    Col("mean TTFT, engine alone", "serving_overhead/engine_alone_ttft_mean_s", "ms"),
                    Col(
                        "per request",
                        "serving_overhead/per_request_s",
                        "ms",
                        goal="serving overhead <= 20 ms per request",
                    ),
                    Col("tokens per message, replica to Ingress", "tokens_per_stream_message/stallfree"),
                ),
            ),
        ),
    ),
    "serve_options": BenchSpec(
        "benchmarks/serve_options.md",
        "Ray-side options against the shipped app, in paired rounds",
        SERVE_OPTIONS_TABLES,
    ),
    "serve_options_core_process": BenchSpec(
        "benchmarks/serve_options.md",
        "The engine core in its own process against the shipped app, alone, in three paired rounds",
        SERVE_OPTIONS_TABLES,
    ),
    "serve_options_spincount": BenchSpec(
        "benchmarks/serve_options.md",
        "A short OpenMP spin (GOMP_SPINCOUNT=10000) against the shipped app, in three paired rounds",
        SERVE_OPTIONS_TABLES,
    ),
    "spec_serving": BenchSpec(
        "benchmarks/spec.md",
        "Speculative decoding served over HTTP, beside vLLM CPU's prompt lookup",
        (
            Rows(
                "servers",
                "Editing at c=1, decode tok/s (median over rounds [spread]):",
                "tok_per_s",
                ("server",),
                (Col("decode tok/s", "", "num", best="max"),),
            ),
            Values(
                "ratios",
                "Against vLLM CPU's prompt lookup, round by round (median [spread]):",
                (
                    Col(
                        "stallfree prompt lookup",
                        "vs_vllm_ngram/stallfree ngram",
                        "x",
                        goal="ours_ngram_vs_vllm_ngram_c1_min",
                    ),
                    Col("stallfree suffix decoding", "vs_vllm_ngram/stallfree suffix", "x"),
                ),
            ),
        ),
    ),
    "idle_cluster": BenchSpec(
        "benchmarks/serve_options.md",
        "A served cluster at rest: Serve's default control loop against the shipped one",
        (
            Rows(
                "systems",
                "CPU milliseconds per second of the idle cluster's processes (median over rounds [spread]):",
                "systems",
                ("control loop",),
                (
                    Col("whole cluster", "total_ms_per_s", "num", best="min"),
                    Col("Serve's controller", "controller_ms_per_s", "num", best="min"),
                ),
            ),
            Values(
                "ratios",
                "Shipped over Serve's default, round by round (median [spread]):",
                (
                    Col(
                        "controller",
                        "shipped_vs_default/controller",
                        "x",
                        goal="controller_cpu_vs_serve_default_max",
                    ),
                    Col(
                        "whole cluster",
                        "shipped_vs_default/cluster",
                        "x",
                        goal="cluster_cpu_vs_serve_default_max",
                    ),
                ),
            ),
        ),
    ),
    "structured_quality": BenchSpec(
        "benchmarks/structured_quality.md",
        "Constrained outputs finished and parsed: stallfree (compact JSON, free whitespace) and vLLM CPU",
        (
            Rows(
                "servers",
                "Per server, the share of requests that finish with JSON, and that `parse()` accepts:",
                "servers",
                ("server",),
                (
                    Col("requests", "requests", "int"),
                    Col("finished", "finished_share", "pct", best="max"),
                    Col("parsed", "parse_share", "pct", best="max"),
                    Col(
                        "parsed, first set",
                        "sets/first set/parse_share",
                        "pct",
                        best="max",
                        goal="parse_share_vs_vllm_min (first set)",
                        goal_row="stallfree",
                    ),
                    Col(
                        "parsed, blind set",
                        "sets/blind set/parse_share",
                        "pct",
                        best="max",
                        goal="parse_share_vs_vllm_min (blind set)",
                        goal_row="stallfree",
                    ),
                    Col("output tokens", "completion_tokens", "int"),
                    Col("not parsed", "failed", "list"),
                ),
            ),
        ),
    ),
    "tool_calls": BenchSpec(
        "benchmarks/tool_calls.md",
        "Tool calls valid per tool_choice: stallfree and vLLM CPU",
        (
            Rows(
                "modes",
                "Per `tool_choice`, the share of answers that are valid (`finish_reason` `tool_calls`,"
                " `stop` for a named tool as OpenAI's API answers; every call a listed tool with arguments"
                " its model accepts; no tag text in `content`):",
                "by_mode",
                ("tool_choice",),
                (
                    Col("stallfree", "stallfree", "pct"),
                    Col("vLLM CPU", "vLLM CPU", "pct"),
                ),
            ),
            Rows(
                "servers",
                "Per server, over every request, and what it did with the nonsense schema"
                ' `{"type": "frobnicate"}` (under auto; under required):',
                "servers",
                ("server",),
                (
                    Col("requests", "requests", "int"),
                    Col(
                        "valid",
                        "valid_share",
                        "pct",
                        best="max",
                        goal="valid_share_vs_vllm_min",
                        goal_row="stallfree",
                    ),
                    Col(
                        "valid, required and named",
                        "required_and_named_share",
                        "pct",
                        best="max",
                        goal="required_and_named_valid_share_min",
                        goal_row="stallfree",
                    ),
                    Col("output tokens", "completion_tokens", "int"),
                    Col(
                        "nonsense schema",
                        ("nonsense_schema/auto", "nonsense_schema/required"),
                        ("str", "str"),
                        sep="; ",
                    ),
                ),
            ),
        ),
    ),
    "eval_scoring": BenchSpec(
        "benchmarks/eval_scoring.md",
        "Multiple-choice scoring as lm-eval sends it, beside vLLM CPU",
        (
            Rows(
                "servers",
                "Requests per second (median of the rounds), by requests in flight (lm-eval's"
                " `num_concurrent`):",
                "servers",
                ("server",),
                (Col("c=1", "c=1", best="max"), Col("c=8", "c=8", best="max")),
            ),
            Rows(
                "ratios",
                "stallfree's requests per second over the others' (the median of the rounds' ratios,"
                " and each round's), and whether sharing the prefix cache changed an answer (every"
                " question's likeliest choice, shared against nothing shared; the largest difference"
                " in a choice's logprob):",
                "comparisons",
                ("requests in flight",),
                (
                    Col("over nothing shared", "vs_unshared", "x", goal="requests_per_s_vs_unshared_min"),
                    Col("each round", "vs_unshared_rounds", "x", agg="each"),
                    Col("over vLLM CPU", "vs_vllm", "x", goal="requests_per_s_vs_vllm_min"),
                    Col("each round", "vs_vllm_rounds", "x", agg="each"),
                    Col("same choices", "same_choices", "yes", goal="same_choices_with_and_without_sharing"),
                    Col("largest logprob difference", "max_logprob_difference", "num"),
                ),
            ),
        ),
    ),
    "lora": BenchSpec(
        "benchmarks/lora.md",
        "Four LoRA adapters beside the base model on one replica, against the base model alone",
        (
            Rows(
                "runs",
                "c=16, per run (median over seeds [spread]):",
                "runs",
                ("requests to",),
                (
                    Col("tok/s", "output_tok_per_s", agg="spread", best="max"),
                    Col("TBT p99", "tbt_p99_s", "ms", agg="spread", best="min"),
                    Col("TTFT p50", "ttft_p50_s", "s", agg="spread"),
                ),
                labels=(("base", "the base model only"), ("mixed", "base + 4 adapters, round-robin")),
            ),
            Values(
                "ratios",
                "Mixed over base only, run by run (median [spread]):",
                (
                    Col(
                        "tok/s",
                        "mixed_vs_base/output_tok_per_s",
                        "x",
                        agg="spread",
                        goal="mixed_vs_base_tok_per_s_min",
                    ),
                    Col(
                        "TBT p99",
                        "mixed_vs_base/tbt_p99_s",
                        "x",
                        agg="spread",
                        goal="mixed_vs_base_tbt_p99_max",
                    ),
                ),
            ),
            Rows(
                "loads",
                "On-demand load of each adapter from disk (read, checked, in host memory), engine-timed:",
                "adapter_load_s",
                ("adapter",),
                (Col("seconds", "", "s"),),
            ),
        ),
    ),
    "structured": BenchSpec(
        "benchmarks/structured.md",
        "What structured outputs cost: constrained shares against unconstrained and the code before",
        (
            Rows(
                "runs",
                "Each system, median of rounds [spread]:",
                "runs",
                ("system",),
                (
                    Col("tok/s", "output_tok_per_s", agg="spread"),
                    Col("TTFT p50", "ttft_p50_s", "s", agg="median"),
                    Col("TBT p99", "tbt_p99_s", "ms", agg="spread"),
                ),
            ),
            Rows(
                "vs_before",
                "0% constrained over the code before (ratios within a round):",
                "unconstrained_vs_today",
                ("figure",),
                (Col("median [min–max]", "", "x"),),
            ),
            Rows(
                "constrained",
                "Constrained share: tok/s over the unconstrained run:",
                "constrained_vs_unconstrained_tok_per_s",
                ("constrained",),
                (Col("median [min–max]", "", "x"),),
            ),
            Values(
                "compile",
                "Grammar compile time per schema (xgrammar, one thread):",
                (
                    Col("distinct schemas", "compile/schemas", "int"),
                    Col("cold, median", "compile/cold_ms/median", "ms_value"),
                    Col("cold, max", "compile/cold_ms/max", "ms_value"),
                    Col("cached, median", "compile/cached_ms/median", "ms_value"),
                ),
            ),
        ),
    ),
}
