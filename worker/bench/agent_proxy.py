"""A loopback forwarding proxy between an agent CLI and a server, for tests/test_agent_clients.py,
tests/test_agent_sessions.py and `ember bench agents`.

A tiny model never chooses to call a tool by itself, and left free it rambles until the output
cap cuts it (which some clients report as a failed turn). So the proxy steers every request that
carries tools, and passes everything else through unchanged:
- the first one that offers the named (harmless) tool is forced to call it: the protocol's own
  forced tool choice (messages `{"type": "tool", "name": X}`, Responses `{"type": "function",
  "name": X}`, chat `{"type": "function", "function": {"name": X}}`); `reset()` arms it again
  (a session forces one call a turn);
- every later one gets a short answer. `answer="format"`: the protocol's structured-output format
  (messages `output_config.format`, Responses `text.format`, chat `response_format`) with a
  one-field schema, so the answer ends by itself and no other tool call can come back.
  `answer="stop"`: stop sequences instead (messages `stop_sequences`, chat `stop`), which every
  server honours, so the same requests can go to ember and to llama-server (which ignores the
  formats on /v1/messages); Responses has no stop parameter and keeps the format.
Two more knobs apply to every request body on the three protocols, side requests too: `thinking_off`
(messages `thinking: disabled`, chat `reasoning_effort: none`, Responses `reasoning.effort: none`,
for a thinking template whose tiny model would never close its block) and `max_tokens` (the output
cap, for a server that has no cap of its own).
It records each exchange (path, status, tool names, what it set, tool results the client sent
back, the response's headers and bytes, the `turn` the driver had set) so a test can assert that
the call went out in the client's own format and its result came back, and read each response's
request id and prompt usage. One request per connection (`Connection: close` both ways); stdlib
only; not a general HTTP proxy (no TLS, no upgrades).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field

MAX_RECORDED_RESPONSE = 1 << 20  # bytes of each response kept for assertions
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                 "required": ["answer"], "additionalProperties": False}
# answer="stop": a letter that a synthetic vocabulary's filler tokens (" tok123") carry, so a tiny random
# model's text reaches it within a few tokens, and that few tokens begin with, so the answer is seldom
# empty (an empty answer makes Claude Code ask again, and give up the turn after a second one)
STOP_SEQUENCES = ["k"]
ANSWER_MODES = ("format", "stop")
PROTOCOL_PATHS = ("/v1/messages", "/v1/chat/completions", "/v1/responses")


@dataclass(frozen=True)
class Usage:
    """A response's prompt accounting: every prompt token, and those the server served from its cache."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class Exchange:
    method: str
    path: str
    request: dict | None  # the JSON body as sent upstream (after forcing), None when not JSON
    tools: list[str]
    forced: str | None  # the tool this request was forced to call
    answer: bool  # this request was held to the short answer format
    tool_results: list[str]  # the call ids of the tool results the client sent back in this request
    turn: int | None = None  # the proxy's `turn` when the request came
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # the response's, names lowercased
    chunked: bool = False
    response: bytes = b""  # the body as it came (still chunk-framed when chunked)

    def response_text(self) -> str:
        body = _dechunk(self.response) if self.chunked else self.response
        return body.decode("utf-8", errors="replace")

    def docs(self) -> list[dict]:
        """The response's JSON objects: each SSE `data:` line's, or the whole body's."""
        docs = []
        for line in self.response_text().splitlines():
            line = line.strip()
            if line.startswith("data:"):
                line = line[5:].strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    docs.append(json.loads(line))
        return docs

    def calls(self) -> list[tuple[str, str]]:
        """(name, call id) of each tool call in the response, in any of the three protocols,
        streamed (SSE `data:` lines) or not."""
        found: list[tuple[str, str]] = []
        for doc in self.docs():
            _walk_calls(doc, found)
        return list(dict.fromkeys(found))

    @property
    def request_id(self) -> str | None:
        """The server's id for the request: ember's x-request-id header, else the response's own id
        (llama-server sends no header)."""
        if self.headers.get("x-request-id"):
            return self.headers["x-request-id"]
        for doc in self.docs():
            for node in (doc.get("message"), doc.get("response"), doc):
                if isinstance(node, dict) and isinstance(node.get("id"), str):
                    return node["id"]
        return None

    def usage(self) -> Usage | None:
        """The prompt's tokens and cached tokens as the response reports them, in any protocol, from
        the last report in the stream: messages `usage` (input_tokens counts the uncached part,
        cache_read_input_tokens the cached), chat `usage.prompt_tokens_details.cached_tokens` or
        llama-server's `timings` (prompt_n uncached, cache_n cached), Responses `usage.input_tokens_details`."""
        found: Usage | None = None
        for doc in self.docs():
            for node in (doc, doc.get("message"), doc.get("response")):
                u = _usage_of(node)
                if u is not None:
                    found = u
        return found


def _usage_of(node) -> Usage | None:
    if not isinstance(node, dict):
        return None
    u = node.get("usage")
    if isinstance(u, dict):
        if "cache_read_input_tokens" in u and "input_tokens" in u:  # messages
            cached = int(u.get("cache_read_input_tokens") or 0)
            return Usage(int(u["input_tokens"]) + cached + int(u.get("cache_creation_input_tokens") or 0), cached)
        details = u.get("prompt_tokens_details") or u.get("input_tokens_details")
        total = u.get("prompt_tokens", u.get("input_tokens"))
        if isinstance(details, dict) and isinstance(total, int):  # chat, Responses
            return Usage(total, int(details.get("cached_tokens") or 0))
    t = node.get("timings")
    if isinstance(t, dict) and "cache_n" in t and "prompt_n" in t:  # llama-server
        return Usage(int(t["prompt_n"]) + int(t["cache_n"]), int(t["cache_n"]))
    return None


def _tool_names(path: str, body: dict) -> list[str]:
    names = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if "/chat/completions" in path:
            names.append((t.get("function") or {}).get("name"))
        else:
            names.append(t.get("name"))
    return [n for n in names if isinstance(n, str)]


def _forced_choice(path: str, name: str) -> dict:
    if "/v1/messages" in path:
        return {"type": "tool", "name": name}
    if "/chat/completions" in path:
        return {"type": "function", "function": {"name": name}}
    return {"type": "function", "name": name}  # Responses


def _set_answer_format(path: str, body: dict, mode: str = "format") -> None:
    if mode == "stop" and "/v1/messages" in path:
        body["stop_sequences"] = list(STOP_SEQUENCES)
    elif mode == "stop" and "/chat/completions" in path:
        body["stop"] = list(STOP_SEQUENCES)
    elif "/v1/messages" in path:
        oc = body.get("output_config")
        fmt: dict = {"type": "json_schema", "schema": ANSWER_SCHEMA}
        body["output_config"] = {**(oc if isinstance(oc, dict) else {}), "format": fmt}
    elif "/chat/completions" in path:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    else:
        text = body.get("text")
        fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
        body["text"] = {**(text if isinstance(text, dict) else {}), "format": fmt}


def _thinking_off(path: str, body: dict) -> None:
    if "/v1/messages" in path:
        body["thinking"] = {"type": "disabled"}
    elif "/chat/completions" in path:
        body["reasoning_effort"] = "none"
    else:
        reasoning = body.get("reasoning")
        body["reasoning"] = {**(reasoning if isinstance(reasoning, dict) else {}), "effort": "none"}


def _cap_output(path: str, body: dict, cap: int) -> None:
    keys = ("max_tokens",) if "/v1/messages" in path else ("max_output_tokens",) if "/v1/responses" in path \
        else ("max_tokens", "max_completion_tokens")
    for k in keys:
        if k == keys[0] or k in body:
            asked = body.get(k)
            body[k] = min(asked, cap) if isinstance(asked, int) and asked > 0 else cap


def _tool_result_ids(path: str, body: dict) -> list[str]:
    ids = []
    if "/v1/messages" in path:
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                ids += [b.get("tool_use_id") for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
    elif "/chat/completions" in path:
        messages = body.get("messages") or []
        ids += [m.get("tool_call_id") for m in messages if isinstance(m, dict) and m.get("role") == "tool"]
    else:
        items = body.get("input")
        if isinstance(items, list):
            ids += [i.get("call_id") for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    return [str(i) for i in ids]


def _walk_calls(node, found: list[tuple[str, str]]) -> None:
    """Messages `tool_use` blocks (id), Responses `function_call` items (call_id), chat `tool_calls`
    entries (id; a stream names the function in the entry's first delta)."""
    if isinstance(node, list):
        for x in node:
            _walk_calls(x, found)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "tool_use" and node.get("id"):
        found.append((str(node.get("name")), str(node["id"])))
    elif node.get("type") == "function_call" and node.get("call_id"):
        found.append((str(node.get("name")), str(node["call_id"])))
    for c in node.get("tool_calls") or [] if isinstance(node.get("tool_calls"), list) else []:
        if isinstance(c, dict) and c.get("id"):
            found.append((str((c.get("function") or {}).get("name")), str(c["id"])))
    for k, v in node.items():
        if k != "tool_calls" and isinstance(v, (dict, list)):
            _walk_calls(v, found)


class ForcingProxy:
    """Forward 127.0.0.1:<port> to `upstream_host`:`upstream_port`; force `tool` once (again after
    each `reset`); hold later tool-carrying requests to the `answer` mode; `thinking_off` and
    `max_tokens` as the module says."""

    def __init__(self, upstream_port: int, tool: str | None, *, upstream_host: str = "127.0.0.1",
                 answer: str = "format", thinking_off: bool = False, max_tokens: int | None = None):
        if answer not in ANSWER_MODES:
            raise ValueError(f"answer must be one of {ANSWER_MODES} (got {answer!r})")
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.tool = tool
        self.answer = answer
        self.thinking_off = thinking_off
        self.max_tokens = max_tokens
        self.forced_once = False
        self.turn: int | None = None  # set by a session driver; each exchange records it
        self.exchanges: list[Exchange] = []
        self.errors: list[str] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def reset(self, turn: int | None = None) -> None:
        """A new turn of a session: force the tool once more, and label what comes with `turn`."""
        self.forced_once = False
        self.turn = turn

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ForcingProxy:
        self._thread = threading.Thread(target=self._run, name="agent-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._shutdown)
        if self._thread is not None:
            self._thread.join(10)

    def _shutdown(self) -> None:
        assert self._server is not None and self._loop is not None
        self._server.close()
        self._loop.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            loop.run_forever()
        finally:  # end the exchanges still open (a CLI that exited mid-stream), then the loop
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # -- one connection, one request ------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._exchange(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")  # for the test's failure message
        finally:
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = [tuple(x.split(":", 1)) for x in lines[1:] if ":" in x]
        lower = {k.strip().lower(): v.strip() for k, v in headers}
        if "chunked" in lower.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(int(lower.get("content-length", "0")))

        path = target.split("?", 1)[0]
        parsed: dict | None = None
        tools: list[str] = []
        forced = None
        answer = False
        results: list[str] = []
        if body and "json" in lower.get("content-type", "") and not lower.get("content-encoding"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        if isinstance(parsed, dict):
            tools = _tool_names(path, parsed)
            results = _tool_result_ids(path, parsed)
            changed = False
            if method == "POST" and any(p in path for p in PROTOCOL_PATHS):
                if self.thinking_off:
                    _thinking_off(path, parsed)
                if self.max_tokens:
                    _cap_output(path, parsed, self.max_tokens)
                changed = self.thinking_off or bool(self.max_tokens)
            if self.tool and not self.forced_once and self.tool in tools:
                self.forced_once = True
                forced = self.tool
                parsed["tool_choice"] = _forced_choice(path, self.tool)
            elif tools:
                answer = True
                _set_answer_format(path, parsed, self.answer)
            if forced or answer or changed:
                body = json.dumps(parsed).encode()
        ex = Exchange(method, target, parsed, tools, forced, answer, results, turn=self.turn)
        self.exchanges.append(ex)

        drop = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}
        out = [f"{method} {target} HTTP/1.1", f"Host: {self.upstream_host}:{self.upstream_port}",
               f"Content-Length: {len(body)}", "Connection: close"]
        out += [f"{k.strip()}: {v.strip()}" for k, v in headers if k.strip().lower() not in drop]
        up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        try:
            up_writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + body)
            await up_writer.drain()
            rhead = await up_reader.readuntil(b"\r\n\r\n")
            rlines = rhead.decode("latin-1").split("\r\n")
            ex.status = int(rlines[0].split(" ", 2)[1])
            names = [x.split(":", 1)[0].strip().lower() for x in rlines[1:]]
            ex.chunked = any(n == "transfer-encoding" and "chunked" in x.lower()
                             for n, x in zip(names, rlines[1:], strict=True))
            ex.headers = {n: x.split(":", 1)[1].strip() for n, x in zip(names, rlines[1:], strict=True) if ":" in x}
            kept = [x for n, x in zip(names, rlines[1:], strict=True) if x and n not in ("connection", "keep-alive")]
            writer.write(("\r\n".join([rlines[0], *kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1"))
            await writer.drain()
            while True:
                chunk = await up_reader.read(65536)
                if not chunk:
                    break
                if len(ex.response) < MAX_RECORDED_RESPONSE:
                    ex.response += chunk
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()

    # -- what the test reads --------------------------------------------------------------------------

    def summary(self) -> str:
        rows = [f"{e.method} {e.path} -> {e.status} tools={len(e.tools)} forced={e.forced} answer={e.answer} "
                f"tool_results={e.tool_results} response={e.response_text()[:300]!r}" for e in self.exchanges]
        return "\n".join(rows + [f"proxy error: {x}" for x in self.errors])


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return out
        out += await reader.readexactly(size)
        await reader.readexactly(2)


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked response (as much of it as was recorded)."""
    out, pos = b"", 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            return out
        try:
            size = int(data[pos:end].split(b";", 1)[0].strip(), 16)
        except ValueError:
            return out
        if size == 0:
            return out
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2
