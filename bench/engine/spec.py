"""`python -m bench spec`: speculative decoding where it should pay and where it must not cost.
The engine as a replica builds it (core on a thread, every core; no Ray, no HTTP), without and
with prompt lookup (`speculative_config: {method: ngram, num_speculative_tokens: 4}`), greedy,
each request to its natural end (at most MAX_TOKENS): both systems must answer the same tokens,
so they do the same work, and every answer is compared.

Workloads (each seed picks its own items; chat-templated for SmolLM2-135M-Instruct):
- editing: a short function of the Python standard library (its source, this Python's), asked
  back with one change: the answer copies most of the prompt;
- json: a seeded list of records as JSON, asked back with one field changed in each;
- chat: a paragraph of English prose (bench.text_prompts), asked to be summarised: little to copy.
c=1 runs each workload's requests one at a time (decode tok/s: output tokens after the first over
the time after the first); c=16 runs the chat workload four times over (output tok/s over the
wall). Systems alternate within a seed (plain, ngram; reversed every other seed), and each ratio
is taken within a seed, then the median over seeds. Writes bench/results/spec.json; about 15
minutes, not part of make test. Suffix decoding and a draft model are not built yet."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
from pathlib import Path

from bench.driver import BenchmarkRun, EngineClient, Spread, engine_as_served, print_verdicts
from bench.serving.cpu_serving import shipped_tokenizer
from bench.text_prompts import english_text, excerpt
from harness.pacing import closed_loop
from replica_engine import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SYSTEMS = {"plain": {}, "ngram": {"speculative_config": NGRAM}}
SEEDS = (0, 1, 2)
MAX_TOKENS = 256
PER_WORKLOAD = 4  # requests per workload and seed at c=1
C16_REPEAT = 4  # the chat requests, this many times over, at c=16
GOALS = {
    "editing_c1_tok_per_s_vs_plain_min": 1.5,
    "chat_c1_tok_per_s_vs_plain_min": 1.0,
    "chat_c16_tok_per_s_vs_plain_min": 0.97,
    "identical_outputs_share_min": 1.0,
}
# Short pure-Python functions of the standard library: their source is the prompt's code.
FUNCTIONS = (
    "textwrap.indent", "shlex.quote", "string.capwords", "colorsys.rgb_to_hsv", "colorsys.hsv_to_rgb",
    "calendar.isleap", "calendar.leapdays", "statistics.mean", "statistics.median", "statistics.median_low",
    "glob.escape", "html.escape", "base64.b64encode", "quopri.needsquoting", "fnmatch.filter",
)  # fmt: skip
EDITS = (
    "Rename its first parameter to `value`.",
    "Add a one-line docstring.",
    "Add type hints to its parameters.",
)


def _source(dotted: str) -> str:
    module_name, name = dotted.rsplit(".", 1)
    module = __import__(module_name, fromlist=[name])
    return inspect.getsource(getattr(module, name))


def prompts(tokenizer, workload: str, seed: int) -> list[list[int]]:
    rng = random.Random(f"{workload}-{seed}")
    texts = []
    for _ in range(PER_WORKLOAD):
        if workload == "editing":
            code = _source(rng.choice(FUNCTIONS))
            texts.append(f"```python\n{code}```\n{rng.choice(EDITS)} Return the whole function.")
        elif workload == "json":
            records = [
                {"id": i, "name": rng.choice(["Ada", "Bo", "Cy", "Di", "Ed"]), "age": rng.randrange(18, 90)}
                for i in range(rng.randrange(4, 8))
            ]
            texts.append(
                f"{json.dumps(records, indent=2)}\nReturn this JSON with every age increased by one."
            )
        else:
            texts.append(f"{excerpt(rng, english_text(), 200)}\n\nSummarise the text above in two sentences.")
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
            )
        )
        for text in texts
    ]


def run_system(settings: dict, work: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Every point on one engine: c=1 per workload, then chat at c=16. Figures and answers."""
    engine = engine_as_served(settings)
    client = EngineClient(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

    async def serve(items: list[list[int]], concurrency: int):
        return await closed_loop(lambda prompt: client.send(prompt, params), items, concurrency)

    asyncio.run(serve(work["chat"][:1], 1))  # warm: kernels, first steps
    points: dict[str, dict] = {}
    try:
        for workload, items in work.items():
            _, served = asyncio.run(serve(items, 1))
            decode_tokens = sum(s.timing.output_len - 1 for s in served)
            decode_s = sum(s.timing.e2e_s - s.timing.ttft_s for s in served)
            points[f"{workload} c=1"] = {
                "tok_per_s": decode_tokens / decode_s,
                "output_tokens": sum(s.timing.output_len for s in served),
                "answers": [s.output for s in served],
            }
        wall_s, served = asyncio.run(serve(work["chat"] * C16_REPEAT, 16))
        points["chat c=16"] = {
            "tok_per_s": sum(s.timing.output_len for s in served) / wall_s,
            "output_tokens": sum(s.timing.output_len for s in served),
            "answers": [s.output for s in served],
        }
    finally:
        engine.shutdown()
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--output", type=Path, default=Path("bench/results/spec.json"))
    args = parser.parse_args()
    run = BenchmarkRun("spec", args.output, GOALS)
    tokenizer = shipped_tokenizer()
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    identical, compared = 0, 0
    for index, seed in enumerate(args.seeds):
        work = {w: prompts(tokenizer, w, seed) for w in ("editing", "json", "chat")}
        order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
        seed_points = {name: run_system(SYSTEMS[name], work) for name in order}
        for point, figures in seed_points["plain"].items():
            answers = zip(figures["answers"], seed_points["ngram"][point]["answers"], strict=True)
            same = [a == b for a, b in answers]
            identical, compared = identical + sum(same), compared + len(same)
        for name, points in seed_points.items():
            runs[name].append({point: figures["tok_per_s"] for point, figures in points.items()})
            print(
                f"seed {seed} {name}: "
                + ", ".join(f"{p} {f['tok_per_s']:.1f} tok/s" for p, f in points.items()),
                flush=True,
            )
    points = list(runs["plain"][0])
    ratios = {point: Spread.of_ratios(runs["ngram"], runs["plain"], point) for point in points}
    for point, ratio in ratios.items():
        print(f"ngram / plain, {point}: {ratio:.2f}")
    share = identical / compared
    goals_met = {
        "editing_c1_tok_per_s_vs_plain_min": ratios["editing c=1"].median
        >= GOALS["editing_c1_tok_per_s_vs_plain_min"],
        "chat_c1_tok_per_s_vs_plain_min": ratios["chat c=1"].median
        >= GOALS["chat_c1_tok_per_s_vs_plain_min"],
        "chat_c16_tok_per_s_vs_plain_min": ratios["chat c=16"].median
        >= GOALS["chat_c16_tok_per_s_vs_plain_min"],
        "identical_outputs_share_min": share >= GOALS["identical_outputs_share_min"],
    }
    print(f"identical answers: {identical} of {compared}")
    print_verdicts(goals_met)
    body = {
        "settings": {
            "systems": SYSTEMS,
            "seeds": args.seeds,
            "max_tokens": MAX_TOKENS,
            "per_workload": PER_WORKLOAD,
        },
        "points": {
            point: {
                "plain_tok_per_s": vars(Spread.of_runs(runs["plain"], point)),
                "ngram_tok_per_s": vars(Spread.of_runs(runs["ngram"], point)),
                "ngram_vs_plain": vars(ratios[point]),
            }
            for point in points
        },
        "identical_outputs": {"identical": identical, "compared": compared, "share": share},
        "runs": runs,
    }
    run.write(body, goals_met)


if __name__ == "__main__":
    main()
