"""`python -m bench tool_calls`: whether tool calls come back valid, stallfree beside vLLM CPU
(issue 40). An agent loop needs every call to name a tool it declared, with arguments its code can
read; stallfree generates calls under a grammar that holds them to the tools' schemas, vLLM CPU
0.32 parses what the model wrote (auto) or constrains the arguments its own way (required, named).

Requests: the tools and prompts of harness/tool_schemas.py (tests/serve/test_tool_calls.py's
three Pydantic tools and five prompts, the no-tool prompt and three more), each prompt under every
`tool_choice`: `required` (parallel_tool_calls true, and false), each tool by name, and `auto`;
sent with the official `openai` client (`tools` from `pydantic_function_tool`, greedy,
max_tokens 120, as an agent's budget for a call), one at a time, to each server in turn on the same cores:
  1. stallfree as serve_config.yaml ships it (hermes calls, our ChatML tools template);
  2. vLLM 0.32's CPU backend with `--enable-auto-tool-choice --tool-call-parser hermes
     --chat-template common/chat_templates/chatml_tools.jinja` (bench.peers.VLLM_TOOLS: our
     template, so both render the same prompt; skipped, with a note, where not installed).

Valid: finish_reason "tool_calls" ("stop" for a named choice) and every call names a listed tool
(the named one, for a named choice; one call where parallel_tool_calls is false) with `arguments`
that are JSON and validate against the tool's Pydantic model (harness.tool_schemas.call_problem),
and no call tag text in `content`; under auto, a text answer (no half call in it) is valid too.
Plus, per server, a tool whose parameters are the nonsense schema `{"type": "frobnicate"}`, under
auto and under required: refused (a 400) or accepted.
Goals: stallfree's valid share 100% under required and named, and at least vLLM's in every mode.
Writes bench/results/tool_calls.json. About 10 minutes (2 of them vLLM's start); not in make test."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openai

from bench import peers
from bench.driver import print_verdicts
from bench.quality import answer_bench
from harness import serve_cluster
from harness.tool_schemas import (
    MODELS,
    MORE_PROMPTS,
    NO_TOOL_PROMPT,
    NONSENSE_TOOL,
    PROMPTS,
    call_problem,
    tools,
)

MAX_TOKENS = 120  # issue 59: an agent-style call finishes within it
OURS, VLLM = "stallfree", "vLLM CPU"
TOOLS = tools()
ALL_PROMPTS = [*PROMPTS, NO_TOOL_PROMPT, *MORE_PROMPTS]
NAMED = {name: {"type": "function", "function": {"name": name}} for name in MODELS}
MODES: dict[str, dict] = {  # name -> the request's fields
    "required": {"tool_choice": "required", "parallel_tool_calls": True},
    "required, one call": {"tool_choice": "required", "parallel_tool_calls": False},
    **{f"named {name}": {"tool_choice": named, "parallel_tool_calls": True} for name, named in NAMED.items()},
    "auto": {},
}
CONSTRAINED = [mode for mode in MODES if mode != "auto"]  # the modes that must call
GOALS = {"required_and_named_valid_share_min": 1.0, "valid_share_vs_vllm_min": 1.0}


@dataclass(frozen=True)
class Case:
    prompt_id: str  # p1, p2, ... in ALL_PROMPTS' order
    prompt: str
    mode: str


def cases() -> list[Case]:
    return [Case(f"p{i + 1}", prompt, mode) for i, prompt in enumerate(ALL_PROMPTS) for mode in MODES]


def problem(mode: str, choice: openai.types.chat.chat_completion.Choice) -> str | None:
    """Why the answer is not a valid one under `mode` (None: it is)."""
    calls = choice.message.tool_calls or []
    content = choice.message.content or ""
    if "<tool_call" in content or "</tool" in content:
        return "tag text in content"
    if not calls:
        if mode != "auto":
            return "no call"
        return None if content else "empty answer"
    allowed = (mode.removeprefix("named "),) if mode.startswith("named ") else tuple(MODELS)
    for call in calls:
        why = call_problem(call.function.name, call.function.arguments, allowed)
        if why is not None:
            return why
    if mode == "required, one call" and len(calls) > 1:
        return "several calls, parallel off"
    expected = "stop" if mode.startswith("named ") else "tool_calls"  # as OpenAI's API answers
    return None if choice.finish_reason == expected else f"finish_reason {choice.finish_reason}"


def shown(message: openai.types.chat.ChatCompletionMessage) -> str:
    calls = message.tool_calls or []
    text = "; ".join(f"{c.function.name} {c.function.arguments}" for c in calls) or message.content or ""
    return text[: answer_bench.OUTPUT_CHARS]


def ask(client: openai.OpenAI, served_model: str, case: Case) -> dict:
    row = {"prompt": case.prompt_id, "mode": case.mode}
    try:
        reply = client.chat.completions.create(
            model=served_model,
            messages=[{"role": "user", "content": case.prompt}],
            tools=TOOLS,
            temperature=0,
            max_tokens=MAX_TOKENS,
            **MODES[case.mode],
        )
    except openai.APIStatusError as failure:  # a server refusing the request: a failure, not a crash
        return row | {"valid": False, "why": f"HTTP {failure.status_code}", "output": str(failure)[:80]}
    choice = reply.choices[0]
    why = problem(case.mode, choice)
    row |= {
        "valid": why is None,
        "calls": [call.function.name for call in choice.message.tool_calls or ()],
        "completion_tokens": reply.usage.completion_tokens,
    }
    return row if why is None else row | {"why": why, "output": shown(choice.message)}


def nonsense(client: openai.OpenAI, served_model: str, tool_choice: str) -> str:
    """What the server does with a tool whose parameters are no JSON schema."""
    try:
        reply = client.chat.completions.create(
            model=served_model,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            tools=[NONSENSE_TOOL],
            tool_choice=tool_choice,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
    except openai.APIStatusError as failure:
        return f"{'refused' if failure.status_code == 400 else 'failed'} ({failure.status_code})"
    calls = reply.choices[0].message.tool_calls or []
    return f"accepted (200, {len(calls)} calls, finish_reason {reply.choices[0].finish_reason})"


def mode_summary(rows: list[dict]) -> dict:
    valid = sum(r["valid"] for r in rows)
    return {
        "requests": len(rows),
        "valid": valid,
        "valid_share": valid / len(rows),
        "answered_with_calls": sum(bool(r.get("calls")) for r in rows),
        "why_not": dict(Counter(r["why"] for r in rows if not r["valid"]).most_common()),
    }


def measure(base_url: str, name: str, concurrency: int) -> dict:
    client, served_model = answer_bench.client(base_url)
    rows = answer_bench.each(lambda case: ask(client, served_model, case), cases(), concurrency)
    for row in rows:
        if not row["valid"]:
            print(f"{name}: {row['prompt']} {row['mode']}: {row['why']}: {row['output']!r}", flush=True)
    constrained = [r for r in rows if r["mode"] in CONSTRAINED]
    summary = {
        "source": "measured in this run",
        "requests": len(rows),
        "valid_share": sum(r["valid"] for r in rows) / len(rows),
        "required_and_named_share": sum(r["valid"] for r in constrained) / len(constrained),
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in rows),
        "modes": {mode: mode_summary([r for r in rows if r["mode"] == mode]) for mode in MODES},
        "nonsense_schema": {mode: nonsense(client, served_model, mode) for mode in ("auto", "required")},
    }
    print(name, {mode: f"{s['valid']}/{s['requests']}" for mode, s in summary["modes"].items()}, flush=True)
    print(name, "nonsense schema:", summary["nonsense_schema"], flush=True)
    return {"summary": summary, "rows": rows}


def measure_ours(work_dir: Path, concurrency: int) -> dict:
    cluster = serve_cluster.start(serve_cluster.SHIPPED_CONFIG, work_dir)
    try:
        cluster.wait_ready()
        return measure(f"{cluster.base_url}/v1", OURS, concurrency)
    finally:
        serve_cluster.stop(cluster)


def print_table(results: dict[str, dict]) -> None:
    def share(mode: str):
        return lambda s: f"{s['modes'][mode]['valid_share']:.0%}"

    answer_bench.print_table(
        results,
        (
            *((mode, len(mode) + 2, share(mode)) for mode in MODES),
            ("nonsense schema (auto; required)", 0, lambda s: "; ".join(s["nonsense_schema"].values())),
        ),
    )


def judged(results: dict[str, dict]) -> dict[str, bool]:
    ours = {mode: s["valid_share"] for mode, s in results[OURS]["summary"]["modes"].items()}
    constrained = all(ours[m] >= GOALS["required_and_named_valid_share_min"] for m in CONSTRAINED)
    met = {"required_and_named_valid_share_min": constrained}
    if not answer_bench.measured(results[VLLM]):
        return met | {"valid_share_vs_vllm_min": answer_bench.at_least(0, None, 1, VLLM)}
    theirs = {mode: s["valid_share"] for mode, s in results[VLLM]["summary"]["modes"].items()}
    factor = GOALS["valid_share_vs_vllm_min"]
    behind = [m for m in MODES if not answer_bench.at_least(ours[m], theirs[m], factor, VLLM)]
    for mode in behind:
        print(f"MISS {mode}: {OURS} {ours[mode]:.0%} < {VLLM} {theirs[mode]:.0%}")
    return met | {"valid_share_vs_vllm_min": not behind}


def main(argv: list[str] | None = None) -> None:
    args, run, work_dir = answer_bench.start("tool_calls", __doc__, GOALS, argv)
    log = work_dir / "vllm_cpu.log"

    def on_vllm(url: str) -> dict:
        return measure(url, VLLM, args.concurrency)

    vllm = answer_bench.measure_peer(
        peers.VLLM_TOOLS, log, not args.no_vllm, on_vllm
    )  # first: alone on the cores
    results = {OURS: measure_ours(work_dir, args.concurrency), VLLM: vllm}
    print_table(results)
    met = judged(results)
    print_verdicts(met)
    settings = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "concurrency": args.concurrency,
        "prompts": dict(zip((c.prompt_id for c in cases()[:: len(MODES)]), ALL_PROMPTS, strict=True)),
        "modes": MODES,
        "tools": list(MODELS),
        "nonsense_tool": NONSENSE_TOOL,
        "vllm_command": peers.VLLM_TOOLS.command,
    }
    body = answer_bench.body(settings, results)
    body["by_mode"] = {
        mode: {name: s["modes"][mode]["valid_share"] for name, s in body["servers"].items()} for mode in MODES
    }
    run.write(body, met)


if __name__ == "__main__":
    main()
