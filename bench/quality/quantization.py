"""What serving the GGUF's own blocks (and int8) trades against the dequantized weights (issue 39):
perplexity on held English text and greedy agreement, each variant against the dequantized path
in float32 in the same run.

    python -m bench quantization [--num-windows 24] [--window 512]

Perplexity: every token of each window scored by the engine's prompt logprobs (text from
bench/text_prompts.py, fixed seed). Variants: the file's Q4_1/Q8_0 blocks with float32 and with
bfloat16 activations (the latter is what `make serve` runs), int8 weight-only from the
dequantized weights, and bfloat16 on the dequantized weights for scale. Greedy: the exactness
prompts (tests/engine/test_exactness.py's), 24 tokens: which differ from the dequantized path and,
where they part, that path's gap between its two best logprobs. Writes
bench/results/quantization.json (~3 minutes)."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from bench.driver import BenchmarkRun, print_verdicts
from bench.text_prompts import text_prompts
from harness.hf_reference import EXACTNESS_PROMPTS as GREEDY_PROMPTS
from replica_engine import LLM, RequestOutput, SamplingParams

GOAL_PERPLEXITY_RATIO = 0.01  # within 1% of the dequantized path's
REFERENCE = ("float32", "none")
VARIANTS = {
    "q4_1 blocks, float32 activations": ("float32", "gguf"),
    "q4_1 blocks, bfloat16 activations (default)": ("bfloat16", "gguf"),
    "int8 weight-only, float32 activations": ("float32", "int8"),
    "dequantized, bfloat16": ("bfloat16", "none"),
}
GREEDY_TOKENS = 24
GREEDY_PARAMS = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, logprobs=2)


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return math.exp(-statistics.fmean(lp.logprob for out in outs for lp in out.prompt_logprobs or []))


def divergences(llm: LLM, reference: list[RequestOutput]) -> list[dict]:
    """Prompts whose greedy output (GREEDY_PARAMS) differs from the reference's: where, and the
    reference's top-2 logprob gap there."""
    found = []
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    for prompt, ours, theirs in zip(GREEDY_PROMPTS, outputs, reference, strict=True):
        pairs = enumerate(zip(ours.outputs[0].token_ids, theirs.outputs[0].token_ids, strict=False))
        position = next((i for i, (a, b) in pairs if a != b), None)
        if position is not None:
            (_, best), (_, second) = theirs.outputs[0].logprobs[position].top[:2]
            found.append({"prompt": prompt[:60], "position": position, "top2_logprob_gap": best - second})
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--num-windows", type=int, default=24)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--output", type=Path, default=Path("bench/results/quantization.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("quantization", args.output, {"perplexity_vs_dequantized_max": GOAL_PERPLEXITY_RATIO})
    dtype, quantization = REFERENCE
    reference_llm = LLM(dtype=dtype, quantization=quantization)
    windows = text_prompts(reference_llm.tokenizer, [args.window] * args.num_windows, seed=0)
    reference = perplexity(reference_llm, windows)
    reference_greedy = reference_llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    del reference_llm
    print(f"{'variant':46}{'perplexity':>12}{'vs dequantized':>16}  greedy prompts differing")
    print(f"{'dequantized, float32 (reference)':46}{reference:>12.3f}")
    rows, goals_met = [], {}
    for name, (dtype, quantization) in VARIANTS.items():
        llm = LLM(dtype=dtype, quantization=quantization)
        value = perplexity(llm, windows)
        ratio = value / reference - 1
        parted = divergences(llm, reference_greedy)
        del llm
        rows.append({"variant": name, "dtype": dtype, "quantization": quantization, "perplexity": value,
                     "vs_dequantized": ratio, "greedy_differing": len(parted),
                     "greedy_divergences": parted})  # fmt: skip
        within = abs(ratio) <= GOAL_PERPLEXITY_RATIO
        goals_met[f"{name}: perplexity within {GOAL_PERPLEXITY_RATIO:.0%}"] = within
        gaps = ", ".join(f"{d['top2_logprob_gap']:.3f}" for d in parted)
        differing = f"{len(parted)}/{len(GREEDY_PROMPTS)}"
        print(f"{name:46}{value:>12.3f}{ratio:>+15.2%}   {differing} (top-2 gaps {gaps})")
    print_verdicts(goals_met)
    body = {
        "settings": {
            "num_windows": args.num_windows,
            "window_tokens": args.window,
            "greedy_tokens": GREEDY_TOKENS,
        },
        "reference": {"variant": "dequantized, float32", "perplexity": reference},
        "variants": rows,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
