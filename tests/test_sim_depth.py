"""The built-in simulated model as the README promises it, through a real edge and node with
the openai SDK: tool arguments the edge's own schema validation takes (patterns, unique items,
minProperties, overlapping oneOf branches, if/then), bounded on hostile schemas, and stop
strings that span two tokens cut whole, as a model server cuts them."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest
import regex
import trio
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

from node.adapters import Counters
from node.adapters.sim import SimAdapter, sim_tokens
from node.adapters.sim_tools import sample
from node.config import ModelConfig
from proto import RunRequest, ToolCall
from tests.conftest import BOUND, http, model, sdk, settled, start_edge, start_node

ASK = [{"role": "user", "content": "book it"}]


@pytest.fixture
async def sim_edge(nursery):
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("iop-sim", ttft_ms=0, tokens_per_s=0, sim_tokens=64)])
    yield edge
    await settled(edge, node.agent)


def tool(properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": "book", "parameters": parameters}}


def valid(schema: dict, value) -> bool:
    """As the edge checks arguments: jsonschema, its patterns on `regex`."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)

    def pattern(validator, pattern, instance, schema):
        if isinstance(instance, str) and not regex.search(pattern, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")

    return jsonschema.validators.extend(cls, {"pattern": pattern})(schema).is_valid(value)


# Each answered 502 tool_validation_error before (outside audit, the real openai SDK).
ORDINARY = {
    "pattern": {"code": {"type": "string", "pattern": r"^[A-Z]{3}-\d{2}$"}},
    "pattern and length": {"host": {"type": "string", "pattern": r"^(foo|bar)+\.[a-z]{2,4}$", "minLength": 12}},
    "uniqueItems": {"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 3}},
    "unique enum items": {
        "a": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True, "minItems": 3}
    },
    "minProperties": {"o": {"type": "object", "minProperties": 1}},
    "patternProperties": {
        "o": {
            "type": "object",
            "patternProperties": {r"^k\d$": {"type": "integer"}},
            "additionalProperties": False,
            "minProperties": 2,
        }
    },
    "propertyNames": {"o": {"type": "object", "propertyNames": {"pattern": "^[A-Z]+$"}, "minProperties": 2}},
    "overlapping oneOf": {"x": {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]}},
    "oneOf integer or number": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
    "if/then": {"x": {"if": {"type": "string"}, "then": {"minLength": 4}, "type": "string"}},
    "if/else": {"x": {"type": "integer", "if": {"maximum": 0}, "then": {"const": 0}, "else": {"minimum": 5}}},
    "not": {"n": {"type": "integer", "not": {"const": 1}}},
    "contains": {"xs": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}},
    "a default of another type": {"n": {"type": "integer", "default": "five"}},
    "minContains": {"xs": {"type": "array", "contains": {"type": "string", "minLength": 3}, "minContains": 2}},
}


@pytest.mark.parametrize("properties", ORDINARY.values(), ids=ORDINARY.keys())
async def test_sim_tool_arguments_pass_the_edges_validation(sim_edge, properties):
    """tool_choice "required" on iop-sim: a call whose arguments the edge took (no 502
    tool_validation_error) and that satisfy the tool's schema, every time."""
    schema = tool(properties)
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            replies = [
                await client.chat.completions.create(
                    model="iop-sim", messages=ASK, tools=[schema], tool_choice="required"
                )
                for _ in range(3)
            ]
    arguments = [r.choices[0].message.tool_calls[0].function.arguments for r in replies]
    assert len(set(arguments)) == 1  # deterministic
    assert valid(schema["function"]["parameters"], json.loads(arguments[0])), arguments[0]
    assert replies[0].choices[0].finish_reason == "tool_calls"


async def test_optional_properties_are_filled_when_none_is_required(sim_edge):
    """instructor's list tool has one optional property (`"required": []`): the sim answered {},
    and the client's model had nothing to read (an outside audit). Now it fills what the object
    offers, within maxProperties, and the edge takes it."""
    item = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    parameters = {"type": "object", "properties": {"tasks": {"type": "array", "items": item}}, "required": []}
    limited = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "maxProperties": 1}
    two = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    # Where filling every property breaks the whole schema (a re-audit: 10 of 25 such got a 502), {}.
    constrained = [
        {"type": "object", "properties": {"card": {"type": "string"}}, "dependentRequired": {"card": ["billing"]}},
        {"type": "object", "properties": two, "not": {"required": ["a", "b"]}},
        {
            "type": "object",
            "properties": {"ok": {"type": "string"}, "Bad": {}},
            "propertyNames": {"pattern": "^[a-z]+$"},
        },
        {"type": "object", "properties": {"legacy": False, "x": {"type": "string"}}},
        {"type": "object", "properties": {"xs": {"type": "array", "contains": {"const": 7}}}},
        {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}}},
    ]
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            for schema in (parameters, limited, *constrained):
                r = await client.chat.completions.create(
                    model="iop-sim",
                    messages=ASK,
                    tools=[{"type": "function", "function": {"name": "book", "parameters": schema}}],
                    tool_choice="required",
                )
                arguments = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
                assert valid(schema, arguments), (schema, arguments)
                assert arguments or schema in constrained, schema
    assert list(sample(parameters)) == ["tasks"] and len(sample(limited)) == 1


class Booking(pydantic.BaseModel):
    code: Annotated[str, pydantic.Field(pattern=r"^[A-Z]{3}-\d{2}$")]
    seats: set[int]
    zip: Annotated[str, pydantic.Field(pattern=r"^\d{5}(-\d{4})?$")]


async def test_parse_with_a_pydantic_pattern_gets_a_value_that_matches(sim_edge):
    """`chat.completions.parse` with a pydantic `Field(pattern=...)` got {"code": "sim"}, and
    pydantic refused it; now the answer parses."""
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            reply = await client.chat.completions.parse(model="iop-sim", messages=ASK, response_format=Booking)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Booking)
    assert regex.fullmatch(r"[A-Z]{3}-\d{2}", parsed.code) and regex.fullmatch(r"\d{5}", parsed.zip)


# Hostile schemas the edge takes: a pattern asking for a million characters, a pattern of
# empty repeats, 5,000 items each trying catastrophic patterns in a oneOf, 5,000 unique
# booleans, 100,000 properties of which one pattern can name one.
HOSTILE = {
    "huge pattern": {"type": "string", "pattern": "^(a{1000}){1000}$"},
    "empty repeats": {"type": "string", "pattern": "^(?:){4000000000}x$"},
    "catastrophic oneOf": {
        "type": "array",
        "minItems": 5000,
        "items": {"oneOf": [{"type": "string", "pattern": "^a{30}b$"}, {"type": "string", "pattern": "^(a|aa)+$"}]},
    },
    "unique booleans": {"type": "array", "minItems": 5000, "uniqueItems": True, "items": {"type": "boolean"}},
    "properties": {
        "type": "object",
        "minProperties": 100000,
        "additionalProperties": False,
        "patternProperties": {"^x$": {}},
    },
}


async def test_hostile_schemas_are_answered_within_a_bound(sim_edge):
    """Each hostile schema is made in bounded time and size (a quarter second of checks, 64 KiB
    of text: measured 0.3 s at most here) and answered through the edge (a call or the edge's
    502; the patterns the edge itself refuses, 400), and the node then serves an ordinary
    patterned call."""
    for name, schema in HOSTILE.items():
        started = time.monotonic()
        value = sample(schema)
        assert time.monotonic() - started < 5, name
        assert len(json.dumps(value)) < 200_000, name
    statuses = {}
    with trio.fail_after(BOUND):
        async with http(sim_edge) as client:
            for name, schema in HOSTILE.items():
                body = {"model": "iop-sim", "messages": ASK, "tools": [tool({"v": schema})], "tool_choice": "required"}
                statuses[name] = (await client.post("/v1/chat/completions", json=body)).status_code
        async with sdk(sim_edge) as client:
            after = await client.chat.completions.create(
                model="iop-sim", messages=ASK, tools=[tool(ORDINARY["pattern"])], tool_choice="required"
            )
    # (The edge refuses a pattern whose counted repeats expand past its bound before any node works.)
    assert statuses.pop("huge pattern") == 400
    assert set(statuses.values()) <= {200, 502}, statuses
    assert json.loads(after.choices[0].message.tool_calls[0].function.arguments)["code"] == "AAA-00"


# The sim's answer to "hi" begins: "about streams caches cancellation the node produces across about ..."
SPANNING = ["about str", "s cach", "across about"]


@pytest.mark.parametrize("stop", SPANNING)
async def test_a_stop_string_across_two_tokens_is_not_returned_in_part(sim_edge, stop):
    """A stop string that starts in one token and ends in the next: the text before it, none of
    the stop string (the first token's part was sent before the next token showed the match),
    whole and streamed."""
    full = "".join(sim_tokens("hi", 64))
    assert stop in full and not any(stop in " " + word for word in full.split(" "))  # spans two tokens
    expected = full[: full.find(stop)]
    messages = [{"role": "user", "content": "hi"}]
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            whole = await client.chat.completions.create(model="iop-sim", messages=messages, stop=[stop])
            stream = await client.chat.completions.create(model="iop-sim", messages=messages, stop=[stop], stream=True)
            chunks = [c async for c in stream if c.choices]
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_text_held_for_a_stop_string_that_does_not_come_is_sent(sim_edge):
    """The answer's last word starts a stop string that never completes: it is held, then sent
    at the end; the whole answer comes back."""
    full = "".join(sim_tokens("hi", 64))
    stop = full.rsplit(" ", 1)[1] + " and more"
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            whole = await client.chat.completions.create(
                model="iop-sim", messages=[{"role": "user", "content": "hi"}], stop=[stop]
            )
    assert whole.choices[0].message.content == full


async def test_a_stop_string_of_megabytes_costs_the_node_what_the_answer_reads():
    """A stop string of 8 MB (the body's limit allows it) costs the node memory as far as the
    answer matched it, not 36 bytes a character: its whole table took the node's loop 0.8 s and
    300 MB a run (22 such requests held another client's stream 10 s; eight took 2.2 GB)."""
    full = "".join(sim_tokens("hi", 8))
    adapter = SimAdapter(ModelConfig(name="m", adapter="sim", ttft_ms=0, tokens_per_s=0, sim_tokens=8), Counters())
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": [full + "x" * (8 << 20), "y" * (8 << 20)]}
    sink = TimedSink()
    tracemalloc.start()
    try:
        with trio.fail_after(BOUND):
            await adapter.run(RunRequest(run_id="r", model="m", target="m", request=body, timeout_s=60), sink)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "".join(text for _, text in sink.deltas) == full  # held to the end (it could still come), then sent
    assert peak < 1 << 20


class TimedSink:
    """Each delta with the time it came."""

    def __init__(self) -> None:
        self.deltas: list[tuple[float, str]] = []

    async def delta(self, text: str) -> None:
        self.deltas.append((trio.current_time(), text))

    async def reasoning(self, text: str) -> None:
        pass

    async def complete(self, finish_reason: str, tool_calls: list[ToolCall] | None = None, usage=None, stop="") -> None:
        pass

    async def error(self, message: str, status: int = 0) -> None:
        raise AssertionError(message)


async def test_nothing_is_held_without_a_stop_string_that_could_start(autojump_clock):
    """Without stop strings each token goes out at its own time (10 a second), and with stop
    strings none of whose starts the text ends with, too: holding back costs no latency."""
    adapter = SimAdapter(ModelConfig(name="m", adapter="sim", ttft_ms=0, tokens_per_s=10, sim_tokens=8), Counters())
    tokens = list(sim_tokens("hi", 8))
    for stop in (None, ["zzz", "qq"]):
        body = {"messages": [{"role": "user", "content": "hi"}], **({"stop": stop} if stop else {})}
        sink = TimedSink()
        start = trio.current_time()
        await adapter.run(RunRequest(run_id="r", model="m", target="m", request=body, timeout_s=60), sink)
        assert [text for _, text in sink.deltas] == tokens
        assert [round(at - start, 6) for at, _ in sink.deltas] == [i / 10 for i in range(8)]


async def test_a_pydantic_ai_agent_with_structured_output_ends_against_the_sim(sim_edge):
    """pydantic-ai with an output type sends `tool_choice: "required"` with its tools and its
    `final_result` tool: the sim calls the tool the prompt names, then, after its result, the final
    tool, and the run ends with the structured output (the sim called get_weather until
    pydantic-ai's request limit, then called every tool nobody asked for before the final one).
    pydantic-ai needs asyncio: it runs in a worker thread."""

    class Forecast(pydantic.BaseModel):
        city: str
        summary: str

    calls: list[str] = []

    async def run():
        client = openai.AsyncOpenAI(base_url=sim_edge.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND)
        model = OpenAIChatModel("iop-sim", provider=OpenAIProvider(openai_client=client))
        agent = Agent(model, output_type=Forecast)

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Current weather for a city."""
            calls.append(city)
            return "sunny"

        @agent.tool_plain
        def send_email(to: str, body: str) -> str:
            """Send an email (never asked for here)."""
            calls.append("send_email")
            return "sent"

        async with client:
            result = await agent.run("Use get_weather for Paris.", usage_limits=UsageLimits(request_limit=5))
        return result.output, result.usage.requests

    with trio.fail_after(BOUND):
        output, requests = await trio.to_thread.run_sync(asyncio.run, run(), abandon_on_cancel=True)
    assert isinstance(output, Forecast) and len(calls) == 1 and requests == 2


async def test_a_smolagents_style_loop_ends_against_the_sim(sim_edge):
    """smolagents' ToolCallingAgent sends its earlier calls as the assistant's text and their
    results as user messages: under `tool_choice: "required"` the sim's next call is the
    final-answer tool (it called get_weather again until the agent's step limit), as after tool
    results and a framework's "Continue."; a new user message that names a tool gets that tool,
    and an answer that merely mentions a tool is no loop under way."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in ("get_weather", "final_answer", "web_search")
    ]
    task = {"role": "user", "content": "New task: use get_weather for Paris."}
    history = [
        {"role": "system", "content": "You are an expert assistant who can solve any task using tool calls."},
        task,
        {
            "role": "assistant",
            "content": "Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': "
            "{'name': 'get_weather', 'arguments': {'city': 'Paris'}}}]",
        },
        {"role": "user", "content": "Observation:\nsunny"},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    native = [task, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]

    def recorded(said: str) -> list[dict]:
        """The task, an assistant's answer saying ``said``, and an observation after it."""
        return [task, {"role": "assistant", "content": said}, {"role": "user", "content": "Observation: sunny"}]

    cases = [
        ([history[0], task], "get_weather"),  # the task names get_weather
        (history, "final_answer"),  # the agent's loop under way, as text: its final answer
        ([*history, {"role": "assistant", "content": "ok"}, task], "get_weather"),  # a new task naming the tool
        ([*native, {"role": "user", "content": "Continue."}], "final_answer"),  # results, then a framework's nudge
        # An answer that merely says a tool's name (or "researched" for web_search) is no loop under way.
        (
            [
                task,
                {"role": "assistant", "content": "get_weather says sunny; I researched it."},
                {"role": "user", "content": "Rome?"},
            ],
            "get_weather",
        ),
        # A call recorded as code on a module (as Gemini-style agents write it) is a loop under way.
        (recorded("default_api.get_weather(city='Paris')"), "final_answer"),
        # A URL that ends in a tool's name records no call of it, quoted or before "(" (it gave
        # the final answer), nor one without its scheme.
        (recorded("See 'https://example.com/web_search' or https://x.org/web_search (docs)."), "get_weather"),
        (recorded("See www.example.com/web_search (docs) or 'example.com/web_search'."), "get_weather"),
        # A name quoted with its namespace is a call recorded (the sim called the tool again), and
        # so is a call of a method on the tool (as LangChain tools are called).
        (recorded("Calling tools:\n[{'name': 'functions.get_weather', 'arguments': {}}]"), "final_answer"),
        (recorded("get_weather.invoke({'city': 'Paris'})"), "final_answer"),
    ]
    names = []
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            for messages, _ in cases:
                reply = await client.chat.completions.create(
                    model="iop-sim", messages=messages, tools=tools, tool_choice="required"
                )
                names.append(reply.choices[0].message.tool_calls[0].function.name)
    assert names == [expected for _, expected in cases]


@pytest.mark.parametrize(
    ("tool", "record"),
    [
        ("get_weather", "tools/get_weather(city='Paris')"),
        ("get_weather", "Action:get_weather(city='Paris')"),
        ("get_weather", "server:get_weather(city='Paris')"),
        ("weather.get", "default_api.weather.get(city='Paris')"),  # a dotted name after a prefix
    ],
)
async def test_a_call_recorded_after_a_prefix_ends_the_loop(sim_edge, tool, record):
    """A call the assistant's text records after a prefix joined by '/', ':' or '.' is a loop
    under way: the sim's next call is the final answer (it called the tool again), and a user
    message naming tools joined by '/' names each ("use get_weather/web_search": no call at all)."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
        for n in (tool, "web_search", "final_answer")
    ]
    loop = [
        {"role": "user", "content": f"Use {tool} for Paris."},
        {"role": "assistant", "content": record},
        {"role": "user", "content": "Observation: sunny"},
    ]
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            reply = await client.chat.completions.create(
                model="iop-sim", messages=loop, tools=tools, tool_choice="required"
            )
            named = await client.chat.completions.create(
                model="iop-sim", messages=[{"role": "user", "content": f"use {tool}/web_search"}], tools=tools
            )
    assert reply.choices[0].message.tool_calls[0].function.name == "final_answer"
    assert named.choices[0].message.tool_calls[0].function.name == tool


@pytest.mark.parametrize(
    ("names", "text", "asked"),
    [
        # 256 tools, 8 MB of conversation: the text was lowered and read once per tool, twice
        # (about 35 s of a frozen node); one pass for every name now
        ([f"tool_{i}" for i in range(256)], "word " * 790_000, "tool_200"),
        # 255 names of 61 dashes and a number, and "a" (all valid names), against 2 MB of dashes:
        # one alternation of every name tried each name at each character (12.5 s a MB; the node
        # lost its link past 15 s). Words now, over a message's first and last 16 KiB
        (["-" * 61 + f"{i:03d}" for i in range(255)] + ["a"], "-" * (2 << 20), "a"),
        # names of 1 to 256 dashes against 40 K of dashes: as a trie, 4.5 s a message (a call
        # recorded in the assistant's text was looked for, and backtracked, at every dash). The
        # sim reads words now, and looks each up once
        (["-" * i for i in range(1, 257)], "-" * 40_000, "-" * 256),
    ],
    ids=["256-tools-8MB", "shared-prefixes", "nested-prefixes"],
)
async def test_many_tools_and_a_long_conversation_cost_the_node_little(sim_edge, names, text, asked):
    """Under `tool_choice: "required"`, the sim calls the tool the user names at the end of a
    long message, and the node serves the next request (it froze for the cases above)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": text},
        {"role": "user", "content": f"{text} use {asked}"},
    ]
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            reply = await client.chat.completions.create(
                model="iop-sim", messages=messages, tools=tools, tool_choice="required"
            )
            assert reply.choices[0].message.tool_calls[0].function.name == asked
            other = await client.chat.completions.create(model="iop-sim", messages=[{"role": "user", "content": "hi"}])
    assert other.choices[0].message.content
