"""The worker's HTTP API: OpenAI chat/completions/responses and Anthropic messages over the engine.

`create_app` (app.py) builds the Litestar app; one module per protocol turns a request body into a
GenerationRequest and the engine's events into that protocol's JSON or server-sent events.
"""
