"""A multi-tenant chat workload, as prefix-aware routing meets it: tenants with long system
prompts, several users per tenant, each user a multi-turn conversation that resends its history.

Conversations start at Poisson times (fixed seed); within one, a turn is sent when the previous
answer has arrived plus a think time. Text is real English (bench/text_prompts.py) cut at seeded
offsets, so text-matching routers (Ray's PrefixCacheAffinityRouter) see what a user would send;
a new seed gives new text, so one run never finds what an earlier run cached."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import aiohttp

from bench.text_prompts import english_text, excerpt
from common.latency import RequestTiming
from harness.pacing import open_loop
from harness.random_workload import zipf_weights
from harness.sse_client import client_session, stream_completion


@dataclass(frozen=True)
class Conversation:
    tenant: int
    user: int
    at_s: float  # from the run's start
    system: str
    questions: list[str]  # one per turn
    think_s: list[float]  # pause after each answer


@dataclass
class Turn:
    tenant: int
    user: int
    turn: int
    cached_tokens: int  # of the prompt, found in the prefix cache
    timing: RequestTiming | None  # None: it failed


def multi_tenant_chat(
    seed: int,
    num_tenants: int,
    users_per_tenant: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    mean_gap_s: float,
    mean_think_s: float,
    zipf_s: float | None = None,
) -> list[Conversation]:
    """`users_per_tenant` users each; with `zipf_s`, as many users in all, each of a tenant drawn
    with popularity ~ 1 / rank^s (skewed: a few tenants hot, most cold)."""
    rng = random.Random(seed)
    text = english_text()
    systems = [
        f"You are the assistant of tenant {t}. " + excerpt(rng, text, system_tokens)
        for t in range(num_tenants)
    ]
    users = [(t, u) for t in range(num_tenants) for u in range(users_per_tenant)]
    if zipf_s is not None:
        tenants = rng.choices(range(num_tenants), zipf_weights(num_tenants, zipf_s), k=len(users))
        users = [(tenant, u) for u, tenant in enumerate(tenants)]
    rng.shuffle(users)
    conversations, now = [], 0.0
    for tenant, user in users:
        now += rng.expovariate(1 / mean_gap_s)
        questions = [excerpt(rng, text, question_tokens) for _ in range(turns)]
        think = [rng.expovariate(1 / mean_think_s) for _ in range(turns)]
        conversations.append(Conversation(tenant, user, now, systems[tenant], questions, think))
    return conversations


async def run_conversations(
    url: str, conversations: list[Conversation], max_tokens: int, failures_end_conversations: bool = False
) -> tuple[float, list[Turn]]:
    """Every conversation from its start time, turn after turn; greedy answers of exactly
    `max_tokens` tokens (ignore_eos), streamed. A failed turn raises, or (with a replica killed
    on purpose) is kept as a Turn without timing and ends its conversation."""

    async def converse(http: aiohttp.ClientSession, conversation: Conversation) -> list[Turn]:
        messages = [{"role": "system", "content": conversation.system}]
        turns = []
        for index, (question, think_s) in enumerate(
            zip(conversation.questions, conversation.think_s, strict=True)
        ):
            messages.append({"role": "user", "content": question})
            body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            result = await stream_completion(http, url, body)
            if result.status != 200 or result.error_code is not None:
                if not failures_end_conversations:
                    raise RuntimeError(f"request failed: HTTP {result.status}, {result.error_code}")
                turns.append(Turn(conversation.tenant, conversation.user, index, 0, None))
                break
            cached = result.cached_tokens or 0
            turns.append(Turn(conversation.tenant, conversation.user, index, cached, result.timing()))
            messages.append({"role": "assistant", "content": result.text})
            await asyncio.sleep(think_s)
        return turns

    async with client_session(900) as http:
        wall_s, turns = await open_loop(lambda conversation: converse(http, conversation), conversations)
        return wall_s, [turn for conversation in turns for turn in conversation]
