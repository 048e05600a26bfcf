"""`python -m bench spec`: speculative decoding where it should pay and where it must not cost.
The engine as a replica builds it (core on a thread, every core; no Ray, no HTTP), without
speculation, with prompt lookup (`{method: ngram, num_speculative_tokens: 4}`) and with suffix
decoding (`{method: suffix}`, vLLM's defaults), greedy, each request to its natural end (at most
MAX_TOKENS): every system must answer the same tokens, so they do the same work, and every
answer is compared.

Workloads (each seed picks its own items; chat-templated for SmolLM2-135M-Instruct):
- editing: a short function of the Python standard library (its source, this Python's), asked
  back with one change: the answer copies most of the prompt;
- json: a seeded list of records as JSON, asked back with one field changed in each;
- chat: a paragraph of English prose (bench.text_prompts), asked to be summarised: little to copy.
c=1 runs each workload's requests one at a time (decode tok/s: output tokens after the first over
the time after the first); c=16 and c=64 run that many chat requests at once, each on a text no
other point uses (output tok/s over the wall). Systems take turns within a seed (the order
reversed every other seed), and each ratio is taken within a seed, then the median over seeds.
Writes bench/results/spec.json; about 40 minutes, not part of make test. The served comparison
with vLLM CPU's prompt lookup is `python -m bench spec_serving`."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import statistics
import time
from pathlib import Path

from bench.driver import BenchmarkRun, EngineClient, Spread, engine_as_served, print_verdicts
from bench.serving.cpu_serving import shipped_tokenizer
from bench.text_prompts import english_text, excerpt
from harness.pacing import closed_loop
from replica_engine import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix"}  # vLLM's defaults: depth and k 24, 10,000 outputs kept
SYSTEMS = {"plain": {}, "ngram": {"speculative_config": NGRAM}, "suffix": {"speculative_config": SUFFIX}}
SPECULATING = ("ngram", "suffix")
SEEDS = (0, 1, 2)
MAX_TOKENS = 256
PER_WORKLOAD = 4  # requests per workload and seed at c=1
BATCHED = (16, 64)
# verification_pricing's steps: decodes at this context, each with this many draft tokens
PRICED_BATCHES, PRICED_DRAFTS, PRICED_CONTEXT = (
    (1, 16),
    (0, 4, 8, 16, 24),
    512,
)  # chat at these concurrencies, each with as many requests (new texts)
GOALS = {
    "suffix_editing_c1_tok_per_s_vs_plain_min": 2.5,
    "ngram_editing_c1_tok_per_s_vs_plain_min": 1.5,
    **{f"{m}_chat_c1_tok_per_s_vs_plain_min": 1.0 for m in SPECULATING},
    **{f"{m}_chat_c{c}_tok_per_s_vs_plain_min": 0.97 for m in SPECULATING for c in BATCHED},
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


def prompts(tokenizer, workload: str, seed: int, count: int = PER_WORKLOAD) -> list[list[int]]:
    rng = random.Random(f"{workload}-{seed}")
    texts = []
    for _ in range(count):
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


def verification_pricing() -> list[dict]:
    """Steps of decodes carrying draft tokens, timed on the model (the median of three after a
    warm-up), beside what the step-time model predicts for them: it is fitted at startup on steps
    of plain decodes, and prices a drafting row as the one-token decodes it runs as."""
    from replica_engine import LLM
    from replica_engine.scheduler.plan import ScheduledBatch
    from replica_engine.step_profile import profile_row

    core = LLM(speculative_config=NGRAM).engine.core
    model, num_blocks = core.scheduler.step_time, core.kv_cache_manager.num_blocks
    assert model is not None
    priced = []
    for decodes in PRICED_BATCHES:
        for drafts in PRICED_DRAFTS:
            batch = ScheduledBatch(
                tuple(
                    profile_row(i, PRICED_CONTEXT, 1 + drafts, not drafts, core.config, num_blocks, drafts)
                    for i in range(decodes)
                )
            )
            seconds = []
            for _ in range(4):
                started = time.perf_counter()
                core.runner.execute(batch)
                seconds.append(time.perf_counter() - started)
            core.runner.release([row.request_id for row in batch.rows])
            measured, predicted = statistics.median(seconds[1:]), model.predict_raw(batch.shape())
            priced.append(
                {
                    "decodes": decodes,
                    "drafts": drafts,
                    "measured_s": measured,
                    "predicted_s": predicted,
                    "measured_vs_predicted": measured / predicted,
                }
            )
            print(
                f"{decodes} decodes + {drafts} drafts each: {measured * 1e3:.1f} ms,"
                f" predicted {predicted * 1e3:.1f} ms",
                flush=True,
            )
    return priced


def run_system(settings: dict, work: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Every point on one engine: c=1 per workload, then chat at each batched concurrency, each
    on texts of its own (suffix decoding keeps earlier outputs: a text asked again would be
    drafted from its first answer). Figures and answers."""
    engine = engine_as_served(settings)
    client = EngineClient(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)

    async def serve(items: list[list[int]], concurrency: int):
        return await closed_loop(lambda prompt: client.send(prompt, params), items, concurrency)

    asyncio.run(serve(work["warm"], 1))  # warm: kernels, first steps
    points: dict[str, dict] = {}
    try:
        for workload in ("editing", "json", "chat"):
            items = work[workload]
            _, served = asyncio.run(serve(items, 1))
            decode_tokens = sum(s.timing.output_len - 1 for s in served)
            decode_s = sum(s.timing.e2e_s - s.timing.ttft_s for s in served)
            points[f"{workload} c=1"] = {
                "tok_per_s": decode_tokens / decode_s,
                "output_tokens": sum(s.timing.output_len for s in served),
                "answers": [s.output for s in served],
            }
        for concurrency in BATCHED:
            wall_s, served = asyncio.run(serve(work[f"chat c={concurrency}"], concurrency))
            points[f"chat c={concurrency}"] = {
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
    priced = verification_pricing()
    identical, compared = 0, 0
    for index, seed in enumerate(args.seeds):
        work = {w: prompts(tokenizer, w, seed) for w in ("editing", "json")}
        # one pool of distinct texts: c=1, each batched point and the warm-up never share one
        chat = prompts(tokenizer, "chat", seed, PER_WORKLOAD + sum(BATCHED) + 1)
        work["chat"], work["warm"] = chat[:PER_WORKLOAD], chat[-1:]
        start = PER_WORKLOAD
        for concurrency in BATCHED:
            work[f"chat c={concurrency}"], start = chat[start : start + concurrency], start + concurrency
        order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
        seed_points = {name: run_system(SYSTEMS[name], work) for name in order}
        for point, figures in seed_points["plain"].items():
            for name in SPECULATING:
                same = [
                    a == b
                    for a, b in zip(figures["answers"], seed_points[name][point]["answers"], strict=True)
                ]
                identical, compared = identical + sum(same), compared + len(same)
        for name, points in seed_points.items():
            runs[name].append({point: figures["tok_per_s"] for point, figures in points.items()})
            print(
                f"seed {seed} {name}: "
                + ", ".join(f"{p} {f['tok_per_s']:.1f} tok/s" for p, f in points.items()),
                flush=True,
            )
    points = list(runs["plain"][0])
    ratios = {
        name: {point: Spread.of_ratios(runs[name], runs["plain"], point) for point in points}
        for name in SPECULATING
    }
    for name in SPECULATING:
        for point, ratio in ratios[name].items():
            print(f"{name} / plain, {point}: {ratio:.2f}")
    share = identical / compared
    goals_met = {
        goal: ratios[goal.split("_", 1)[0]][_point(goal)].median >= floor
        for goal, floor in GOALS.items()
        if goal != "identical_outputs_share_min"
    }
    goals_met["identical_outputs_share_min"] = share >= GOALS["identical_outputs_share_min"]
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
                **{f"{name}_tok_per_s": vars(Spread.of_runs(runs[name], point)) for name in SYSTEMS},
                **{f"{name}_vs_plain": vars(ratios[name][point]) for name in SPECULATING},
            }
            for point in points
        },
        "identical_outputs": {"identical": identical, "compared": compared, "share": share},
        "verification_pricing": priced,
        "runs": runs,
    }
    run.write(body, goals_met)


def _point(goal: str) -> str:
    """'suffix_chat_c16_tok_per_s_vs_plain_min' -> 'chat c=16'."""
    workload, concurrency = goal.split("_")[1:3]
    return f"{workload} c={concurrency[1:]}"


if __name__ == "__main__":
    main()
