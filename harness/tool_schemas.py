"""The tools that tool calling is tested and measured with (tests/serve/test_tool_calls.py and
bench.quality.tool_calls): three functions as Pydantic models, as an agent declares them with the
`openai` client's `pydantic_function_tool`, the prompts that ask for them, and the check that a
call names one of them with arguments its model accepts."""

from __future__ import annotations

import pydantic
from pydantic import BaseModel, Field


class Party(BaseModel):
    adults: int
    children: int


class BookTable(BaseModel):
    """Book a table at a restaurant."""

    restaurant: str
    time: str
    party: Party


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str
    unit: str


class Stop(BaseModel):
    name: str
    nights: int


class PlanTrip(BaseModel):
    """Plan a trip through several cities."""

    # Bounded: under an unbounded list SmolLM2 adds stops until max_tokens, valid JSON all along
    stops: list[Stop] = Field(max_length=4)
    budget_eur: float


MODELS: dict[str, type[BaseModel]] = {cls.__name__: cls for cls in (BookTable, GetWeather, PlanTrip)}
PROMPTS = [
    "Book a table at Chez Marie for 2 adults and 1 child at 19:30.",
    "What's the weather in Paris, in celsius?",
    "Plan a trip: 3 nights in Rome, then 2 in Florence, for 1500 euros.",
    "Is it raining in Oslo?",
    "Reserve dinner for four at Luigi's at 8 pm.",
]
NO_TOOL_PROMPT = "What is 2 + 2?"  # no tool fits: under auto, a text answer
# More of the same kinds, for bench.quality.tool_calls (written after the tests' five)
MORE_PROMPTS = [
    "How cold is it in Reykjavik right now, in fahrenheit?",
    "I need a table for 3 adults at Sushi Zen tomorrow at noon.",
    "Plan 2 nights in Berlin and 2 in Prague; I can spend 800 euros.",
]
# The nonsense schema every server should refuse: `frobnicate` is no JSON-schema type
NONSENSE_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}


def tools() -> list:
    """The three as the `openai` client sends them (strict function schemas)."""
    import openai

    return [openai.pydantic_function_tool(cls) for cls in MODELS.values()]


def call_problem(name: str, arguments: str, allowed: tuple[str, ...] = tuple(MODELS)) -> str | None:
    """Why a call is not a valid call of one of the `allowed` tools (None: it is): its name, then
    its arguments as JSON, then against the tool's model."""
    if name not in allowed:
        return "unknown tool" if name not in MODELS else "not the named tool"
    try:
        MODELS[name].model_validate_json(arguments)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        return "arguments not JSON" if first["type"] == "json_invalid" else "arguments off schema"
    return None
