"""GET /openapi.json: the worker's OpenAPI 3.1 description, built from the very msgspec types the
handlers decode, so the document cannot drift from what is accepted.

Request bodies are exact (msgspec's JSON Schema of each request type); responses are described by
status only: the generation endpoints answer in their protocol's own shapes, which the official
SDKs already define. The property-based tests (schemathesis) fuzz the worker from this document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from . import anthropic_messages, kv_lookup, tokenize
from .routes import ROUTES

# path -> (request type, summary)
POSTS: dict[str, tuple[type, str]] = {
    **{a.path: (a.body_type, a.summary) for a in ROUTES},
    "/v1/messages/count_tokens": (anthropic_messages.MessagesRequest, "Anthropic token count"),
    "/tokenize": (tokenize.TokenizeRequest, "text or chat messages to token ids"),
    "/detokenize": (tokenize.DetokenizeRequest, "token ids to text"),
    "/v1/kv/lookup": (kv_lookup.LookupRequest, "how much of a token sequence's KV is stored (what a restart finds)"),
}
GETS = {
    "/v1/models": "the served model",
    "/health/live": "process and event loop fine, compute context not poisoned",
    "/health/ready": "can take a request now",
    "/health": "the same as /health/ready (the path routers ask by default)",
    "/metrics": "Prometheus metrics",
    "/v1/stats": "engine state and metrics as JSON",
}

_ERRORS = {
    "400": "a client mistake, in the protocol's error shape",
    "401": "a missing or wrong API key",
    "403": "a foreign Host or Origin",
    "413": "a body larger than the context can use",
    "415": "a body that is not JSON",
    "429": "the queue is full (Retry-After)",
    "503": "loading, draining or restarting (Retry-After)",
}


def document(version: str) -> dict[str, Any]:
    types = list(dict.fromkeys(t for t, _ in POSTS.values()))
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    schema_of = dict(zip(types, schemas, strict=True))
    paths: dict[str, Any] = {}
    for path, (type_, summary) in POSTS.items():
        paths[path] = {"post": {
            "operationId": "post" + path.replace("/", "_"),
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema_of[type_]}}},
            "responses": {"200": {"description": "the result (a JSON object, or server-sent events with stream)"},
                          **{code: {"description": text} for code, text in _ERRORS.items()}},
        }}
    for path, summary in GETS.items():
        paths[path] = {"get": {"operationId": "get" + path.replace("/", "_"), "summary": summary,
                               "responses": {"200": {"description": summary}}}}
    paths["/v1/models/{model_id}"] = {"get": {
        "operationId": "get_model", "summary": "one model card",
        "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the model card"}, "404": {"description": "not the served model"}},
    }}
    return {
        "openapi": "3.1.0",
        "info": {"title": "ember worker", "version": version},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }},
        "security": [{"bearer": []}, {"apiKey": []}, {}],
    }
