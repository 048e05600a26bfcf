"""Which figures of the prefill/decode disaggregation result files the docs show: the real
transfers and their link model."""

from __future__ import annotations

from docs.hooks.bench_tables import BenchSpec, Col, Rows

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
}
