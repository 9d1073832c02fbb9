"""`truncation: "auto"` leaves the oldest turns out by slicing the chat request validated
once; the slice must equal validating the shorter conversation from scratch."""

from __future__ import annotations

from segserve.server.http.openai_api import validate
from segserve.server.http.responses_api import ResponsesRequest, chat_body, translate_input


def test_sliced_chat_request_equals_a_fresh_one() -> None:
    items = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": "third"},
    ]
    body = validate(ResponsesRequest, {"input": items, "instructions": "be brief", "temperature": 0.5,
                                       "max_output_tokens": 7, "truncation": "auto"})
    conv, _ = translate_input(body.input)
    system = [{"role": "system", "content": body.instructions}]
    full = chat_body(body, [*system, *conv])
    for start in (2, 4):
        sliced = full.model_copy(update={"messages": [*full.messages[:1], *full.messages[1 + start:]]})
        fresh = chat_body(body, [*system, *conv[start:]])
        assert sliced.model_dump() == fresh.model_dump()
        assert sliced.template_variables() == fresh.template_variables()
