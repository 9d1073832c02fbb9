"""Real client libraries against the server, over real HTTP on loopback, on their first try.

Each client is used the way its documentation shows (a base URL and a dummy key, nothing
else) and each test checks shapes, never wording: a tool was called with arguments that
validate against the tool's schema, a structured object validated, a final answer exists.

- Tiny random-weight model with a Hermes tool template (`tests/data/hermes_tools.jinja`):
  random weights only call a tool when the call is forced, so the first step forces it
  (`tool_choice`), and a structured final answer (`Weather`, bounded enums and integers)
  makes constrained decoding end the run. Clients: the OpenAI SDK (tool round trip from
  `message` and from `model_dump(exclude_none=True)`), the OpenAI Agents SDK (Responses and
  chat completions models, `Runner.run` and `Runner.run_streamed`), LangChain's `ChatOpenAI`
  (`bind_tools`, `with_structured_output`, `use_responses_api=True`), LiteLLM, instructor,
  pydantic-ai.
- Real embedded model (`model` marker), same template with `--tool-parser hermes`: the same
  clients with free-text final answers, which the real model ends on its own.

No client reaches the network: `tests.clients_support.offline_client_env` turns off every
phone-home (tracing, telemetry, remote price maps) for the whole module, and client
libraries are imported inside the tests, after it is set. Clients not installed are skipped
(`pip install -e '.[clients]'`; instructor is its own extra: see docs/clients.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from pydantic import Field

from segserve.server.runner import ChatTokenizer
from tests.clients_support import (
    ASK,
    WEATHER_TOOL,
    Weather,
    check_weather_args,
    forecast,
    offline_client_env,
)
from tests.fidelity_support import HERMES_TEMPLATE, hermes_server, sdk
from tests.process_support import ServerProcess

City = Literal["Paris", "London", "Tokyo"]
TOOLS: list[Any] = [WEATHER_TOOL]  # the SDK's typed params want TypedDicts: typed as Any here
Days = Annotated[int, Field(ge=1, le=7)]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


needs_agents = pytest.mark.skipif(not _installed("agents"), reason="openai-agents not installed")
needs_langchain = pytest.mark.skipif(not _installed("langchain_openai"),
                                     reason="langchain-openai not installed")
needs_litellm = pytest.mark.skipif(not _installed("litellm"), reason="litellm not installed")
# litellm's own TypedDicts warn under pydantic when its stream builder validates them (not ours)
litellm_warning = pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier")
needs_instructor = pytest.mark.skipif(not _installed("instructor"),
                                      reason="instructor not installed (extra clients-instructor)")
needs_pydantic_ai = pytest.mark.skipif(not _installed("pydantic_ai"),
                                       reason="pydantic-ai-slim not installed")


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[None]:
    with offline_client_env():
        yield


@pytest.fixture(scope="module")
def base_url(gguf_tokenizer: ChatTokenizer) -> Iterator[str]:
    with hermes_server(gguf_tokenizer) as (url, _):
        yield url + "/v1"


def _async_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=base, api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(trust_env=False, timeout=300),  # type: ignore[arg-type]
    )


# ---- OpenAI SDK ------------------------------------------------------------------------


def _sdk_round_trip(client: openai.OpenAI, send_back: str, max_tokens: int) -> str | None:
    msgs: list[Any] = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(
        model="default", messages=msgs, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = check_weather_args(call.function.arguments)
    back: Any = (choice.message if send_back == "message"
                 else choice.message.model_dump(exclude_none=True))
    msgs += [back, {"role": "tool", "tool_call_id": call.id, "content": forecast(args.city, args.days)}]
    final = client.chat.completions.create(
        model="default", messages=msgs, tools=TOOLS, temperature=0, max_tokens=max_tokens,
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    return final.choices[0].message.content


@pytest.mark.parametrize("send_back", ["message", "model_dump_exclude_none"])
def test_openai_sdk_tool_round_trip(base_url: str, send_back: str) -> None:
    answer = _sdk_round_trip(sdk(base_url.removesuffix("/v1")), send_back, max_tokens=8)
    assert isinstance(answer, str) and answer


def test_forced_call_with_a_response_format(base_url: str) -> None:
    """An agent's first step sends its output format and a forced call together (the Agents
    SDK's output_type with tool_choice "required"): the reply is the call, in both APIs."""
    client = sdk(base_url.removesuffix("/v1"))
    fmt: Any = {"type": "json_schema",
                "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], tools=TOOLS,
        tool_choice="required", response_format=fmt, max_tokens=60, seed=1,
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    for call in r.choices[0].message.tool_calls or []:
        check_weather_args(call.function.arguments)  # type: ignore[union-attr]
    resp_tools: list[Any] = [{"type": "function", "name": "get_weather",
                              "parameters": WEATHER_TOOL["function"]["parameters"]}]
    resp = client.responses.create(
        model="default", input=ASK, tools=resp_tools,
        tool_choice="required", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather",
                         "schema": Weather.model_json_schema()}},
    )
    kinds = {item.type for item in resp.output}
    assert kinds == {"function_call"}, resp.output
    # without a forced call the format still shapes the answer
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], tools=TOOLS,
        response_format=fmt, max_tokens=60, seed=1,
    )
    Weather.model_validate_json(r.choices[0].message.content or "")


# ---- OpenAI Agents SDK -----------------------------------------------------------------


def _run_agent(base: str, responses: bool, streamed: bool, structured: bool) -> tuple[Any, list[Weather], set[str]]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.models.interface import Model

    set_tracing_disabled(True)
    calls: list[Weather] = []

    @function_tool
    def get_weather(city: City, days: Days) -> str:
        """Weather forecast for a city."""
        calls.append(check_weather_args({"city": city, "days": days}))
        return forecast(city, days)

    client = _async_client(base)
    model: Model = (OpenAIResponsesModel(model="default", openai_client=client) if responses
                    else OpenAIChatCompletionsModel(model="default", openai_client=client))
    # tool_choice "required" applies to the first step only (reset_tool_choice defaults on).
    settings = ModelSettings(tool_choice="required", max_tokens=96, parallel_tool_calls=False)
    agent: Agent[Any] = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                              model=model, model_settings=settings,
                              output_type=Weather if structured else str)

    async def go() -> tuple[Any, set[str]]:
        if streamed:
            run = Runner.run_streamed(agent, ASK, max_turns=4)
            items: set[str] = {e.item.type async for e in run.stream_events()
                               if e.type == "run_item_stream_event"}
            return run.final_output, items
        result = await Runner.run(agent, ASK, max_turns=4)
        return result.final_output, {str(item.type) for item in result.new_items}

    out, items = asyncio.run(go())
    return out, calls, items


@needs_agents
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("responses", [True, False], ids=["responses_model", "chat_model"])
def test_openai_agents_function_tool(base_url: str, responses: bool, streamed: bool) -> None:
    out, calls, items = _run_agent(base_url, responses, streamed, structured=True)
    assert calls, "the function tool was not called"
    assert {"tool_call_item", "tool_call_output_item"} <= items
    assert isinstance(out, Weather)


# ---- LangChain -------------------------------------------------------------------------


def _chat_openai(base: str, *, responses: bool = False) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="default", base_url=base, api_key="unused", max_retries=0, temperature=0,  # type: ignore[arg-type]
        max_tokens=60, use_responses_api=responses,  # type: ignore[call-arg]
        http_client=httpx.Client(trust_env=False, timeout=300),
        http_async_client=httpx.AsyncClient(trust_env=False, timeout=300),
    )


def _langchain_round_trip(llm: Any, answer_tokens: int) -> tuple[list[Weather], Any]:
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool(args_schema=Weather)
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        return forecast(city, days)

    msgs: list[BaseMessage] = [HumanMessage(ASK)]
    ai = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke(msgs)
    assert ai.tool_calls and all(c["name"] == "get_weather" for c in ai.tool_calls)
    args = [check_weather_args(c["args"]) for c in ai.tool_calls]
    msgs.append(ai)
    for c in ai.tool_calls:
        msgs.append(ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]))
    final = llm.bind_tools([get_weather]).bind(max_tokens=answer_tokens).invoke(msgs)
    return args, final


@needs_langchain
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "use_responses_api"])
def test_langchain_bind_tools_round_trip(base_url: str, responses: bool) -> None:
    _, final = _langchain_round_trip(_chat_openai(base_url, responses=responses), 8)
    assert final.text and not final.tool_calls


@needs_langchain
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "use_responses_api"])
def test_langchain_with_structured_output(base_url: str, responses: bool, method: str) -> None:
    llm = _chat_openai(base_url, responses=responses).with_structured_output(Weather, method=method)
    assert isinstance(llm.invoke(ASK), Weather)


# ---- LiteLLM ---------------------------------------------------------------------------


def _litellm_round_trip(base: str, stream: bool, max_tokens: int) -> tuple[Weather, Any]:
    import litellm

    litellm.suppress_debug_info = True  # its provider banner goes to stdout otherwise
    kw: dict[str, Any] = {"model": "openai/default", "api_base": base, "api_key": "unused",
                          "tools": [WEATHER_TOOL], "temperature": 0}
    msgs: list[Any] = [{"role": "user", "content": ASK}]
    first = litellm.completion(messages=msgs, tool_choice="required", parallel_tool_calls=False,
                               max_tokens=60, stream=stream, **kw)
    if stream:
        first = litellm.stream_chunk_builder(list(first), messages=msgs)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = check_weather_args(call.function.arguments)
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": forecast(args.city, args.days)}]
    final = litellm.completion(messages=msgs, max_tokens=max_tokens, **kw)
    return args, final.choices[0]


@needs_litellm
@litellm_warning
@pytest.mark.parametrize("stream", [False, True], ids=["completion", "stream"])
def test_litellm_tools(base_url: str, stream: bool) -> None:
    _, final = _litellm_round_trip(base_url, stream, max_tokens=8)
    assert final.finish_reason in ("stop", "length") and final.message.content


# ---- instructor ------------------------------------------------------------------------


@needs_instructor
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(base_url: str, mode: str) -> None:
    import instructor

    client = instructor.from_openai(sdk(base_url.removesuffix("/v1")), mode=instructor.Mode[mode])
    got = client.chat.completions.create(
        model="default", response_model=Weather, max_retries=0, max_tokens=60,
        messages=[{"role": "user", "content": ASK}],
    )
    assert isinstance(got, Weather)


# ---- pydantic-ai -----------------------------------------------------------------------


def _pydantic_ai_run(base: str, structured: bool) -> tuple[Any, list[Weather]]:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    calls: list[Weather] = []
    model = OpenAIChatModel("default", provider=OpenAIProvider(openai_client=_async_client(base)))

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # the first step must call the tool; after it the agent answers (or calls again)
        first: ModelSettings = {"tool_choice": ["get_weather"]} if ctx.run_step <= 1 else {}
        return {"max_tokens": 96, "temperature": 0.0, "parallel_tool_calls": False, **first}

    agent: Agent[None, Any] = Agent(model, output_type=Weather if structured else str,
                                    model_settings=settings)

    @agent.tool_plain
    def get_weather(city: City, days: Days) -> str:
        """Weather forecast for a city."""
        calls.append(check_weather_args({"city": city, "days": days}))
        return forecast(city, days)

    return agent.run_sync(ASK).output, calls


@needs_pydantic_ai
def test_pydantic_ai_agent_with_a_tool(base_url: str) -> None:
    out, calls = _pydantic_ai_run(base_url, structured=True)
    assert calls and isinstance(out, Weather)


# ---- the real embedded model -----------------------------------------------------------


@pytest.fixture(scope="module")
def real_base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("clients-real") / "server.log"
    srv = ServerProcess(log, "--bank-dir", "none", "--max-tokens-default", "96",
                        "--chat-template", str(HERMES_TEMPLATE), "--tool-parser", "hermes")
    try:
        srv.wait_healthy(180)
        yield srv.url + "/v1"
    finally:
        srv.stop()


def _answer(text: Any) -> None:
    assert isinstance(text, str) and text.strip(), text


@pytest.mark.model
def test_real_openai_sdk_round_trip(real_base: str) -> None:
    client = openai.OpenAI(base_url=real_base, api_key="unused", max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=300))  # type: ignore[arg-type]
    _answer(_sdk_round_trip(client, "model_dump_exclude_none", max_tokens=96))


@pytest.mark.model
@needs_agents
@pytest.mark.parametrize("responses", [True, False], ids=["responses_model", "chat_model"])
def test_real_openai_agents(real_base: str, responses: bool) -> None:
    out, calls, items = _run_agent(real_base, responses, streamed=responses, structured=False)
    assert calls and {"tool_call_item", "tool_call_output_item", "message_output_item"} <= items
    _answer(out)


@pytest.mark.model
@needs_langchain
def test_real_langchain(real_base: str) -> None:
    _, final = _langchain_round_trip(_chat_openai(real_base), 96)
    _answer(final.text)
    structured = _chat_openai(real_base, responses=True).with_structured_output(Weather)
    assert isinstance(structured.invoke(ASK), Weather)


@pytest.mark.model
@needs_litellm
@litellm_warning
def test_real_litellm(real_base: str) -> None:
    _, final = _litellm_round_trip(real_base, stream=True, max_tokens=96)
    _answer(final.message.content)


@pytest.mark.model
@needs_instructor
def test_real_instructor(real_base: str) -> None:
    import instructor

    client = instructor.from_openai(openai.OpenAI(
        base_url=real_base, api_key="unused", max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=300),  # type: ignore[arg-type]
    ))
    got = client.chat.completions.create(model="default", response_model=Weather, max_tokens=60,
                                         messages=[{"role": "user", "content": ASK}])
    assert isinstance(got, Weather)


@pytest.mark.model
@needs_pydantic_ai
def test_real_pydantic_ai(real_base: str) -> None:
    out, calls = _pydantic_ai_run(real_base, structured=False)
    assert calls
    _answer(out)


def test_open_tool_schemas_get_only_their_keys(base_url: str) -> None:
    """LangChain's and pydantic's default tool schemas leave objects open (no
    additionalProperties): forced calls write only the listed keys, nested objects too."""
    params = {"type": "object", "required": ["where", "days"], "properties": {
        "where": {"type": "object", "required": ["city"],
                  "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}}},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    tools: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    client = sdk(base_url.removesuffix("/v1"))
    for seed in range(6):
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": ASK}], tools=tools,
            tool_choice="required", parallel_tool_calls=False, seed=seed, max_tokens=80,
        )
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)  # type: ignore[index, union-attr]
        assert set(args) == {"where", "days"} and set(args["where"]) == {"city"}, args


def test_closing_objects_keeps_what_the_schema_says() -> None:
    from segserve.server.chat.grammar import _close_objects

    leaf = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = {**leaf, "additionalProperties": False}
    assert _close_objects(leaf) == closed
    assert _close_objects({"type": "array", "items": leaf}) == {"type": "array", "items": closed}
    assert _close_objects({"anyOf": [leaf, {"type": "null"}]}) == {"anyOf": [closed, {"type": "null"}]}
    assert _close_objects({"$defs": {"L": leaf}, "$ref": "#/$defs/L"}) == {
        "$defs": {"L": closed}, "$ref": "#/$defs/L"}
    for kept in ({**leaf, "additionalProperties": True},
                 {**leaf, "additionalProperties": {"type": "string"}},
                 {**leaf, "patternProperties": {"^x": {}}},
                 {**leaf, "required": ["a", "b"]},  # requires a key it does not list
                 {"allOf": [leaf, {"properties": {"b": {}}}]},
                 {"type": "object"}):
        assert _close_objects(kept) == kept, kept


def test_tool_arguments_are_checked() -> None:
    """The shape check itself refuses what the tool's schema refuses."""
    assert check_weather_args('{"city": "Paris", "days": 2}') == Weather(city="Paris", days=2)
    for bad in ('{"city": "Rome", "days": 2}', '{"city": "Paris", "days": 9}',
                '{"city": "Paris", "days": 2, "x": 1}', json.dumps({"city": "Paris"})):
        with pytest.raises(ValueError):
            check_weather_args(bad)
