"""vLLM's offline API as its users write it: the quickstart with only the import changed runs and
prints, results are vLLM's shape (a RequestOutput per prompt, its n choices in `outputs`), and n
choices are n requests of their own (greedy: alike; seeded: each with its own seed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness.serve_cluster import REPO
from replica_engine import LLM, RequestOutput, SamplingParams

# vLLM's docs' quickstart (docs/getting_started/quickstart.md), `vllm` replaced by our package and
# its model by ours (no model can be downloaded here).
QUICKSTART = """
from replica_engine import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="smollm2-135m-instruct")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


def test_vllms_quickstart_runs_with_our_import():
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(QUICKSTART)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("Prompt: ")]
    assert [line.split(", Generated text: ")[0] for line in lines] == [
        "Prompt: 'Hello, my name is'",
        "Prompt: 'The president of the United States is'",
        "Prompt: 'The capital of France is'",
        "Prompt: 'The future of AI is'",
    ]
    assert all(line.split(", Generated text: ")[1] != "''" for line in lines)


def test_results_are_vllms_shape_with_n_choices(llm: LLM):
    ids = llm.engine.tokenize("Count to ten:")
    greedy, seeded = llm.generate(
        ["Count to ten:", ids],
        [
            SamplingParams(max_tokens=6, temperature=0, n=2),
            SamplingParams(max_tokens=6, seed=3, n=3, logprobs=0),
        ],
    )
    assert isinstance(greedy, RequestOutput) and greedy.finished
    assert greedy.prompt == "Count to ten:" and seeded.prompt is None
    assert greedy.prompt_token_ids == seeded.prompt_token_ids == ids
    assert [c.index for c in greedy.outputs] == [0, 1] and [c.index for c in seeded.outputs] == [0, 1, 2]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids  # greedy: n alike
    assert greedy.outputs[0].cumulative_logprob is None  # logprobs not asked
    # choice j samples with seed + j: the same as a request of one choice with that seed
    for j, choice in enumerate(seeded.outputs):
        alone = llm.generate(ids, SamplingParams(max_tokens=6, seed=3 + j))[0].outputs[0]
        assert choice.token_ids == alone.token_ids and choice.finish_reason == "length"
        assert choice.cumulative_logprob == sum(lp.logprob for lp in choice.logprobs)
    assert llm.get_default_sampling_params() == SamplingParams()
