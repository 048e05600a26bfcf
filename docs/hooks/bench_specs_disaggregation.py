"""Which figures of the prefill/decode disaggregation result files the docs show: the real
transfers and their link model, the simulator's map, the added TTFT on a 2-node cluster."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values

PAGE = "benchmarks/disaggregation.md"
MAP_LINK = "infiniband"
BASE = f"colocated@{MAP_LINK}/goodput"


def _over_colocated(design: str, header: str) -> Col:
    """The design's goodput over the colocated fleet's on the same arrivals, seed by seed."""
    return Col(header, (f"{design}/goodput", BASE), "x", agg="spread", ratio=True)


DISAGGREGATION_SPECS: dict[str, BenchSpec] = {
    "kv_transfer": BenchSpec(
        PAGE,
        "KV transfers through each connector by size, and the link model fitted to them",
        (
            Rows(
                "fit",
                "The link model fitted from 1 MiB up (latency + bytes / rate):",
                "connectors",
                ("connector",),
                (Col("latency", "fit/latency_s", "ms"), Col("rate (GB/s)", "fit/gb_per_s")),
            ),
            Rows(
                "sizes",
                "Per size, the median of the rounds, and the model's time:",
                "connectors/*/sizes/*",
                ("connector", "size"),
                (
                    Col("transfer", "median_s", "ms"),
                    Col("GB/s", "gb_per_s"),
                    Col("model", "model_s", "ms"),
                    Col("model off by", "model_error", "pct"),
                ),
            ),
        ),
    ),
    "disaggregation_map": BenchSpec(
        PAGE,
        "The simulator's map: P/D against stall-free colocation, 4 H100s, four workloads",
        (
            Rows(
                "capacity",
                "The colocated fleet's 90%-attainment rate per workload, the loads' 1x:",
                "colocated_capacity_rps",
                ("workload",),
                (Col("requests/s", ""),),
            ),
            Rows(
                "map",
                "Goodput over the colocated fleet's (stall-free, its TBT target), paired seed by seed, "
                "median [range]; above 1, the split wins:",
                "results/*/*",
                ("workload", "load"),
                (
                    _over_colocated(f"pd_1_3@{MAP_LINK}", "P:D 1:3"),
                    _over_colocated(f"pd_2_2@{MAP_LINK}", "P:D 2:2"),
                    _over_colocated(f"pd_3_1@{MAP_LINK}", "P:D 3:1"),
                    _over_colocated(f"colocated_8192@{MAP_LINK}", "colocated, 8,192 budget"),
                ),
            ),
            Rows(
                "latency",
                "What each fleet gave, median over seeds: SLO attainment, TTFT p90 and TBT p99:",
                "results/*/*",
                ("workload", "load"),
                tuple(
                    Col(
                        label,
                        (
                            f"{design}@{MAP_LINK}/attainment",
                            f"{design}@{MAP_LINK}/ttft_p90_s",
                            f"{design}@{MAP_LINK}/tbt_p99_s",
                        ),
                        ("pct", "s", "ms"),
                        agg="median",
                    )
                    for design, label in (
                        ("colocated", "colocated"),
                        ("pd_1_3", "P:D 1:3"),
                        ("pd_2_2", "P:D 2:2"),
                        ("pd_3_1", "P:D 3:1"),
                    )
                ),
            ),
            Rows(
                "links",
                "The 2:2 split at 0.9x over each link: goodput over colocated's, and a transfer's "
                "median time (its bytes, the link's queue, the hop):",
                "results/*/0.9x",
                ("workload",),
                tuple(
                    col
                    for link in ("nvlink", "infiniband", "tcp")
                    for col in (
                        _over_colocated(f"pd_2_2@{link}", link),
                        Col(f"transfer, {link}", f"pd_2_2@{link}/transfer_p50_s", "ms", agg="median"),
                    )
                ),
            ),
        ),
    ),
    "disaggregation_ttft": BenchSpec(
        PAGE,
        "Prefill/decode disaggregation's added TTFT on a 2-node CPU cluster, against its transfer",
        (
            Values(
                "link",
                "Measured in the same run:",
                (
                    Col("the link's latency", "link/latency_s", "ms"),
                    Col("the link's rate (bytes/s)", "link/bytes_per_s"),
                    Col("one hop (a Serve call's round trip)", "hop_s", "ms"),
                ),
            ),
            Rows(
                "ttft",
                "Median over the rounds:",
                "results",
                ("prompt tokens",),
                (
                    Col("TTFT, P/D", "ttft_pd_s", "ms"),
                    Col("TTFT, colocated", "ttft_colocated_s", "ms"),
                    Col("added", "added_s", "ms"),
                    Col("adopted tokens", "adopted_tokens", "int"),
                    Col("transfer + hop", "expected_s", "ms"),
                    Col("added / (transfer + hop)", "added_vs_expected", "x"),
                ),
            ),
            Rows(
                "stages",
                "Where the added time goes: each stage timed alone in one process (median over the "
                "rounds), their sum with the hop, and the added TTFT measured on the cluster:",
                "stages_s",
                ("prompt tokens",),
                (
                    Col("read out of the pool", "read_s", "ms"),
                    Col("publish", "publish_s", "ms"),
                    Col("fetch (TCP)", "fetch_s", "ms"),
                    Col("adopt", "adopt_s", "ms"),
                    Col("tail step", "tail_step_s", "ms"),
                    Col("sum + hop", "sum_with_hop_s", "ms"),
                    Col("added on the cluster", "added_on_cluster_s", "ms"),
                ),
            ),
        ),
    ),
}
