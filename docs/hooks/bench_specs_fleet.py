"""Which figures of the routing, fleet and soak result files the docs show: per file, its page
and tables. bench_tables.py renders them; every file's header and goals come too."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values

# kv_prefix and the baselines issue 42 judges it against
GOAL_ROUTERS = ("kv_prefix", "prefix_cache_affinity", "sglang_cache_aware", "llmd_precise_prefix")
ROUTERS = (*GOAL_ROUTERS, "power_of_two", "kv_pressure", "round_robin")


def _fleet_cell(router: str) -> Col:
    figures = (f"{router}/ttft_p90_s", f"{router}/hit_rate", f"{router}/output_tok_per_s")
    return Col(router, figures, ("s", "num", "int"), agg="median")


def _ratios(at: str, caption: str = "kv_prefix over the other routers, median over seeds [spread]:") -> Rows:
    return Rows("ratios", caption, at, ("ratio",), (Col("median [min–max]", "", "x"),))


def _routers(at: str, caption: str, extra: tuple[Col, ...] = ()) -> Rows:
    return Rows(
        "routers",
        caption,
        at,
        ("workload", "router"),
        (
            Col("TTFT p50", "ttft_p50_s", "s", agg="spread"),
            Col("TTFT p99", "ttft_p99_s", "s", agg="median"),
            Col("TBT p99", "tbt_p99_s", "ms", agg="median"),
            Col("hit rate", "hit_rate", "pct", agg="median"),
            Col("tok/s", "output_tok_per_s", agg="median"),
            Col("requests per replica, by seed", "requests_per_replica", "slash", agg="each"),
            *extra,
        ),
    )


def _fleet(at: str, keys: tuple[str, ...], routers: tuple[str, ...] = ROUTERS) -> Rows:
    caption = "Each router's TTFT p90 / prefix-cache hit rate / output tok/s, median of seeds:"
    return Rows("fleet", caption, at, keys, tuple(_fleet_cell(r) for r in routers))


def _workloads(only: tuple[str, ...]) -> Rows:
    return Rows(
        "workloads",
        "The workloads:",
        "settings/workloads",
        ("workload",),
        (
            Col("what", "description", "str"),
            Col("context tokens", "context_tokens", "int"),
            Col("working set / fleet KV", "working_set_of_fleet_kv"),
            Col("rate per replica (ramp)", "ramp_per_replica", "list"),
        ),
        only=only,
    )


def _soak(fault: tuple[Col, ...]) -> tuple[Rows | Values, ...]:
    return (
        Values(
            "load",
            "The load and what the clients saw:",
            (
                Col("requests sent", "requests_sent", "int"),
                Col("hang-ups planned", "disconnects_planned", "int"),
                Col("load wall time", "wall_s", "s"),
                Col("output tokens of completed requests", "output_tokens_completed", "int"),
                Col("TTFT p50", "ttft_p50_s", "s"),
                Col("TTFT p99", "ttft_p99_s", "s"),
                Col("TBT p99", "tbt_p99_s", "s"),
                *fault,
                Col("drain", "drain_s", "s"),
            ),
        ),
        Rows("outcomes", "Outcomes, by kind:", "outcomes", ("outcome",), (Col("requests", "", "int"),)),
        Rows(
            "engine",
            "The engines' own counters over the run:",
            "engine",
            ("counter",),
            (Col("count", "", "int"),),
        ),
        Rows(
            "held",
            "Each surviving replica after the drain:",
            "held_after_drain",
            ("replica",),
            (
                Col("running", "running", "int"),
                Col("waiting", "waiting", "int"),
                Col("KV blocks held", "kv_blocks_held", "int"),
            ),
        ),
    )


def _fleet_goal_routers(size: str, workloads: tuple[str, ...]) -> BenchSpec:
    """A run of the H100 profile with kv_prefix and the goals' three baselines only."""
    return BenchSpec(
        "benchmarks/fleet.md",
        f"The fleet simulator on the H100 profile {size}: kv_prefix and the goals' three baselines",
        (
            _fleet("results/*/*/*", ("profile", "workload", "replicas"), GOAL_ROUTERS),
            _ratios("ratios", "kv_prefix against the goals' baselines, per point, median of seeds [spread]:"),
            _workloads(workloads),
        ),
    )


FLEET_SPECS: dict[str, BenchSpec] = {
    "router_cpu": BenchSpec(
        "benchmarks/router_cpu.md",
        "Every router over 2 CPU replicas: multi-tenant chat, skewed and uniform loads",
        (
            _routers("results/*/*", "Per workload and router, median of seeds (TTFT p50: [spread]):"),
            _ratios("ratios"),
        ),
    ),
    "router_cpu_eviction": BenchSpec(
        "benchmarks/router_cpu.md",
        "Every router where the pools must evict, one replica killed mid-run",
        (
            _routers(
                "results/*/*",
                "Per router, median of seeds (TTFT p50: [spread]):",
                (Col("turns failed, by seed", "failed_turns", "int", agg="each"),),
            ),
            _ratios("ratios"),
        ),
    ),
    "router_cpu_quick": BenchSpec(
        "benchmarks/router_cpu.md",
        "The chat workload, one seed, with today's kv_prefix weights",
        (
            Rows(
                "routers",
                "One seed of the chat workload:",
                "results/chat",
                ("router",),
                (
                    Col("TTFT p50", "ttft_p50_s", "s", agg="median", best="min"),
                    Col("hit rate", "hit_rate", "pct", agg="median", best="max"),
                    Col("tok/s", "output_tok_per_s", agg="median", best="max"),
                    Col("requests per replica", "requests_per_replica", "slash", agg="each"),
                ),
            ),
        ),
    ),
    "fleet": BenchSpec(
        "benchmarks/fleet.md",
        "The fleet simulator: every router, CPU replicas",
        (
            _fleet("results/*/*/*", ("profile", "workload", "replicas")),
            _ratios("ratios", "kv_prefix against the goals' baselines, per point, median of seeds [spread]:"),
            Rows(
                "speed",
                "Simulated over real time with kv_prefix (median of seeds):",
                "results/*/*/*",
                ("profile", "workload", "replicas"),
                (
                    Col(
                        "x real time",
                        ("kv_prefix/wall_s", "kv_prefix/sim_wall_s"),
                        "num",
                        agg="median",
                        ratio=True,
                    ),
                ),
            ),
            _workloads(("a", "b", "c", "d", "e")),
        ),
    ),
    "fleet_h100": _fleet_goal_routers("at 4 replicas", ("a", "b", "c")),
    "fleet_h100_16": _fleet_goal_routers("at 16 replicas", ("a", "b", "c")),
    "fleet_autoscaling": BenchSpec(
        "benchmarks/fleet_autoscaling.md",
        "Simulated autoscaling on a 4x ramp: our policy against Serve's default",
        (
            Rows(
                "policies",
                "Per policy, median of seeds [spread]:",
                "results",
                ("policy",),
                (
                    Col("TTFT p90", "ttft_p90_s", "s", agg="spread"),
                    Col("TTFT p50", "ttft_p50_s", "s", agg="median"),
                    Col("replica-seconds", "replica_seconds", "int", agg="spread"),
                    Col("most replicas serving", "max_replicas_serving", "int", agg="median"),
                    Col("tok/s", "output_tok_per_s", agg="median"),
                ),
            ),
            Values(
                "ratio",
                "Ours over Serve's default:",
                (
                    Col(
                        "replica-seconds",
                        "replica_seconds_ratio",
                        "x",
                        goal="kv_pressure replica-seconds <= 0.8x Serve's default policy's",
                    ),
                ),
            ),
        ),
    ),
    "fleet_validation": BenchSpec(
        "benchmarks/fleet_validation.md",
        "The fleet simulator against the real engine, one replica",
        (
            Rows(
                "errors",
                "Absolute error of the simulator, by where its step time came from:",
                "errors",
                ("step time from",),
                (
                    Col("TTFT p50", "ttft_p50_s", "pct"),
                    Col("TTFT p90", "ttft_p90_s", "pct"),
                    Col("TBT p50", "tbt_p50_s", "pct"),
                    Col("TBT p99", "tbt_p99_s", "pct"),
                    Col("tok/s", "output_tok_per_s", "pct"),
                    Col("median", "median_over_figures", "pct"),
                ),
            ),
            Rows(
                "runs",
                "Real against simulated (startup profile / learned from the run), per point:",
                "real",
                ("point",),
                (
                    Col("TTFT p50 real", "ttft_p50_s", "s"),
                    Col(
                        "simulated",
                        (
                            "/simulated/startup_profile/{0}/ttft_p50_s",
                            "/simulated/learned_from_run/{0}/ttft_p50_s",
                        ),
                        "s",
                    ),
                    Col("TBT p99 real", "tbt_p99_s", "ms"),
                    Col(
                        "simulated",
                        (
                            "/simulated/startup_profile/{0}/tbt_p99_s",
                            "/simulated/learned_from_run/{0}/tbt_p99_s",
                        ),
                        "ms",
                    ),
                    Col("tok/s real", "output_tok_per_s"),
                    Col(
                        "simulated",
                        (
                            "/simulated/startup_profile/{0}/output_tok_per_s",
                            "/simulated/learned_from_run/{0}/output_tok_per_s",
                        ),
                        "num",
                    ),
                ),
            ),
        ),
    ),
    "fleet_routing_validation": BenchSpec(
        "benchmarks/fleet_validation.md",
        "The fleet simulator's routing against 2 real replicas behind each router",
        (
            Rows(
                "runs",
                "Per workload and router, real / simulated, median of seeds (TTFT p90: [spread]):",
                "real/*/*",
                ("workload", "router"),
                (
                    Col("TTFT p90 real", "ttft_p90_s", "s", agg="spread"),
                    Col("simulated", "/simulated/{0}/{1}/ttft_p90_s", "s", agg="spread"),
                    Col(
                        "TTFT p50 real / sim.",
                        ("ttft_p50_s", "/simulated/{0}/{1}/ttft_p50_s"),
                        "s",
                        agg="median",
                    ),
                    Col(
                        "hit rate real / sim.",
                        ("hit_rate", "/simulated/{0}/{1}/hit_rate"),
                        "pct",
                        agg="median",
                    ),
                    Col(
                        "tok/s real / sim.",
                        ("output_tok_per_s", "/simulated/{0}/{1}/output_tok_per_s"),
                        agg="median",
                    ),
                ),
            ),
            Rows(
                "ratios",
                "TTFT p90 of kv_prefix over the other router, paired by seed, median [spread]; the "
                "simulator's error on the median:",
                "ratios",
                ("ratio",),
                (Col("real", "real", "x"), Col("simulated", "simulated", "x"), Col("error", "error", "pct")),
            ),
        ),
    ),
    "soak_cpu": BenchSpec(
        "benchmarks/soak_cpu.md",
        "1,000 streams with hang-ups and a replica killed half-way",
        _soak(
            (
                Col("clients that hung", "hung", "int"),
                Col("replica killed at", "fault/at_s", "s"),
                Col("replacement serving after the kill", "fault/whole_after_s", "s"),
                Col("requests sent after that", "fault/sent_after_whole", "int"),
                Col("failed among them", "fault/failed_among_sent_after_whole", "int"),
            )
        ),
    ),
    "soak_cpu_multinode": BenchSpec(
        "benchmarks/soak_cpu_multinode.md",
        "The soak on a three-node cluster, a worker node lost half-way",
        _soak(
            (
                Col("clients that hung", "hung", "int"),
                Col("node lost at", "fault/at_s", "s"),
                Col("replacement serving after the loss", "fault/whole_after_s", "s"),
                Col("requests sent after that", "fault/sent_after_whole", "int"),
                Col("failed among them", "fault/failed_among_sent_after_whole", "int"),
            )
        ),
    ),
}
