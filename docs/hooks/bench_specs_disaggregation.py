"""Which figures of the prefill/decode disaggregation result files the docs show: the real
transfers and their link model, the added TTFT on a 2-node cluster."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows, Values

PAGE = "benchmarks/disaggregation.md"

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
        ),
    ),
}
