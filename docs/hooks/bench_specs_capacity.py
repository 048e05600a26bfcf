"""Which figures of the scheduler's capacity result files the docs show (Sarathi-Serve's
definition: a TBT SLO and a scheduling-delay bound): per file, its page and tables."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values


def _slos(caption: str, extra: Col) -> Values:
    return Values(
        "slos",
        caption,
        (
            Col("decode step at batch 8", "decode_step_batch8_s", "ms"),
            Col("strict P99 TBT SLO", "slos_s/strict", "ms"),
            Col("relaxed P99 TBT SLO", "slos_s/relaxed", "ms"),
            Col("median scheduling delay bound", "scheduling_delay_bound_s", "s"),
            extra,
        ),
    )


CAPACITY_SPECS: dict[str, BenchSpec] = {
    "capacity_cpu": BenchSpec(
        "benchmarks/capacity_cpu.md",
        "The scheduler's capacity under a TBT SLO (Sarathi-Serve's definition), fixed and adaptive budgets",
        (
            _slos(
                "SLOs, from the decode step measured at start:",
                Col("arrival window per point", "arrival_window_s", "s"),
            ),
            Rows(
                "capacity",
                "Capacity in requests/s, median of 3 seeds [spread]:",
                "capacity_median_req_per_s",
                ("system",),
                (
                    Col(
                        "strict",
                        ("strict", "/capacity_spread_req_per_s/{0}/strict"),
                        ("num", "range"),
                        sep=" ",
                        best="max",
                    ),
                    Col(
                        "relaxed",
                        ("relaxed", "/capacity_spread_req_per_s/{0}/relaxed"),
                        ("num", "range"),
                        sep=" ",
                        best="max",
                    ),
                    Col("strict / best fixed", "/summary_median/ratio_to_best_fixed/{0}/strict", "x"),
                    Col("relaxed / best fixed", "/summary_median/ratio_to_best_fixed/{0}/relaxed", "x"),
                    Col("worse of the two", "/summary_median/worse_ratio/{0}", "x", best="max"),
                ),
            ),
            Rows(
                "adaptive_points",
                "Seed 0, the adaptive budget at the strict target, every rate tried:",
                "points/adaptive (strict)",
                (),
                (
                    Col("rate (req/s)", "rate"),
                    Col("P99 TBT", "tbt_p99_s", "ms"),
                    Col("scheduling delay p50", "scheduling_delay_p50_s", "s"),
                    Col("token budget p50", "token_budget_p50", "int"),
                    Col("tok/s", "output_tok_per_s"),
                ),
            ),
            Rows(
                "threads",
                "Same target, 1 and 2 torch threads (seed 0, one rate):",
                "threads/points",
                ("run",),
                (
                    Col("P99 TBT", "tbt_p99_s", "ms"),
                    Col("TBT p50", "tbt_p50_s", "ms"),
                    Col("scheduling delay p50", "scheduling_delay_p50_s", "ms"),
                    Col("token budget p50", "token_budget_p50", "int"),
                    Col("tok/s", "output_tok_per_s"),
                ),
            ),
            Values(
                "threads_target",
                "Where the thread comparison ran:",
                (
                    Col("rate (req/s)", "threads/rate"),
                    Col("TBT target", "threads/target_s", "ms"),
                    Col("fixed budget compared", "threads/fixed", "str"),
                ),
            ),
        ),
    ),
    "parallel_cpu": BenchSpec(
        "benchmarks/parallel_cpu.md",
        "Pipeline parallelism: Sarathi-Serve's bubble claim, stall_free against prefill_first",
        (
            _slos(
                "SLOs, from the one-process decode step measured at start, and where bubbles are judged:",
                Col("rate where bubbles are judged (req/s)", "bubble_rate_req_per_s"),
            ),
            Rows(
                "summary",
                "Median of 3 seeds [spread]; bubble fraction, tok/s and TBT at the judging rate:",
                "summary",
                ("system",),
                (
                    Col(
                        "bubble fraction",
                        "bubble_fraction",
                        "pct",
                        best="min",
                        goal="stall_free_bubble_0.5x_prefill_first",
                        goal_row="PP=2 stall_free",
                    ),
                    Col("output tok/s", "output_tok_per_s", best="max"),
                    Col("P99 TBT", "tbt_p99_s", "s"),
                    Col("capacity, strict (req/s)", "capacity_strict_req_per_s"),
                    Col("capacity, relaxed (req/s)", "capacity_relaxed_req_per_s", best="max"),
                ),
            ),
            Values(
                "ratio",
                "The claim:",
                (
                    Col(
                        "stall_free's bubble fraction / prefill_first's (goal <= 0.5)",
                        "bubble_ratio_stall_free_to_prefill_first",
                        "x",
                        goal="stall_free_bubble_0.5x_prefill_first",
                    ),
                    Col("Sarathi-Serve's figure", "sarathi_figure", "str"),
                ),
            ),
        ),
    ),
}
