"""The shared package, the Ingress and the routers load without torch; the torch-free tokenizer
agrees with transformers'."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.prompts import PromptProcessor
from common.tokenizer import PromptTokenizer

TORCH_FREE_MODULES = [
    "common.block_hash",
    "common.block_summary",
    "common.errors",
    "common.messages",
    "common.metrics_sinks",
    "common.model_source",
    "common.prompts",
    "common.sampling_params",
    "common.tokenizer",
    "deployments.ingress",
    "router.kv_router",
    "router.prefix_router",
    "router.round_robin",
]


def test_the_ingress_and_routers_import_no_torch():
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE_MODULES!r}: importlib.import_module(name)\n"
        "heavy = ('torch', 'transformers', 'replica_engine')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_ingress_tokenizer_loads_without_torch(model_dir):
    """What Ingress.__init__ does (the model resolved, its tokenizer loaded, a chat tokenized)."""
    code = (
        "import sys\n"
        "from common.model_source import resolve_model\n"
        "from common.prompts import PromptProcessor\n"
        "prompts = PromptProcessor.load(resolve_model('smollm2-135m-instruct'))\n"
        "prompts.chat_prompt([{'role': 'user', 'content': 'hi'}])\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


TEXTS = ["Hello", " The capital of", "naïve café — 東京 🚀\n\ttabs  and  spaces", "<|im_start|>user"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome"},
        {"role": "user", "content": "And of Spain? {{ not a template }}"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_text_tokenizes_as_transformers_does(model_dir, text):
    ours = PromptTokenizer.load(model_dir)
    theirs = AutoTokenizer.from_pretrained(model_dir)
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_renders_as_transformers_does(model_dir, messages):
    ours = PromptTokenizer.load(model_dir)
    theirs = AutoTokenizer.from_pretrained(model_dir)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected


def test_default_max_tokens_fits_the_context_left():
    prompts = PromptProcessor(None, vocab_size=100, max_model_len=1000)
    assert prompts.default_max_tokens(900, server_default=256) == 100
    assert prompts.default_max_tokens(100, server_default=256) == 256
    assert prompts.default_max_tokens(100, server_default=None) == 900
