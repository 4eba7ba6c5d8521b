"""The worker's HTTP API: OpenAI chat/completions/responses and Anthropic messages over the engine.

`create_app` (app.py) builds the Litestar app and serves the route table (routes.py) with one
handler: each protocol module defines an adapter (adapter.py) that turns a request body into a
GenerationRequest and the engine's events into that protocol's JSON or server-sent events.
"""
