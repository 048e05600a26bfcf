"""Why a request finished: one type from the engine's scheduler to the HTTP layer, which writes its
value as OpenAI's `finish_reason` string. Torch-free, as the Ingress reads it in ChoiceDeltas."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):  # a str: equal to OpenAI's string, as offline callers compare it
    STOP = "stop"  # a stop token or stop string
    TOOL_CALLS = "tool_calls"  # chat: stopped after calling tools (the Ingress reads the calls)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed while serving it
