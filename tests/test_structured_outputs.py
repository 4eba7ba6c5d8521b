"""Structured outputs against a real worker: response_format (chat), text.format (Responses),
output_config.format (messages), the official clients' .parse() with pydantic models, streaming,
400s for what cannot be enforced, and the default output cap.

The schema sweep runs every schema at temperature 0 and at temperature 1 (seeded) through the
embedded 270M model; every answer must parse and validate with jsonschema (formats checked too).
"""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from ember.worker.api import common, structured
from ember.worker.api.errors import ApiError

# Room for every schema below: the longest valid answers are ~120 tokens. A generation that hits
# the cap ends with finish_reason "length" (tested on its own), which the sweep counts as a failure.
SWEEP_MAX_TOKENS = 320

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

# (task given to the model, schema). Covers nested objects, arrays with bounds, enums, anyOf,
# number ranges, integers, patterns, formats, booleans, nullables, optional properties, $ref,
# additionalProperties false and a non-object root.
SCHEMAS: list[tuple[str, dict]] = [
    ("A person.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("A person and their home address.", {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": NAME, "address": {
            "type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
            "properties": {"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}),
    ("Between two and four lucky numbers.", {
        "type": "object", "required": ["numbers"], "additionalProperties": False,
        "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                                   "minItems": 2, "maxItems": 4}}}),
    ("The colour of the sky.", {
        "type": "object", "required": ["color"], "additionalProperties": False,
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue", "light blue"]}}}),
    ("An identifier that is either a number or a short code.", {
        "type": "object", "required": ["id"], "additionalProperties": False,
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0},
                                        {"type": "string", "pattern": "^[a-z]{2,6}$"}]}}}),
    ("The temperature outside in Celsius.", {
        "type": "object", "required": ["celsius"], "additionalProperties": False,
        "properties": {"celsius": {"type": "number", "minimum": -40.5, "maximum": 55}}}),
    ("A score strictly between 0 and 10.", {
        "type": "object", "required": ["score"], "additionalProperties": False,
        "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}}),
    ("A product code.", {
        "type": "object", "required": ["code"], "additionalProperties": False,
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}}),
    ("The date of a meeting.", {
        "type": "object", "required": ["date"], "additionalProperties": False,
        "properties": {"date": {"type": "string", "format": "date"}}}),
    ("A contact email address.", {
        "type": "object", "required": ["email"], "additionalProperties": False,
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}}}),
    ("An order with its id.", {
        "type": "object", "required": ["order_id"], "additionalProperties": False,
        "properties": {"order_id": {"type": "string", "format": "uuid"}}}),
    ("Feature flags.", {
        "type": "object", "required": ["dark_mode", "beta", "notifications"], "additionalProperties": False,
        "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"},
                       "notifications": {"type": "boolean"}}}),
    ("A user with an optional nickname.", {
        "type": "object", "required": ["user", "nickname"], "additionalProperties": False,
        "properties": {"user": NAME, "nickname": {"type": ["string", "null"], "maxLength": 16},
                       "manager": {"anyOf": [NAME, {"type": "null"}]}}}),
    ("A book; the subtitle and year are optional.", {
        "type": "object", "required": ["title"], "additionalProperties": False,
        "properties": {"title": NAME, "subtitle": NAME,
                       "year": {"type": "integer", "minimum": 1450, "maximum": 2030}}}),
    ("A shopping list.", {
        "type": "object", "required": ["items"], "additionalProperties": False,
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "required": ["name", "quantity"], "additionalProperties": False,
            "properties": {"name": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 12}}}}}}),
    ("The API version.", {
        "type": "object", "required": ["version", "kind"], "additionalProperties": False,
        "properties": {"version": {"const": "v1"}, "kind": {"const": 3}}}),
    ("A line segment between two points.", {
        "$defs": {"point": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                            "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "type": "object", "required": ["start", "end"], "additionalProperties": False,
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}}),
    ("Three words.", {
        "type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "minItems": 3, "maxItems": 3}),
    ("A 2 by 2 matrix of small integers.", {
        "type": "object", "required": ["rows"], "additionalProperties": False,
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}}),
    ("When the build finished.", {
        "type": "object", "required": ["finished_at"], "additionalProperties": False,
        "properties": {"finished_at": {"type": "string", "format": "date-time"}}}),
    ("A status code.", {
        "type": "object", "required": ["status"], "additionalProperties": False,
        "properties": {"status": {"enum": [200, 404, 500, None, "unknown"]}}}),
    ("A username.", {
        "type": "object", "required": ["username"], "additionalProperties": False,
        "properties": {"username": {"type": "string", "minLength": 3, "maxLength": 8}}}),
    ("A quantity in steps of five.", {
        "type": "object", "required": ["quantity"], "additionalProperties": False,
        "properties": {"quantity": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}}),
    ("A company and its team.", {
        "type": "object", "required": ["company"], "additionalProperties": False,
        "properties": {"company": {"type": "object", "required": ["name", "team"], "additionalProperties": False,
                                   "properties": {"name": NAME, "team": {"type": "object", "required": ["lead"],
                                                                         "additionalProperties": False,
                                                                         "properties": {"lead": {
                                                                             "type": "object", "required": ["name"],
                                                                             "additionalProperties": False,
                                                                             "properties": {"name": NAME}}}}}}}}),
    ("A server address and the time it was last seen.", {
        "type": "object", "required": ["ip", "seen"], "additionalProperties": False,
        "properties": {"ip": {"type": "string", "format": "ipv4"}, "seen": {"type": "string", "format": "time"}}}),
    # Unbounded ones, as hand-written and pydantic schemas usually are: free strings, numbers and
    # lists, optional keys without additionalProperties, a free-form map. Small models loop in these.
    ("A short note.", {
        "type": "object", "required": ["title", "body"], "additionalProperties": False,
        "properties": {"title": {"type": "string"}, "body": {"type": "string"}}}),
    ("A measurement.", {
        "type": "object", "required": ["value", "unit", "count", "samples"],
        "properties": {"value": {"type": "number"}, "unit": {"type": "string"}, "count": {"type": "integer"},
                       "samples": {"type": "array", "items": {"type": "number"}}}}),
    ("A movie.", {
        "type": "object", "required": ["title"],
        "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                       "genres": {"type": "array", "items": {"type": "string"}}}}),
    ("How often each word occurs.", {"type": "object", "additionalProperties": {"type": "integer"}}),
]


def validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def prompt(task: str) -> list[dict]:
    return [{"role": "user", "content": f"{task} Answer with JSON only."}]


# -- building grammars (no worker) --------------------------------------------------------------------------


@pytest.mark.parametrize("schema", [s for _, s in SCHEMAS])
def test_every_sweep_schema_compiles(schema):
    jsonschema.validators.validator_for(schema).check_schema(schema)  # the fixtures themselves are valid
    assert structured.chat_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


@pytest.mark.parametrize("fmt, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"json_schema": {}}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
     "response_format.json_schema.schema"),
])
def test_malformed_response_format_names_the_parameter(fmt, param):
    with pytest.raises(ApiError) as e:
        structured.chat_grammar(fmt)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("schema, feature", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "iri"}, "iri"),
    ({"type": "string", "pattern": "(?=x)x"}, "look-around"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_unsupported_schema_features_are_refused(schema, feature):
    with pytest.raises(ApiError) as e:
        structured.responses_grammar({"type": "json_schema", "name": "x", "schema": schema})
    assert e.value.status == 400 and e.value.param == "text.format.schema"
    assert e.value.code == "unsupported_json_schema" and feature in e.value.message


def test_text_formats_need_no_grammar():
    assert structured.chat_grammar(None) is None
    assert structured.chat_grammar({"type": "text"}) is None
    assert structured.responses_grammar({"type": "text"}) is None
    assert structured.chat_grammar({"type": "json_object"}) == structured.schema_grammar({"type": "object"}, "x")


def test_default_output_cap_is_bounded_by_the_context():
    # A quarter of the context, at least 1024, at most 32768, and never more than the room left.
    assert common.default_max_tokens(1024) == 1024
    assert common.default_max_tokens(4096) == 1024
    assert common.default_max_tokens(8192) == 2048
    assert common.default_max_tokens(131072) == 32768
    assert common.default_max_tokens(1 << 20) == 32768
    assert common.max_new_tokens(None, 100, 8192, "max_tokens") == 2048
    assert common.max_new_tokens(None, 8000, 8192, "max_tokens") == 192
    assert common.max_new_tokens(None, 9000, 8192, "max_tokens") == 1
    assert common.max_new_tokens(50_000, 100, 8192, "max_tokens") == 8092  # an explicit cap is only clamped
    assert common.max_new_tokens(10, 100, 8192, "max_tokens") == 10
    for context in (512, 2048, 32768, 262144):
        for prompt_len in (0, context // 2, context - 1):
            n = common.max_new_tokens(None, prompt_len, context, "max_tokens")
            assert 1 <= n <= max(context - prompt_len, 1) and n <= 32768


def test_bounds_close_what_the_schema_leaves_open():
    b = structured.bound_schema({"type": "object", "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "x": {"type": "number"},
        "a": {"type": "array", "items": {"type": "string"}}, "free": {}, "m": {"type": "object"}},
        "required": ["s"]})
    p = b["properties"]
    assert p["s"]["maxLength"] == structured.MAX_STRING
    assert p["i"]["minimum"] == -structured.SAFE_INT and p["i"]["maximum"] == structured.SAFE_INT
    assert "multipleOf" not in p["i"] and p["x"]["multipleOf"] == structured.NUMBER_STEP
    assert p["a"]["maxItems"] == structured.MAX_ITEMS and p["a"]["items"]["maxLength"] == structured.MAX_STRING
    assert p["free"]["maxLength"] == structured.MAX_STRING and "object" in p["free"]["type"]
    assert p["m"]["maxProperties"] == structured.MAX_EXTRA_PROPERTIES
    assert b["additionalProperties"] is False  # declared keys only: the schema did not ask for more
    assert "maxProperties" not in b  # llguidance counts keys only when all declared ones are required


def test_bounds_keep_the_schema_own_and_never_conflict():
    same = {"type": "string", "maxLength": 5000}
    assert structured.bound_schema(same) == same
    assert structured.bound_schema({"type": "string", "minLength": 1000})["maxLength"] == 1000
    assert structured.bound_schema({"type": "array", "minItems": 100})["maxItems"] == 100
    assert "maximum" not in structured.bound_schema({"type": "integer", "minimum": 1e20})
    assert structured.bound_schema({"type": "integer", "exclusiveMinimum": 3})["maximum"] == structured.SAFE_INT
    assert "maxLength" not in structured.bound_schema({"type": "string", "enum": ["a" * 300]})
    assert structured.bound_schema({"type": "number", "multipleOf": 0.5})["multipleOf"] == 0.5
    # extra keys the schema asks for, or needs (a required key it does not declare), stay allowed
    assert structured.bound_schema({"type": "object", "properties": {"a": {}}, "additionalProperties": True,
                                    "required": ["a"]})["maxProperties"] == 1 + structured.MAX_EXTRA_PROPERTIES
    assert structured.bound_schema({"properties": {"a": {}}, "required": ["a", "b"]})["additionalProperties"]
    # allOf branches may declare each other's keys: none is closed
    b = structured.bound_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all(part["additionalProperties"] is not False for part in b["allOf"])
    # `not` is left alone: narrowing inside it would widen the schema
    assert structured.bound_schema({"not": {"type": "string"}}) == {"not": {"type": "string"}}


def test_properties_keep_their_order():
    grammar = structured.schema_grammar({"type": "object", "properties": {"zeta": {}, "alpha": {}}}, "x")
    assert grammar.index("zeta") < grammar.index("alpha")


# -- the schema sweep against the real model ------------------------------------------------------------------


def _sweep(client: openai.OpenAI, temperature: float) -> None:
    def one(i: int):
        task, schema = SCHEMAS[i]
        r = client.chat.completions.create(
            model="m", messages=prompt(task), max_tokens=SWEEP_MAX_TOKENS, temperature=temperature, seed=1000 + i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return i, r.choices[0].finish_reason, r.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:  # the shared worker runs four sequences at once
        results = list(pool.map(one, range(len(SCHEMAS))))
    failures = []
    for i, finish, text in results:
        try:
            assert finish == "stop", f"finish_reason {finish}"
            value = json.loads(text)
            validator(SCHEMAS[i][1]).validate(value)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"schema {i} ({SCHEMAS[i][0]}): {e.__class__.__name__}: {str(e)[:200]}\n  output: {text!r}")
    assert not failures, f"{len(failures)}/{len(SCHEMAS)} outputs failed at temperature {temperature}:\n" + \
        "\n".join(failures)


@pytest.mark.slow
def test_schema_sweep_greedy(openai_client):
    _sweep(openai_client, 0.0)


@pytest.mark.slow
def test_schema_sweep_sampled(openai_client):
    _sweep(openai_client, 1.0)


@pytest.mark.slow
def test_a_looping_list_still_closes(openai_client):
    """At temperature 0 the model repeats the same date until the list's bound (16 items): that
    repetition is the grammar's business, and must end as a complete document, not be cut short
    by the loop guard (which sees 11 copies of a 12-token block)."""
    schema = {"type": "object", "required": ["people", "dates"], "properties": {
        "people": {"type": "array", "items": {"type": "string"}},
        "dates": {"type": "array", "items": {"type": "string", "format": "date"}}}}
    r = openai_client.chat.completions.create(
        model="m", messages=prompt("Paris, 2020-01-01: Ann met Bob in Rome."), temperature=0,
        max_tokens=SWEEP_MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    validator(schema).validate(json.loads(r.choices[0].message.content))


def test_json_object_answers_an_object(openai_client):
    r = openai_client.chat.completions.create(model="m", messages=prompt("A cat."), max_tokens=SWEEP_MAX_TOKENS,
                                              temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_too_few_tokens_end_with_length(openai_client):
    schema = SCHEMAS[1][1]
    r = openai_client.chat.completions.create(
        model="m", messages=prompt(SCHEMAS[1][0]), max_tokens=4, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.choices[0].message.content.startswith("{")  # constrained, though cut short
    with pytest.raises(openai.LengthFinishReasonError):
        openai_client.chat.completions.parse(model="m", messages=prompt("A city."), max_tokens=4, response_format=City)


# -- the official clients' parse() helpers -----------------------------------------------------------------------


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=40_000_000)
    country_code: str = pydantic.Field(pattern=r"^[A-Z]{2}$")
    capital: bool


class Event(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=30)
    day: datetime.date
    id: uuid.UUID
    color: Color
    kind: Literal["meeting", "call"]
    tags: list[str] = pydantic.Field(min_length=1, max_length=3)
    location: City | None


def test_chat_parse_returns_a_pydantic_object(openai_client):
    r = openai_client.chat.completions.parse(model="m", messages=prompt("Describe Paris."), response_format=City,
                                             temperature=0, max_tokens=SWEEP_MAX_TOKENS)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, City)


def test_chat_parse_nested_model_sampled(openai_client):
    r = openai_client.chat.completions.parse(model="m", messages=prompt("Plan a meeting."), response_format=Event,
                                             temperature=1, seed=7, max_tokens=SWEEP_MAX_TOKENS)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(r.choices[0].message.parsed, Event)


def test_chat_stream_with_a_pydantic_model(openai_client):
    with openai_client.chat.completions.stream(model="m", messages=prompt("Describe Rome."), response_format=City,
                                               temperature=0, max_tokens=SWEEP_MAX_TOKENS) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1  # it really streamed
    assert isinstance(final.choices[0].message.parsed, City)
    assert "".join(deltas) == final.choices[0].message.content


def test_responses_parse_returns_a_pydantic_object(openai_client):
    r = openai_client.responses.parse(model="m", input="Describe Tokyo. Answer with JSON only.", text_format=City,
                                      temperature=0, max_output_tokens=SWEEP_MAX_TOKENS)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"  # the format is echoed back


def test_responses_stream_with_a_pydantic_model(openai_client):
    with openai_client.responses.stream(model="m", input="Describe Lima. Answer with JSON only.", text_format=City,
                                        temperature=0, max_output_tokens=SWEEP_MAX_TOKENS) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds
    assert isinstance(final.output_parsed, City)


def test_responses_json_object(openai_client):
    r = openai_client.responses.create(model="m", input="A dog. Answer with JSON only.", temperature=0,
                                       max_output_tokens=SWEEP_MAX_TOKENS, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


class Pet(pydantic.BaseModel):
    # The anthropic SDK moves numeric ranges, patterns and lengths into the description (its API
    # does not take them) and validates them locally, so this model has none: what is sent is enforced.
    name: str
    age: int
    kind: Literal["cat", "dog"]
    vaccinated: bool
    toys: list[str]


def test_anthropic_parse_returns_a_pydantic_object(anthropic_client):
    r = anthropic_client.messages.parse(model="claude", max_tokens=SWEEP_MAX_TOKENS, extra_body={"temperature": 0},
                                        messages=prompt("Describe a pet."), output_format=Pet)
    assert r.stop_reason == "end_turn"
    assert isinstance(r.parsed_output, Pet)


def test_anthropic_output_config_schema_streamed(anthropic_client):
    task, schema = SCHEMAS[2]
    with anthropic_client.messages.stream(model="claude", max_tokens=SWEEP_MAX_TOKENS, extra_body={"temperature": 0},
                                          messages=prompt(task),
                                          output_config={"format": {"type": "json_schema", "schema": schema}}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "end_turn"
    validator(schema).validate(json.loads(text))


# -- refusals over HTTP, on every API ---------------------------------------------------------------------------

UNSUPPORTED = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


def test_unsupported_schema_is_a_400_on_chat(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="m", messages=prompt("x"), max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": UNSUPPORTED, "strict": False}})
    assert e.value.param == "response_format.json_schema.schema" and "uniqueItems" in e.value.message
    assert e.value.code == "unsupported_json_schema"


def test_unsupported_schema_is_a_400_on_responses(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model="m", input="x", max_output_tokens=4, text={
            "format": {"type": "json_schema", "name": "x", "schema": UNSUPPORTED}})
    assert e.value.param == "text.format.schema" and "uniqueItems" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model="m", input="x", max_output_tokens=4, text={"format": {"type": "yaml"}})
    assert e.value.param == "text.format.type"


def test_unsupported_schema_is_a_400_on_messages(anthropic_client, api_worker):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model="claude", max_tokens=4, messages=prompt("x"), output_config={
            "format": {"type": "json_schema", "schema": UNSUPPORTED}})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema" in e.value.body["error"]["message"]
    assert "uniqueItems" in e.value.body["error"]["message"]
    # the structured-outputs beta's top-level output_format, malformed
    r = httpx.post(api_worker.url + "/v1/messages", headers=api_worker.headers(), json={
        "model": "claude", "max_tokens": 4, "messages": prompt("x"), "output_format": {"type": "json_object"}})
    assert r.status_code == 400 and "output_format.type" in r.json()["error"]["message"]


def test_malformed_response_format_is_a_400_over_http(openai_client, api_worker):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model="m", messages=prompt("x"), max_tokens=4,
                                              response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.param == "response_format.json_schema.schema"
    r = httpx.post(api_worker.url + "/v1/chat/completions", headers=api_worker.headers(), json={
        "model": "m", "messages": prompt("x"), "max_tokens": 4, "response_format": "json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "Traceback" not in r.text
