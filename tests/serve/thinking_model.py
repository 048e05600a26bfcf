"""A Qwen3-shaped model that thinks, for the reasoning tests: a one-layer `qwen3` (q/k norms,
GQA) with the embedded model's tokenizer plus Qwen3's `<think>` and `</think>` tokens, and a
Qwen3-style chat template (ChatML, tools in the system turn, `enable_thinking: false` closes an
empty thinking block in the prompt). Random weights answer at random, so its weights are set
to answer one script: its layer writes nothing into the residual stream (o_proj and down_proj
are zero), so each logit is the lm_head row against the last token's embedding, and the rows
make a bigram table: after the generation prompt's "\\n", `<think>Hmm</think>Hi<|im_end|>`;
after the empty thinking block's "\\n\\n", `Hi<|im_end|>`. Every other token scores ~0, so a
grammar picks among them (lowest id first, greedy)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from common.model_source import DEFAULT_MODEL, resolve_model

TEMPLATE = """{%- if tools or messages[0].role == 'system' -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif -%}
{% if tools %}
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>{% endif %}<|im_end|>
{% endif -%}
{%- for message in messages if message.role != 'system' -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}"""
THOUGHT, ANSWER = "Hmm", "Hi"


def build(directory: Path) -> Path:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).hf_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embeddings = model.model.embed_tokens.weight
        embeddings.copy_(torch.nn.functional.normalize(torch.randn_like(embeddings), dim=-1))
        table = model.lm_head.weight
        table.zero_()
        # each script from the last token of the prompt it follows, as that prompt tokenizes
        scripts = [
            ("assistant\n", f"<think>{THOUGHT}</think>{ANSWER}<|im_end|>"),
            ("</think>\n\n", f"{ANSWER}<|im_end|>"),
        ]
        for prompt_end, script in scripts:
            tokens = tokenizer.encode(prompt_end, add_special_tokens=False)[-1:]
            tokens += tokenizer.encode(script, add_special_tokens=False)
            for last, following in itertools.pairwise(tokens):
                table[following] += 4 * embeddings[last]  # ~32 for `following` after `last`; others ~N(0, 4)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
