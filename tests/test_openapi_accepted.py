"""`/openapi.json` lists everything a request body may carry, checked against the validators.

Three things a client reading the document could be misled by: a field of a request model
(or of a model nested in it) that the document leaves out; a field the model accepts only
with a no-op value and drops before validation (`store: false`, `echo: false`, ...), which
is no model field at all; and a property whose document says null is (not) allowed where
the validator says otherwise (`n: null` is dropped, so accepted). The document is the one
the real route serves; what "accepted" means is asked of the models' own `model_validate`,
which is what the HTTP layer calls.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from segserve.server.http import app as server_app
from segserve.server.http.openapi import accepted_no_ops, request_bodies

# The smallest valid body of each request model, to which one field at a time is added.
MINIMAL: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "TokenizeRequest": {"prompt": "hi"},
    "DetokenizeRequest": {"tokens": [1]},
    "CompletionRequest": {"prompt": "hi"},
    "ResponsesRequest": {"input": "hi"},
    "MessagesRequest": {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    "CountTokensRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "ForkBody": {},
}
# A value that no field's no-op list holds, of a type some of them take.
NOT_A_NO_OP = "surely-not-off"


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    """components.schemas of the document GET /openapi.json answers with (the app's handler
    on its own: it needs the route table, not a model)."""
    app = Starlette(routes=[Route("/openapi.json", server_app.openapi, methods=["GET"])])
    with TestClient(app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    found: dict[str, Any] = r.json()["components"]["schemas"]
    return found


def _models_in(tp: Any) -> Iterator[type[BaseModel]]:
    """Pydantic models in a field annotation (through unions, lists, Annotated, ...)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp
        return
    if isinstance(tp, (types.UnionType,)) or typing.get_origin(tp) is not None:
        for arg in typing.get_args(tp):
            yield from _models_in(arg)


def _all_models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo = list(request_bodies().values())
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for f in m.model_fields.values():
            todo += _models_in(f.annotation)
    return seen


def _validates(model: type[BaseModel], body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


def _admits_null(prop: dict[str, Any], schemas: dict[str, Any]) -> bool:
    if "$ref" in prop:
        return _admits_null(schemas[prop["$ref"].rsplit("/", 1)[1]], schemas)
    t = prop.get("type")
    return (
        t == "null"
        or (isinstance(t, list) and "null" in t)
        or None in prop.get("enum", [0])
        or ("const" in prop and prop["const"] is None)
        or any(_admits_null(p, schemas) for p in prop.get("anyOf", []) + prop.get("oneOf", []))
    )


def test_every_field_of_every_request_model_is_listed(schemas: dict[str, Any]) -> None:
    models = _all_models()
    assert {"ChatCompletionRequest", "Message", "ToolCallIn", "FunctionCall"} <= {
        m.__name__ for m in models}
    for m in models:
        props = set(schemas[m.__name__]["properties"])
        wire = {f.alias or name for name, f in m.model_fields.items()}
        assert wire <= props, (m.__name__, sorted(wire - props))
        assert schemas[m.__name__].get("additionalProperties") is False, m.__name__


def test_fields_dropped_as_no_ops_are_listed_with_the_values_accepted(
    schemas: dict[str, Any],
) -> None:
    no_ops = accepted_no_ops()
    assert {m.__name__ for m in no_ops} == {
        "ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest",
        "CountTokensRequest"}
    for model, fields in no_ops.items():
        minimal, props = MINIMAL[model.__name__], schemas[model.__name__]["properties"]
        assert fields, model.__name__
        for name, values in fields.items():
            assert name not in model.model_fields, (model.__name__, name)
            assert props[name]["enum"] == list(values), (model.__name__, name)
            assert "ignored" in props[name]["description"]
            for v in values:  # every value listed is accepted ...
                assert _validates(model, {**minimal, name: v}), (model.__name__, name, v)
            with pytest.raises(ValidationError) as e:  # ... and another one refused by name
                model.model_validate({**minimal, name: NOT_A_NO_OP})
            assert e.value.errors()[0]["type"] == "unsupported_parameter", (model.__name__, name)


def test_nothing_else_is_accepted(schemas: dict[str, Any]) -> None:
    """additionalProperties: false holds: a name the document does not list is refused."""
    for name, minimal in MINIMAL.items():
        model = next(m for m in request_bodies().values() if m.__name__ == name)
        assert "not_a_field" not in schemas[name]["properties"]
        assert not _validates(model, {**minimal, "not_a_field": None}), name


def test_null_is_documented_where_the_validator_accepts_it(schemas: dict[str, Any]) -> None:
    for model in request_bodies().values():
        minimal = MINIMAL[model.__name__]
        for name, prop in schemas[model.__name__]["properties"].items():
            if name in minimal:
                continue
            accepted = _validates(model, {**minimal, name: None})
            assert _admits_null(prop, schemas) == accepted, (model.__name__, name, accepted)
    assert _admits_null(schemas["ChatCompletionRequest"]["properties"]["n"], schemas)
