"""`python -m bench gpu`: the GPU path in one command, for the first session lent a device (issue 37).

(a) Exactness (bench/gpu/gpu_checks.py): our engine against transformers, greedy, float32 and bfloat16,
    with the Triton attention; the Triton kernel against the torch reference on mixed batches.
(b) Steps (bench/gpu/gpu_steps.py) of a Llama-3-8B-shaped `dummy:` model, weights generated on the
    device: decode at batch 1-256 against the HBM floor, mixed steps at budgets 256-2048 against
    the FLOP floor.
(c) Offline throughput on a ShareGPT-like workload (the anchor, vLLM's PR #18566: 6,582.87 output
    tok/s on an H100 for Llama-3-8B): 1000 requests whose prompt and output lengths are drawn
    log-normally to ShareGPT's means as vLLM's benchmark samples it (prompts ~230 tokens, outputs
    ~200, each capped at 1024). The ShareGPT file itself cannot be fetched here: same shape of
    load, not the same texts (dummy weights have no tokenizer; prompts are token ids).
(d) Served (bench/gpu/gpu_served.py): the same requests through Ray Serve (serve_config.gpu.yaml, one
    replica, so the API and the engine in one replica: `ingress: auto`; the same model) and
    through the engine alone, in turn: c=1, c=64 and Poisson arrivals
    at three rates (3 seeds): TTFT and TBT p50/p99, tok/s, failures, and served over alone.
(e) Served options: the closed loops served with other app args (the engine core in its own
    process; an Ingress in front of an EngineReplica, `ingress: separate`), against the engine
    alone's closed loops in the same part.
(f) A mixture of experts (bench/gpu/gpu_moe.py, issue 61): a Qwen3-30B-A3B-shaped model's decode
    steps against the HBM floor of the experts they touch, and its offline throughput on (c)'s
    workload beside the dense model's.
(g) Kernels (bench/gpu/gpu_kernels.py): the steps' model's matmuls alone at decode batches'
    rows against the measured copy bandwidth, and profiles of decode steps (eager and graphs):
    each kernel's device time, by what it does.
Writes bench/results/gpu_<device>.json with goals and goals_met and prints a table. `--parts`
runs some parts and keeps the file's others, each part stamped with when it was measured (a
device call is at most 10 minutes: the parts go in several calls, bench/gpu/gpu_machine.sh).

`--dry-run` runs the same code on this CPU: Triton in its interpreter, a tiny dummy model, a few
steps and requests (part of make test, so the command cannot rot); its figures mean nothing and
its file says so. `--rehearse` runs the offline and served parts on this CPU at the GPU plan's
size with the tiny dummy model (bench/results/gpu_rehearsal.json): its short steps stand in for a
GPU's, so the host's side of each step, and the serving path's host cost against the engine
alone's, show; its overlap part runs the GPU plan's offline workload on a stand-in device (a
thread sleeping an H100 roofline's step times: bench/gpu/gpu_overlap.py), so that how much of a
device's time the engine loop leaves idle shows; the served part in three interleaved rounds
(this host drifts within minutes), judged on their median; only the served goals are judged
(the offline figures are the host's).
Goals (on an H100): decode steps at batch >= 32 <= 1.5x the HBM floor (the
mixture's: <= 2x its touched-expert floor); offline
>= 6,600 output tok/s, the device idle (waiting on the host: wall time less the model's) <= 10% of
the wall time; every exactness check passes;
greedy tokens with async scheduling those of synchronous steps; served as bench/gpu/gpu_served.py says."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.driver import Arrival, BenchmarkRun, print_verdicts
from bench.gpu import (
    gpu_checks,
    gpu_kernels,
    gpu_moe,
    gpu_offline,
    gpu_overlap,
    gpu_report,
    gpu_served,
    gpu_steps,
)
from bench.gpu.gpu_plans import DRY_RUN, FULL, REHEARSAL, Plan
from harness import serve_cluster

EXACTNESS_KINDS = ("against_transformers", "async_against_sync", "triton_attention")
GOALS = {
    "decode_b32_plus_vs_hbm_floor_max": gpu_steps.GOAL_RATIO,
    "offline_output_tok_per_s_min": 6600,
    "offline_device_idle_share_max": 0.10,
    "moe_decode_b32_plus_vs_touched_expert_floor_max": gpu_moe.GOAL_RATIO,
    **gpu_served.GOALS,
}
PARTS = ("exactness", "steps", "kernels", "offline", "served", "served_options", "moe")


REHEARSED_PARTS = ("offline", "overlap", "served", "served_options")


def _served_setup(plan: Plan) -> tuple[dict, list[Arrival]] | None:
    """The served app's args and the requests; None where Ray is not installed (the lent machine
    has none until bench/gpu/gpu_machine.sh installs it)."""
    if importlib.util.find_spec("ray") is None:
        return None
    num_gpus = 1 if plan.device == "cuda" else 0
    args = {"model": plan.model, "num_replicas": 1, "num_gpus": num_gpus, "engine": {"dtype": "bfloat16"}}
    args = serve_cluster.with_app_args(args, plan.served_app_args)
    count = max(plan.served.poisson_requests, *(n for _, n in plan.served.closed))
    return args, gpu_offline.sharegpt_like(count, plan.max_len, gpu_offline.vocab_size(plan.model), seed=1)


def served(plan: Plan, work_dir: Path) -> dict:
    """Through the engine alone and through Ray Serve, in turn, in the plan's interleaved rounds:
    the last round's runs, and the served figures over the alone ones (their median over the
    rounds, and each round's where there are several)."""
    if (setup := _served_setup(plan)) is None:
        return {"skipped": "ray is not installed here"}
    args, arrivals = setup
    rounds = []
    for _ in range(plan.served.rounds):
        alone = gpu_served.engine_alone(args, plan.served_base, arrivals, plan.served)
        gpu_steps.free_device_memory()  # the served replica sizes its pool from what is free
        through_serve = gpu_served.through_serve(args, plan.served_base, work_dir, arrivals, plan.served)
        rounds.append(gpu_served.comparison(alone, through_serve, plan.served))
    result = {
        "engine_alone": alone,
        "served": through_serve,
        "served_vs_alone": gpu_served.median_comparison(rounds),
    }
    return result | ({"rounds_vs_alone": rounds} if len(rounds) > 1 else {})


def served_options(plan: Plan, work_dir: Path) -> dict:
    """The served part's closed loops with each of the plan's served options (app args changed),
    against the engine alone's closed loops in the same part (a device call of its own)."""
    if not plan.served.options:
        return {"skipped": "no served options in this plan"}
    if (setup := _served_setup(plan)) is None:
        return {"skipped": "ray is not installed here"}
    args, arrivals = setup
    closed_only = replace(plan.served, poisson_rates=())
    alone = gpu_served.engine_alone(args, plan.served_base, arrivals, closed_only)
    gpu_steps.free_device_memory()
    result: dict = {"engine_alone": alone}
    for name, changed in plan.served.options:
        option_args = serve_cluster.with_app_args(args, changed)
        runs = gpu_served.through_serve(option_args, plan.served_base, work_dir, arrivals, closed_only)
        versus = gpu_served.comparison(alone, runs, closed_only)
        result[name] = {"app_args": changed, "runs": runs, "vs_alone": versus}
    return result


def exactness(plan: Plan, work_dir: Path) -> dict:
    what, checkpoint = gpu_checks.oracle_checkpoint(work_dir, plan.oracle_stand_in)
    args = (plan.device, plan.exactness_lengths, plan.exactness_tokens)
    return {
        "checkpoint": what,
        "against_transformers": [
            gpu_checks.check_against_transformers(checkpoint, dtype, *args, graphs)
            for dtype, graphs in (("float32", False), ("bfloat16", False), ("bfloat16", True))
        ],
        "async_against_sync": [
            gpu_checks.check_async_against_sync(checkpoint, dtype, *args, graphs)
            for dtype, graphs in (("float32", False), ("bfloat16", True))
        ],
        "triton_attention": [
            gpu_checks.check_attention(plan.device, dtype, plan.attention_heads)
            for dtype in ("float32", "bfloat16")
        ],
    }


def steps(plan: Plan, dry_run: bool) -> dict:
    rates = gpu_steps.device_rates(torch.device(plan.device), dry_run)
    return gpu_steps.summary(rates, gpu_steps.measure(plan.steps, plan.device, rates))


def kernels(plan: Plan, dry_run: bool) -> dict:
    rates = gpu_steps.device_rates(torch.device(plan.device), dry_run)
    return gpu_kernels.measure(plan.kernels, plan.steps, plan.device, rates)


def moe(plan: Plan, dry_run: bool) -> dict:
    rates = gpu_steps.device_rates(torch.device(plan.device), dry_run)
    steps = gpu_moe.measure(plan.moe, plan.device, rates)
    gpu_steps.free_device_memory()
    offline_run = gpu_offline.offline_run(
        plan.moe.model,
        plan.device,
        plan.offline_requests,
        plan.max_len,
        cuda_graphs=True,
        async_scheduling=True,
    )
    return {"model": plan.moe.model, "device": vars(rates), "steps": steps, "offline_graphs": offline_run}


def run_part(name: str, part: Callable[[], dict]) -> dict:
    """A part's figures, or the error that stopped it: one failing part (on a device no session
    has tried yet) must not cost the others their run."""
    print(f"-- {name}", flush=True)
    try:
        return part()
    except Exception as error:  # recorded, printed, and judged a miss
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    finally:  # a failed part's engine (in reference cycles) must not take the next part's memory
        gpu_steps.free_device_memory()


def goals_met(result: dict, dry_run: bool, rehearse: bool = False) -> dict[str, bool]:
    """Each goal, judged on the parts that ran (a part missing or failed misses its goals); a
    rehearsal judges the served goals only."""
    parts = result["parts"]
    ran = {name for name, part in parts.items() if "error" not in part}
    comparison = parts.get("served", {}).get("served_vs_alone") if "served" in ran else None
    if rehearse:
        return gpu_served.goals_met(comparison)
    exactness = parts.get("exactness", {})
    checks = [c for kind in EXACTNESS_KINDS for c in exactness.get(kind, [])]
    met = {"every exactness check passes": "exactness" in ran and all(c["passed"] for c in checks)}
    met["greedy tokens with async scheduling identical to synchronous steps (up to ties)"] = (
        "exactness" in ran and all(c["passed"] for c in exactness["async_against_sync"])
    )
    if dry_run:  # the CPU's figures are not the H100's: the speed goals are not judged
        met["every part ran"] = ran == set(PARTS)
        return met
    decode_goal = (
        f"decode steps at batch >= {gpu_steps.GOAL_MIN_BATCH} <= {gpu_steps.GOAL_RATIO}x the HBM floor"
        " (eager or graphs, the better)"
    )
    best: dict[int, float] = {}  # batch -> the better ratio of its eager and graphs steps
    for s in parts.get("steps", {}).get("steps", []):
        if s["case"].startswith("decode-b"):
            batch = int(s["case"].removeprefix("decode-b").removesuffix(" graphs"))
            best[batch] = min(best.get(batch, float("inf")), s["ratio"])
    met[decode_goal] = "steps" in ran and all(
        ratio <= gpu_steps.GOAL_RATIO for batch, ratio in best.items() if batch >= gpu_steps.GOAL_MIN_BATCH
    )
    # at the default sizes: graphs_1024 (vLLM's sizes) says what they would give, not what we do
    runs = [parts["offline"][name] for name in ("eager", "graphs")] if "offline" in ran else []
    met["offline >= 6,600 output tok/s (eager or graphs at the default sizes, the better)"] = any(
        run["output_tok_per_s"] >= GOALS["offline_output_tok_per_s_min"] for run in runs
    )
    share = GOALS["offline_device_idle_share_max"]
    met[
        f"offline: the device idle (wall less model time) <= {share:.0%} of the wall time (graphs, async)"
    ] = "offline" in ran and parts["offline"]["graphs"]["device_idle_share"] <= share
    moe_goal = (
        f"MoE decode steps at batch >= {gpu_moe.GOAL_MIN_BATCH} <= {gpu_moe.GOAL_RATIO}x the touched-expert "
        "HBM floor (eager or graphs, the better)"
    )
    met[moe_goal] = "moe" in ran and gpu_moe.goal_met(parts["moe"]["steps"])
    return met | gpu_served.goals_met(comparison)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="on this CPU: Triton interpreted, tiny shapes")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help=f"on this CPU: {','.join(REHEARSED_PARTS)} at the GPU plan's concurrency, a tiny model",
    )
    parser.add_argument("--output", type=Path, help="default: bench/results/gpu_<device>.json")
    parser.add_argument("--parts", help=f"some of {','.join(PARTS)}; the output's others are kept")
    args = parser.parse_args(argv)
    allowed = REHEARSED_PARTS if args.rehearse else PARTS
    chosen = args.parts.split(",") if args.parts else list(allowed)
    if not set(chosen) <= set(allowed):
        parser.error(f"--parts: each of {allowed}, got {args.parts!r}")
    if args.dry_run and args.rehearse:
        parser.error("--dry-run or --rehearse, not both")
    plan = DRY_RUN if args.dry_run else REHEARSAL if args.rehearse else FULL
    on_cpu = args.dry_run or args.rehearse
    if not on_cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run or --rehearse on the CPU")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before our kernel's module is first imported
    if args.rehearse:  # the offline engine's threads as the served replica's
        torch.set_num_threads(plan.served_app_args["cpu_threads"])
    if on_cpu:
        name = "dry_run" if args.dry_run else "rehearsal"
    else:
        name = torch.cuda.get_device_name().split()[1].lower()
    output = args.output or Path(f"bench/results/gpu_{name}.json")
    run = BenchmarkRun("gpu", output, gpu_served.GOALS if args.rehearse else GOALS)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    kept = json.loads(output.read_text()) if output.exists() and set(chosen) != set(allowed) else {}
    body: dict = {
        "dry_run": args.dry_run,
        "rehearsal": args.rehearse,
        "plan": {"model": plan.model, "steps": vars(plan.steps), "served": vars(plan.served)},
        # each part's figures and date: a chosen part's earlier ones stay until its run replaces
        # them, so a call cut short at its time limit loses no part
        "parts": kept.get("parts", {}),
        "measured_at": kept.get("measured_at", {}),
    }
    parts = {
        "exactness": lambda: exactness(plan, work_dir),
        "steps": lambda: steps(plan, args.dry_run),
        "kernels": lambda: kernels(plan, args.dry_run),
        "offline": lambda: gpu_offline.offline(
            plan.model, plan.device, plan.offline_requests, plan.max_len, plan.offline_engine
        ),
        "overlap": lambda: gpu_overlap.overlap(
            plan.model, FULL.offline_requests, FULL.max_len, plan.offline_engine
        ),
        "served": lambda: served(plan, work_dir),
        "served_options": lambda: served_options(plan, work_dir),
        "moe": lambda: moe(plan, args.dry_run),
    }
    for part_name in chosen:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        body["parts"][part_name] = run_part(part_name, parts[part_name])
        body["measured_at"][part_name] = now
        run.write(body, {})  # so far: a run cut short still leaves its parts
    body["parts"] = {name: body["parts"][name] for name in allowed if name in body["parts"]}
    gpu_report.print_table(body["parts"])
    met = goals_met(body, args.dry_run, args.rehearse)
    print_verdicts(met)
    run.write(body, met)


if __name__ == "__main__":
    main()
