"""Structured outputs: a request's output format -> an llguidance grammar for the engine.

Accepted shapes (anything else is a 400 naming the parameter):
- OpenAI chat `response_format`: {"type": "text"}, {"type": "json_object"} (any JSON object; a
  `schema` beside it, as llama.cpp accepts, constrains it further), {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}.
- Responses `text.format`: {"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
  "name", "schema", "strict", "description"}.
- Anthropic `output_config.format` (and the beta's top-level `output_format`): {"type":
  "json_schema", "schema"}.

The schema is compiled with llguidance and validated before the request reaches the engine: a
feature llguidance cannot enforce (`not`, `if`/`then`, `uniqueItems`, an unknown `format`, a
look-around in a `pattern`...) is refused with a 400, never answered unconstrained. The grammar
is enforced whatever `strict` says: a loosely followed schema would be a silent failure.

Whitespace is fixed (", " between items, ": " after keys, nothing else) unless the schema's own
`x-guidance` asks otherwise: with free whitespace a small model can pad a JSON document with
newlines until it runs out of tokens. For the same reason every unbounded part of the schema gets
a generous bound (bound_schema: strings, numbers, arrays, free-form maps and nesting; declared
properties only where extra keys were merely not forbidden), so a looping model still closes the
document. Each bound narrows, never widens, what the schema allows. If the request's token cap
(a bounded default, see common.max_new_tokens) is reached first, the answer ends with finish
reason `length`, as the OpenAI API does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

from .errors import bad_request

# Compact but readable JSON, the way json.dumps writes it: small models follow it easily and it
# leaves no room for unbounded whitespace. A schema's own `x-guidance` options override these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_ERROR_CHARS = 400  # llguidance messages can carry a grammar dump; the client needs the first line or two
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# -- bounds --------------------------------------------------------------------------------------------------
# A schema usually leaves strings, numbers, arrays and maps unbounded, and a small model at
# temperature 0 happily fills an unbounded string or digit run with a loop until max_tokens cuts
# the JSON in half. So before compiling, every unbounded part gets a generous bound. Each bound
# only narrows what the schema allows (an output that fits the bounds fits the schema), it is
# never added where it would conflict with the schema's own keywords, and a schema that states
# its own bound (maxLength, maxItems, minimum...) keeps it. The string and array bounds are also
# small enough that a looping string or list closes before the engine's loop guard (128 repeated
# tokens by default) would cut the document short.
MAX_STRING = 256  # characters in a string without maxLength (or enum / const)
MAX_ITEMS = 16  # items in an array without maxItems
MAX_EXTRA_PROPERTIES = 16  # keys beyond the declared properties, where extra keys are allowed at all
SAFE_INT = 2**53 - 1  # |number| without minimum / maximum: the range JSON parsers agree on
NUMBER_STEP = 1e-10  # a number without multipleOf has at most 10 decimals ("0.33333..." loops otherwise)
ANY_DEPTH = 3  # nesting of a value the schema leaves free ({}, true, json_object's values)

# Keywords whose subschemas are bounded too. Not `not`, `if` or `contains`: narrowing inside those
# would widen or change what the whole schema allows (llguidance refuses them anyway).
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "then",
                  "else")
_CONSTRAINING = {"type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "if", "properties",
                 "patternProperties", "additionalProperties", "items", "prefixItems", "required", "pattern",
                 "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                 "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties", "contains",
                 "propertyNames", "dependentRequired", "dependentSchemas", "uniqueItems", "unevaluatedProperties",
                 "unevaluatedItems"}


def bounded_any(depth: int = ANY_DEPTH) -> dict:
    """Any JSON value, nested at most `depth` levels, with the bounds above."""
    out: dict[str, Any] = {"type": ["string", "number", "boolean", "null"], "maxLength": MAX_STRING,
                           "minimum": -SAFE_INT, "maximum": SAFE_INT, "multipleOf": NUMBER_STEP}
    if depth > 0:
        inner = bounded_any(depth - 1)
        out["type"] += ["array", "object"]
        out.update(items=inner, maxItems=MAX_ITEMS, additionalProperties=inner, maxProperties=MAX_EXTRA_PROPERTIES)
    return out


def bound_schema(schema: Any, *, in_all_of: bool = False) -> Any:
    """A copy of `schema` with the bounds above added where it has none (see the comment there)."""
    if schema is True:
        return bounded_any()
    if not isinstance(schema, dict):
        return schema  # false, or something malformed that the compiler will name
    if not (_CONSTRAINING & schema.keys()):  # {} or annotations only: any value
        return {**schema, **bounded_any()}
    s = _with_bounded_subschemas(schema)
    if "enum" in s or "const" in s or "$ref" in s:
        return s  # finite already, or bounded where it points
    types = _types(s)
    if "string" in types and "maxLength" not in s:
        s["maxLength"] = max(MAX_STRING, _int(s.get("minLength")))
    if types & {"number", "integer"}:
        _bound_number(s, is_number="number" in types)
    if "array" in types and "maxItems" not in s and s.get("items") is not False:
        s["maxItems"] = max(MAX_ITEMS, _int(s.get("minItems")))
    if "object" in types:
        _bound_object(s, in_all_of=in_all_of)
    return s


def _with_bounded_subschemas(schema: dict) -> dict:
    """A copy of `schema` whose subschemas are bounded."""
    s = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            s[key] = {k: bound_schema(v) for k, v in s[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            s[key] = [bound_schema(v, in_all_of=key == "allOf") for v in s[key]]
    for key in _SUBSCHEMA_ONE:
        if key in s:
            s[key] = bound_schema(s[key])
    items = s.get("items")
    if isinstance(items, list):  # the tuple form of drafts before 2020-12
        s["items"] = [bound_schema(v) for v in items]
    elif "items" in s:
        s["items"] = bound_schema(items)
    return s


def _types(s: dict) -> set[str]:
    """The types a schema allows: its `type`, or without one, those its keywords imply."""
    t = s.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    if not types:  # no type: go by the keywords present
        if {"properties", "additionalProperties", "required"} & s.keys():
            types.add("object")
        if {"items", "prefixItems"} & s.keys():
            types.add("array")
    return types


def _bound_number(s: dict, *, is_number: bool) -> None:
    low = s.get("minimum", s.get("exclusiveMinimum"))
    high = s.get("maximum", s.get("exclusiveMaximum"))
    if low is None and (high is None or _num(high) > -SAFE_INT):
        s["minimum"] = -SAFE_INT
    if high is None and (low is None or _num(low) < SAFE_INT):
        s["maximum"] = SAFE_INT
    if is_number and "multipleOf" not in s:
        s["multipleOf"] = NUMBER_STEP


def _bound_object(s: dict, *, in_all_of: bool) -> None:
    declared = props if isinstance(props := s.get("properties"), dict) else {}
    required = req if isinstance(req := s.get("required"), list) else []
    if "additionalProperties" not in s and not ({"patternProperties", "unevaluatedProperties"} & s.keys()):
        # Declared keys only, when that can satisfy the schema: models ramble less. Not inside
        # allOf, where another branch may declare the keys this one would then forbid.
        closed = declared and not in_all_of and all(k in declared for k in required)
        s["additionalProperties"] = False if closed else bounded_any()
    # llguidance counts properties only when every declared one is required; elsewhere the
    # number of extra keys stays open (each of their values is still bounded)
    if s.get("additionalProperties", True) is not False and "maxProperties" not in s \
            and all(k in required for k in declared):
        s["maxProperties"] = max(len(declared) + MAX_EXTRA_PROPERTIES, len(set(required)),
                                 _int(s.get("minProperties")))


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _llg():
    import llguidance  # imported late: the worker starts (and answers health probes) without paying for it

    return llguidance


def _error_text(message: str) -> str:
    text = message.split("<state>")[0].strip()
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


@functools.lru_cache(maxsize=256)
def _compile_cached(schema_json: str) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, error). Cached by the schema's JSON text: agents send the
    same schema with every request, and compiling plus validating a large one takes a while."""
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(bound_schema(json.loads(schema_json)), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        return None, _error_text(str(e))
    except RecursionError:
        return None, "the schema is nested too deeply"
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return None, _error_text(messages[0] if messages else "the schema could not be compiled")
    return grammar, None


def schema_grammar(schema: Any, param: str) -> str:
    """The grammar for a JSON schema (a dict, or true for any JSON value); 400 naming `param` when
    the schema is malformed or uses a feature that cannot be enforced."""
    if schema is True:
        schema = {}
    if schema is False:
        raise bad_request(f"{param} is `false`, which no output can satisfy", param=param,
                          code="invalid_json_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object (got {type(schema).__name__})", param=param,
                          code="invalid_json_schema")
    try:
        schema_json = json.dumps(schema, allow_nan=False)  # key order kept: it fixes the order of properties
    except ValueError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param=param, code="invalid_json_schema") from None
    except RecursionError:
        raise bad_request(f"{param} is nested too deeply", param=param, code="invalid_json_schema") from None
    grammar, error = _compile_cached(schema_json)
    if error is not None:
        raise bad_request(f"{param} uses a JSON Schema feature that cannot be enforced: {error}", param=param,
                          code="unsupported_json_schema")
    assert grammar is not None
    return grammar


def _type_of(fmt: Any, param: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object with a `type`", param=param, code="invalid_value")
    kind = fmt.get("type")
    if kind not in allowed:
        expected = ", ".join(repr(a) for a in allowed)
        raise bad_request(f"{param}.type must be one of {expected} (got {kind!r})", param=f"{param}.type",
                          code="invalid_value")
    return kind


def _check_schema_fields(holder: dict, param: str, *, name_required: bool) -> Any:
    """The `schema` of a json_schema format (name and strict checked as the OpenAI API does)."""
    name = holder.get("name")
    if name is None and name_required:
        raise bad_request(f"{param}.name is required", param=f"{param}.name", code="missing_required_parameter")
    if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
        raise bad_request(f"{param}.name must be 1 to 64 letters, digits, '_' or '-' (got {name!r})",
                          param=f"{param}.name", code="invalid_value")
    strict = holder.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{param}.strict must be a boolean", param=f"{param}.strict", code="invalid_value")
    if "schema" not in holder:
        raise bad_request(f"{param}.schema is required", param=f"{param}.schema", code="missing_required_parameter")
    return holder["schema"]


def chat_grammar(fmt: Any, param: str = "response_format") -> str | None:
    """OpenAI chat `response_format` -> a grammar, or None for plain text. The schema sits one
    level down, in `json_schema`."""
    return _openai_grammar(fmt, param, nested=True)


def responses_grammar(fmt: Any, param: str = "text.format") -> str | None:
    """Responses API `text.format` -> a grammar, or None for plain text (the schema's fields sit in
    the format object itself)."""
    return _openai_grammar(fmt, param, nested=False)


def _openai_grammar(fmt: Any, param: str, *, nested: bool) -> str | None:
    if fmt is None:
        return None
    kind = _type_of(fmt, param, ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_object(fmt, param)
    if nested:
        fmt, param = fmt.get("json_schema"), f"{param}.json_schema"
        if not isinstance(fmt, dict):
            raise bad_request(f"{param} must be an object with `name` and `schema`", param=param,
                              code="invalid_value")
    schema = _check_schema_fields(fmt, param, name_required=True)
    return schema_grammar(schema, f"{param}.schema")


def anthropic_grammar(fmt: Any, param: str = "output_config.format") -> str | None:
    """Anthropic `output_config.format` (or the beta's `output_format`) -> a grammar, or None."""
    if fmt is None:
        return None
    _type_of(fmt, param, ("json_schema",))
    if "schema" not in fmt:
        raise bad_request(f"{param}.schema is required", param=f"{param}.schema", code="invalid_value")
    return schema_grammar(fmt["schema"], f"{param}.schema")


def _json_object(fmt: dict, param: str) -> str:
    # Any JSON object. llama.cpp also takes a `schema` here; honour it rather than ignore it.
    schema = fmt.get("schema")
    if schema is None:
        return schema_grammar({"type": "object"}, param)
    return schema_grammar(schema, f"{param}.schema")


async def off_loop(fn, *args) -> str | None:
    """Run a compiler above off the event loop: a large schema takes tens of milliseconds or more,
    and other requests' streams must not stall meanwhile."""
    return await asyncio.to_thread(fn, *args)
