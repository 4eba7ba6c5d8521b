"""OpenAI chat completions and legacy completions, driven by the official `openai` client against a
real worker process."""

from __future__ import annotations

import uuid

import httpx
import pytest


def nonce() -> str:
    return uuid.uuid4().hex[:10]


def system_prompt(tag: str) -> str:
    """Long enough (~90 tokens) to fill several 16-token KV blocks."""
    return (f"Session {tag}. You are a careful assistant working inside a code editor. Answer briefly, "
            "prefer plain words, never invent file names, and say when you are unsure. When asked for code, "
            "give the smallest complete example, explain nothing unless asked, and keep every line short. "
            "The user is an experienced engineer who values precision over politeness.")


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="anything", messages=[{"role": "user", "content": content}], **kw)


# -- chat ------------------------------------------------------------------------------------------------------


def test_chat_non_streaming(openai_client, api_worker):
    r = chat(openai_client, "Name a colour.", max_tokens=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "gemma-3-270m-q4_k_m"  # the served model, whatever name was asked for
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("length", "stop")
    u = r.usage
    assert u.completion_tokens <= 3 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0  # too short to fill a block
    assert c.finish_reason == "length" and u.completion_tokens == 3  # greedy, the model has more to say


def test_chat_streaming_matches_non_streaming(openai_client):
    msg = f"Write one word about the sea. ({nonce()})"
    whole = chat(openai_client, msg, max_tokens=5)
    chunks = list(chat(openai_client, msg, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_streaming_without_usage(openai_client):
    chunks = list(chat(openai_client, "Say one word.", max_tokens=2, stream=True))
    assert all(ch.usage is None for ch in chunks) and chunks[-1].choices[0].finish_reason


def test_max_completion_tokens_wins(openai_client):
    r = chat(openai_client, "Count slowly to ten.", max_tokens=6, max_completion_tokens=2)
    assert r.usage.completion_tokens <= 2
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2  # greedy: it goes on


def test_stop_string(openai_client):
    msg = f"Describe a cat. ({nonce()})"
    full = chat(openai_client, msg, max_tokens=8).choices[0].message.content
    # a stop string that first occurs after the start of the text
    k = next((i for i in range(1, len(full) - 2) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip()), None)
    assert k is not None, f"greedy output {full!r} has no usable stop string"
    stop = full[k:k + 3]
    r = chat(openai_client, msg, max_tokens=8, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == full[:k]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(chat(openai_client, msg, max_tokens=8, stop=stop, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full[:k]


def test_logprobs(openai_client):
    r = chat(openai_client, "Pick a fruit.", max_tokens=3, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(chat(openai_client, "Pick a fruit.", max_tokens=3, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert chat(openai_client, "Pick a fruit.", max_tokens=2).choices[0].logprobs is None


def test_seed_makes_sampling_reproducible(openai_client):
    kw = dict(max_tokens=5, temperature=1.0, top_p=0.9, seed=1234)
    a = chat(openai_client, "Invent a name.", **kw).choices[0].message.content
    b = chat(openai_client, "Invent a name.", **kw).choices[0].message.content
    assert a == b


def test_second_identical_request_reports_cached_tokens(openai_client):
    messages = [{"role": "system", "content": system_prompt(nonce())}, {"role": "user", "content": "Hello."}]
    first = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    second = openai_client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    usage = list(second)[-1].usage
    assert first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens == first.usage.prompt_tokens
    # every full block but the one holding the last prompt token comes from the cache
    assert usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // 16 * 16 - 16
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_developer_role_and_content_parts(openai_client):
    r = openai_client.chat.completions.create(
        model="gpt-5", max_tokens=2, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        extra_body={"some_future_field": {"x": 1}, "parallel_tool_calls": False})
    assert r.choices[0].message.content is not None


def test_tools_and_tool_messages_are_rendered(openai_client):
    params = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": params}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}
    user = {"role": "user", "content": "Open a.txt"}
    with_calls = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "hello from the file"}]
    r = openai_client.chat.completions.create(model="m", max_tokens=1, temperature=0, tools=tools,
                                              messages=with_calls)
    plain = openai_client.chat.completions.create(model="m", max_tokens=1, temperature=0, messages=[user])
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10


# -- completions -------------------------------------------------------------------------------------------------


def tokenize(worker, text: str, add_special: bool = True) -> list[int]:
    r = httpx.post(worker.url + "/tokenize", json={"content": text, "add_special": add_special},
                   headers=worker.headers())
    r.raise_for_status()
    return r.json()["tokens"]


def test_completion_string_and_token_prompts_agree(openai_client, api_worker):
    prompt = "The capital of France is"
    ids = tokenize(api_worker, prompt)
    a = openai_client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    b = openai_client.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0)
    c = openai_client.completions.create(model="m", prompt=[prompt], max_tokens=4, temperature=0)
    d = openai_client.completions.create(model="m", prompt=[ids], max_tokens=4, temperature=0)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text == d.choices[0].text
    assert a.usage.prompt_tokens == len(ids) == b.usage.prompt_tokens
    # BOS appears once even when the text spells it out
    assert openai_client.completions.create(model="m", prompt="<bos>" + prompt, max_tokens=1,
                                            temperature=0).usage.prompt_tokens == len(ids)


def test_completion_default_max_tokens_is_16(openai_client):
    r = openai_client.completions.create(model="m", prompt="Once upon a time", temperature=0)
    assert r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16  # greedy: a story goes on


def test_completion_echo_with_logprobs(openai_client, api_worker):
    prompt = "One, two, three,"
    n_prompt = len(tokenize(api_worker, prompt))
    r = openai_client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n = n_prompt + r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # the generated part equals a plain request's logprobs
    plain = openai_client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0, logprobs=2)
    assert plain.choices[0].text == choice.text[len(prompt):]
    assert plain.choices[0].logprobs.tokens == lp.tokens[n_prompt:]
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)
    assert plain.choices[0].logprobs.text_offset[0] == 0


def test_completion_echo_scores_prompt_with_zero_max_tokens(openai_client, api_worker):
    prompt = "Water boils at one hundred degrees"
    n_prompt = len(tokenize(api_worker, prompt))
    r = openai_client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.token_logprobs) == n_prompt


def test_completion_streaming(openai_client):
    prompt = f"List three animals: ({nonce()})"
    whole = openai_client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    chunks = list(openai_client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    echo = list(openai_client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                                 stream=True, logprobs=1))
    assert "".join(ch.choices[0].text for ch in echo) == prompt + whole.choices[0].text
    assert echo[0].choices[0].text == prompt and echo[0].choices[0].logprobs.token_logprobs[0] is None


# -- models, tokenizer helpers ---------------------------------------------------------------------------------------


def test_models(openai_client, api_worker):
    models = openai_client.models.list().data
    assert [m.id for m in models] == ["gemma-3-270m-q4_k_m"]
    assert openai_client.models.retrieve("gemma-3-270m-q4_k_m").id == "gemma-3-270m-q4_k_m"
    assert openai_client.models.retrieve("gemma-3-270m-q4_k_m.gguf").id == "gemma-3-270m-q4_k_m"
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        openai_client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"


def test_tokenize_detokenize(api_worker):
    h = api_worker.headers()
    r = httpx.post(api_worker.url + "/tokenize", json={"content": "Hello world", "with_pieces": True}, headers=h).json()
    ids = [t["id"] for t in r["tokens"]]
    assert "".join(t["piece"] for t in r["tokens"]) == "Hello world" and r["count"] == len(ids)
    back = httpx.post(api_worker.url + "/detokenize", json={"tokens": ids}, headers=h).json()
    assert back["content"] == "Hello world"
    chat_ids = httpx.post(api_worker.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                          headers=h).json()["tokens"]
    assert chat_ids[0] == tokenize(api_worker, "")[0] and chat_ids.count(chat_ids[0]) == 1  # one BOS
