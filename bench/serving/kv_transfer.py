"""`python -m bench kv_transfer`: real KV transfers by size through each connector on this host,
and the simulator's link model (fleet_sim/disaggregated.py's KvLink: a fixed latency + bytes over
a rate) fitted to them.

Each transfer is what a prefill and a decode replica do: publish (the bytes written to a file in
/dev/shm; `object_store`: `ray.put`) then fetch (mapped by a reader on the node; `tcp`: read over
a TCP connection from the publisher's server thread, here on the loopback, as between two nodes
of a test cluster on one machine; `object_store`: `ray.get` in another process of a local Ray
node). Sizes 64 KiB to 256 MiB (SmolLM2 fp32 holds 46 KiB a token: 256 MiB is a 5,700-token
prompt; Llama-3-8B bf16, 128 KiB), the median of 9 rounds interleaving the connectors.
A floor beside them: one memcpy of the same bytes (numpy). Goal: the fitted model within 25% of
the measured time at every size from 1 MiB (below it, a millisecond's noise is the whole
transfer). Writes bench/results/kv_transfer.json."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from bench.driver import BenchmarkRun, print_verdicts
from common.kv_transfer import KvBlocks, KvLayout
from deployments.kv_connectors import KvConnector, make_connector

SIZES = tuple(64 * 1024 * 4**i for i in range(7))  # 64 KiB .. 256 MiB
LAYOUT = KvLayout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1024, dtype="uint8", dtype_bytes=1)
CONNECTORS = ("shared_memory", "tcp", "object_store")
ROUNDS = 9
FIT_FROM_BYTES = 1 << 20
GOALS = {"model_error_from_1_mib_max": 0.25}


def blocks(num_bytes: int) -> KvBlocks:
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8)
    return KvBlocks(LAYOUT, num_bytes // LAYOUT.block_bytes, b"x" * 32, data)


def transfer_s(sender: KvConnector, receiver: KvConnector, payload: KvBlocks) -> float:
    """Publish, fetch, and touch every byte fetched (as the pool's copy does): its seconds."""
    started = time.perf_counter()
    fetched = receiver.fetch(sender.publish(payload), 60)
    np.asarray(fetched.data).sum(dtype=np.uint64)
    return time.perf_counter() - started


def fetch_in_actor():
    """A Ray actor that fetches (the decode replica's side, another process of the node)."""
    import ray

    @ray.remote(num_cpus=0)
    class Reader:
        def __init__(self) -> None:
            self.connector = make_connector("object_store", "node", "127.0.0.1")

        def fetch(self, handle) -> None:
            fetched = self.connector.fetch(handle, 60)
            np.asarray(fetched.data).sum(dtype=np.uint64)  # touch every byte, as the pool's copy does

    return Reader.remote()


def measure(connectors: tuple[str, ...]) -> dict[str, dict[int, list[float]]]:
    """connector -> size -> seconds per transfer (publish + fetch), rounds interleaved."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        reader = fetch_in_actor()
        made = {
            name: tuple(make_connector(name, "node-a", "127.0.0.1") for _ in range(2))
            for name in connectors
            if name != "object_store"
        }
        publisher = make_connector("object_store", "node-a", "127.0.0.1")
        times: dict[str, dict[int, list[float]]] = {name: {} for name in (*connectors, "memcpy")}
        for _ in range(ROUNDS):
            for size in SIZES:
                payload = blocks(size)
                target = np.empty_like(payload.data)
                started = time.perf_counter()
                np.copyto(target, payload.data)
                times["memcpy"].setdefault(size, []).append(time.perf_counter() - started)
                for name in connectors:
                    if name == "object_store":
                        started = time.perf_counter()
                        ray.get(reader.fetch.remote(publisher.publish(payload)))
                        seconds = time.perf_counter() - started
                    else:
                        seconds = transfer_s(*made[name], payload)
                    times[name].setdefault(size, []).append(seconds)
        for sender, receiver in made.values():
            sender.close()
            receiver.close()
        return times
    finally:
        ray.shutdown()


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of seconds = latency + bytes / rate over the points, each weighed by 1 /
    its time (the relative error is what counts, at 1 MiB as at 256): (latency_s, bytes_per_s)."""
    sizes = np.array([size for size, _ in points], dtype=float)
    seconds = np.array([s for _, s in points])
    slope, intercept = np.polyfit(sizes, seconds, 1, w=1 / seconds)
    return max(0.0, float(intercept)), float(1 / slope)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/kv_transfer.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("kv_transfer", args.output, GOALS)
    times = measure(CONNECTORS)
    results, goals_met = {}, {}
    for name, by_size in times.items():
        medians = {size: statistics.median(values) for size, values in by_size.items()}
        latency_s, rate = fit([(size, s) for size, s in medians.items() if size >= FIT_FROM_BYTES])
        rows = {}
        for size, seconds in medians.items():
            predicted = latency_s + size / rate
            error = abs(predicted - seconds) / seconds
            spread = [min(by_size[size]), max(by_size[size])]
            rows[f"{size / 2**20:g} MiB"] = {
                "bytes": size,
                "median_s": seconds,
                "gb_per_s": size / seconds / 1e9,
                "model_s": predicted,
                "model_error": error,
                "spread_s": spread,
            }
            verdict = (
                "" if size < FIT_FROM_BYTES or error <= GOALS["model_error_from_1_mib_max"] else "  MISS"
            )
            rate_gb = size / seconds / 1e9
            print(f"{name:14} {size / 2**20:8.2f} MiB  {seconds * 1e3:8.2f} ms  {rate_gb:6.2f} GB/s"
                  f"  model {predicted * 1e3:8.2f} ms ({error:.0%}){verdict}")  # fmt: skip
        results[name] = {"fit": {"latency_s": latency_s, "gb_per_s": rate / 1e9}, "sizes": rows}
        print(f"{name}: KvLink(latency {latency_s * 1e3:.3f} ms, {rate / 1e9:.2f} GB/s)")
        if name != "memcpy":
            worst = max(row["model_error"] for row in rows.values() if row["bytes"] >= FIT_FROM_BYTES)
            goals_met[f"{name}: model within 25% from 1 MiB (worst {worst:.0%})"] = (
                worst <= GOALS["model_error_from_1_mib_max"]
            )
    print_verdicts(goals_met)
    run.write({"settings": {"rounds": ROUNDS, "sizes": SIZES}, "connectors": results}, goals_met)


if __name__ == "__main__":
    main()
