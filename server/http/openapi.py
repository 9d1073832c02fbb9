"""The OpenAPI document served at `/openapi.json`.

Owns: `openapi_document(routes)`. Request bodies are generated from the pydantic models the
handlers validate with (`segserve.server.http.schemas`, `segserve.server.http.sessions_api.ForkBody`), so the document
cannot drift from what the server accepts: a body's properties are the model's fields (by
their wire names), required fields included, plus the fields the model accepts only with a
value that changes nothing and drops before validation (`accepted_no_ops`: `store: false`,
`echo: false`, `modalities: ["text"]`, ...), listed with exactly those values and described
as ignored; `null`, also dropped for every optional field of a `NullIsUnset` body, is
allowed next to each such property (tests check all of this against the models' validators). Responses are
described in words (their JSON is built by hand in `segserve.server.http.openai_api`), with OpenAI's error
shape for every non-2xx answer (Anthropic's under `/v1/messages`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

# The private tables themselves, not copies: they decide what the validators let through.
from segserve.server.http.schemas import _UNSUPPORTED_UNLESS as _COMMON_NO_OPS
from segserve.server.http.schemas import ChatCompletionRequest, CompletionRequest, NullIsUnset

_SUMMARIES: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): "Chat completion (streaming as server-sent events when stream=true; a reasoning model's thinking in reasoning_content)",
    ("POST", "/v1/completions"): "Text completion (a prompt string or token ids)",
    ("GET", "/v1/models"): "The served model",
    ("GET", "/v1/models/{model_id}"): "One model by id (404 model_not_found for others)",
    ("GET", "/v1/sessions"): "Sessions in the bank, most recently used first",
    ("GET", "/v1/sessions/{sid}"): "A session's turns, tokens, segments, bytes and tier",
    ("DELETE", "/v1/sessions/{sid}"): "Forget a session",
    ("POST", "/v1/sessions/{sid}/fork"): "A new session sharing every segment up to a turn",
    ("POST", "/v1/responses"): "Responses API on the bank (previous_response_id continues a stored response)",
    ("GET", "/v1/responses/{rid}"): "A stored response",
    ("DELETE", "/v1/responses/{rid}"): "Forget a stored response",
    ("GET", "/v1/responses/{rid}/input_items"): "The input items sent with a stored response",
    ("POST", "/v1/messages"): "Anthropic Messages API on the same sessions (SSE events when stream=true; "
    "errors in Anthropic's shape)",
    ("POST", "/v1/messages/count_tokens"): "Prompt tokens a Messages request would run (Anthropic's shape)",
    ("POST", "/tokenize"): "Token ids of a prompt or of chat messages (vLLM's shape)",
    ("POST", "/detokenize"): "Text of token ids (vLLM's shape)",
    ("GET", "/health"): "Liveness, readiness and (with the key) engine, model, kv, bank, admission",
    ("GET", "/metrics"): "Prometheus text format",
    ("GET", "/openapi.json"): "This document",
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# Under /v1/messages (segserve.server.http.anthropic_api.error_body).
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def request_bodies() -> dict[tuple[str, str], type[BaseModel]]:
    """(method, path) → the pydantic model its JSON body is validated with."""
    from segserve.server.http.anthropic_schemas import CountTokensRequest, MessagesRequest
    from segserve.server.http.responses_api import ResponsesRequest
    from segserve.server.http.sessions_api import ForkBody
    from segserve.server.http.tokenize_api import DetokenizeRequest, TokenizeRequest

    return {
        ("POST", "/v1/chat/completions"): ChatCompletionRequest,
        ("POST", "/v1/completions"): CompletionRequest,
        ("POST", "/v1/sessions/{sid}/fork"): ForkBody,
        ("POST", "/v1/responses"): ResponsesRequest,
        ("POST", "/v1/messages"): MessagesRequest,
        ("POST", "/v1/messages/count_tokens"): CountTokensRequest,
        ("POST", "/tokenize"): TokenizeRequest,
        ("POST", "/detokenize"): DetokenizeRequest,
    }


def accepted_no_ops() -> dict[type[BaseModel], Mapping[str, tuple[Any, ...]]]:
    """Model → {field: the values it is accepted with}: fields outside the model that its
    `mode="before"` validator drops when they carry a value meaning "off", and refuses
    (`unsupported_parameter`) otherwise."""
    from segserve.server.http.anthropic_schemas import _UNSUPPORTED_UNLESS as messages_no_ops
    from segserve.server.http.anthropic_schemas import CountTokensRequest, MessagesRequest
    from segserve.server.http.responses_api import _UNSUPPORTED_UNLESS as responses_no_ops
    from segserve.server.http.responses_api import ResponsesRequest

    return {
        ChatCompletionRequest: _COMMON_NO_OPS,
        CompletionRequest: _COMMON_NO_OPS,
        ResponsesRequest: responses_no_ops,
        MessagesRequest: messages_no_ops,
        CountTokensRequest: messages_no_ops,
    }


def _no_op_property(values: tuple[Any, ...]) -> dict[str, Any]:
    shown = " or ".join(json.dumps(v) for v in values)
    return {
        "enum": list(values),
        "description": f"Accepted and ignored: only {shown}, which change nothing. Any other "
        "value is refused (400, code unsupported_parameter): it is not implemented.",
    }


def _document_dropped_fields(schemas: dict[str, Any], name: str, model: type[BaseModel]) -> None:
    """Add to a body schema what its validator accepts and drops before the fields are read."""
    props = schemas[name]["properties"]
    no_ops = accepted_no_ops().get(model, {})
    for field, values in no_ops.items():
        props[field] = _no_op_property(values)
    if issubclass(model, NullIsUnset):
        # `null` is dropped before validation (SDKs send it): the field's default applies.
        required = set(schemas[name].get("required", []))
        for field, prop in list(props.items()):
            if field not in required and field not in no_ops and not _admits_null(prop):
                props[field] = {"anyOf": [prop, {"type": "null"}], "default": prop.get("default")}


def _admits_null(prop: Mapping[str, Any]) -> bool:
    t = prop.get("type")
    return t == "null" or (isinstance(t, list) and "null" in t) or any(
        isinstance(p, Mapping) and p.get("type") == "null" for p in prop.get("anyOf", [])
    )


def _openapi_path(path: str) -> str:
    return re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", path)


def openapi_document(routes: list[Route], *, version: str) -> dict[str, Any]:
    bodies = request_bodies()
    models = sorted({m for m in bodies.values()}, key=lambda m: m.__name__)
    keys, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}", by_alias=True
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    for m in models:
        _document_dropped_fields(schemas, keys[(m, "validation")]["$ref"].rsplit("/", 1)[1], m)
    schemas["Error"] = _ERROR
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    paths: dict[str, Any] = {}
    for route in routes:
        path = _openapi_path(route.path)
        anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
        error = ("Error (Anthropic's shape)", "AnthropicError") if anthropic else ("Error (OpenAI's shape)", "Error")
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op: dict[str, Any] = {
                "operationId": f"{method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}",
                "summary": _SUMMARIES.get((method, path), ""),
                "responses": {
                    "200": {"description": "OK"},
                    "default": {
                        "description": error[0],
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error[1]}"}}},
                    },
                },
            }
            params = re.findall(r"\{(\w+)\}", path)
            if params:
                op["parameters"] = [
                    {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
                ]
            model = bodies.get((method, path))
            if model is not None:
                ref = keys[(model, "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "segserve",
            "version": version,
            "description": "OpenAI-compatible chat server on MLX with segmented KV memory.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }
