"""bench.gpu's table: each part's figures as the run prints them (its file holds them all)."""

from __future__ import annotations

import json

from bench.gpu import gpu_kernels, gpu_moe


def print_table(parts: dict) -> None:
    for name, part in parts.items():
        if "error" in part:
            print(f"{name}: FAILED: {part['error']}")
    if "error" not in parts.get("exactness", {"error": "not run"}):
        exactness = parts["exactness"]
        for against, check in [("transformers", c) for c in exactness["against_transformers"]] + [
            ("sync steps", c) for c in exactness.get("async_against_sync", [])
        ]:
            verdict = "ok" if check["passed"] else "FAIL"
            gaps = ", ".join(f"{d['top2_gap']:.2g}" for d in check["divergences"]) or "-"
            name = check["dtype"] + (" graphs" if check["cuda_graphs"] else "")
            name += " async" if check.get("async_scheduling") else ""
            waited = check.get("submissions_that_waited")
            waits = f", submissions that waited: {waited}" if waited is not None else ""
            print(f"exactness {name:22} vs {against:12} {check['identical']}/{check['prompts']} "
                  f"identical, gaps at divergences {gaps} (tolerance {check['tie_tolerance']}){waits}: "
                  f"{verdict}")  # fmt: skip
        for check in exactness["triton_attention"]:
            worst = max(check["max_abs_error"].values())
            verdict = "ok" if check["passed"] else "FAIL"
            tolerance = check["tolerance"]
            print(
                f"triton attention {check['dtype']:9} max abs error {worst:.2e} (tol {tolerance}): {verdict}"
            )
    if "error" not in parts.get("steps", {"error": "not run"}):
        rates = parts["steps"]["device"]
        print(f"device {rates['name']}: floors {rates['bytes_per_s'] / 1e12:.3f} TB/s, "
              f"{rates['flops_per_s'] / 1e12:.1f} TFLOP/s ({rates['source']}); measured copy "
              f"{rates['measured_bytes_per_s'] / 1e12:.3f} TB/s, bf16 matmul "
              f"{rates['measured_bf16_flops_per_s'] / 1e12:.1f} TFLOP/s")  # fmt: skip
        print(f"{'case':16}{'step ms':>10}{'model ms':>10}{'floor ms':>10}  {'bound':8}{'ratio':>7}")
        for s in parts["steps"]["steps"]:
            host = ", ".join(f"{phase} {ms:.2f}" for phase, ms in s["host_ms"].items())
            idle = "" if s["device_idle_ms"] is None else f"; device idle {s['device_idle_ms']:.2f} ms"
            print(f"{s['case']:16}{s['step_ms']:>10.2f}{s['model_ms']:>10.2f}{s['floor_ms']:>10.3f}  "
                  f"{s['floor_kind']:8}{s['ratio']:>6.2f}x  host ms: {host}{idle}")  # fmt: skip
    if "error" not in parts.get("kernels", {"error": "not run"}):
        gpu_kernels.print_table(parts["kernels"])
    if "error" not in parts.get("moe", {"error": "not run"}):
        gpu_moe.print_table(parts["moe"])
    for mode, o in parts["offline"].items() if "error" not in parts.get("offline", {"error": 1}) else ():
        print(f"offline {mode}: {o['requests']} requests, {o['output_tokens']} output tokens in "
              f"{o['wall_s']:.1f} s: {o['output_tok_per_s']:.0f} output tok/s "
              f"(anchor: vLLM 6,582.87 on an H100); {o['steps']} steps, model {o['model_s']:.1f} s, "
              f"steps' host side {o['overhead_s']:.1f} s, device idle {o['device_idle_s']:.1f} s "
              f"({o['device_idle_share']:.0%}), garbage collector {o['gc_pause_s']:.2f} s, "
              f"{o['decode_only_steps']} decode-only steps {o['decode_only_s']:.1f} s, "
              f"{o['mean_decodes_per_step']:.0f} decodes a step; the step thread's seconds: "
              + ", ".join(f"{phase} {s:.2f}" for phase, s in o["host_phases_s"].items()))  # fmt: skip
    served = parts.get("served", {})
    for system in ("engine_alone", "served"):
        for run, figures in served.get(system, {}).items():
            shown = figures.get("median", figures)
            keys = ("output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s")
            print(f"{system} {run}: " + ", ".join(f"{k} {shown[k]:.4g}" for k in keys if k in shown)
                  + f", failed {figures['failed']}")  # fmt: skip
    if "served_vs_alone" in served:
        print("served over the engine alone:", json.dumps(served["served_vs_alone"]))
    for name, option in parts.get("served_options", {}).items():
        if isinstance(option, dict) and "vs_alone" in option:
            print(f"served option {name} over the engine alone:", json.dumps(option["vs_alone"]))
    if "skipped" in served:
        print("served:", served["skipped"])
