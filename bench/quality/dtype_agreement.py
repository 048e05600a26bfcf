"""What bf16 trades against fp32: the same held prompts (real English text, fixed seed), greedy, in
both dtypes (on the weights dequantized: `quantization: none`); how often the outputs agree, and
how far they agree when they do not.

    python -m bench dtype_agreement [--num-prompts 64] [--max-tokens 64]

Also asks the README's chat question in bf16. Writes bench/results/dtype_agreement.json."""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from bench.driver import BenchmarkRun
from bench.text_prompts import text_prompts
from harness.random_workload import log_uniform
from replica_engine import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_ANSWER = "The capital of France is Paris."


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def held_prompts(tokenizer, num_prompts: int, seed: int) -> list[list[int]]:
    """Windows of real English text, 16-512 tokens (log-uniform)."""
    rng = random.Random(seed)
    return text_prompts(tokenizer, [log_uniform(rng, 16, 512) for _ in range(num_prompts)], seed)


def measure(num_prompts: int, max_tokens: int, seed: int) -> dict:
    outputs: dict[str, list[list[int]]] = {}
    answers: dict[str, str] = {}
    prompts: list[list[int]] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, quantization="none", num_kv_blocks=1024)
        prompts = prompts or held_prompts(llm.tokenizer, num_prompts, seed)
        outputs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        answers[dtype] = llm.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text
    agreed = [_common_prefix(a, b) for a, b in zip(outputs["float32"], outputs["bfloat16"], strict=True)]
    return {
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "identical_outputs": sum(n == max_tokens for n in agreed) / num_prompts,
        "first_token_agrees": sum(n > 0 for n in agreed) / num_prompts,
        "tokens_before_first_difference_median": statistics.median(agreed),
        "tokens_before_first_difference_mean": statistics.fmean(agreed),
        "chat_answers": answers,
        "bf16_chat_answer_correct": answers["bfloat16"] == EXPECTED_ANSWER,
    }


def report(result: dict) -> str:
    return (
        f"bf16 vs fp32, greedy, {result['num_prompts']} held text prompts x {result['max_tokens']} "
        f"tokens: identical outputs {result['identical_outputs']:.0%}, first token agrees "
        f"{result['first_token_agrees']:.0%}, tokens before the first difference median "
        f"{result['tokens_before_first_difference_median']:.0f} / mean "
        f"{result['tokens_before_first_difference_mean']:.1f}; bf16 chat answer: "
        f"{result['chat_answers']['bfloat16']!r}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench/results/dtype_agreement.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("dtype_agreement", args.output, {"bf16_chat_answer": EXPECTED_ANSWER})
    result = measure(args.num_prompts, args.max_tokens, args.seed)
    print(report(result))
    run.write(result, {"bf16 answers the README's chat question": result["bf16_chat_answer_correct"]})


if __name__ == "__main__":
    main()
