"""Chat templates: the built-in ones, GGUF-provided ones, and the sandbox around them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.worker.model.gguf_file import GGUFFile
from ember.worker.text.chat_template import ChatTemplate, ChatTemplateError, builtin_source
from ember.worker.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def gemma_model(default_model_path):
    g = GGUFFile(default_model_path)
    return g, Tokenizer.from_gguf(g)


@pytest.fixture(scope="module")
def gemma(gemma_model) -> ChatTemplate:
    g, tok = gemma_model
    return ChatTemplate.from_gguf(g, tok)


def _plain(source: str, **kw) -> ChatTemplate:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>", **kw)


USER = [{"role": "user", "content": "Hi"}]

# -- the built-in Gemma template: the format of Google's Gemma 3 template -------------------------------

GEMMA_CASES = [
    ("user only", USER, True,
     "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    ("no generation prompt", USER, False,
     "<bos><start_of_turn>user\nHi<end_of_turn>\n"),
    ("system folded into first user turn",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n"}], True,
     "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"),
    ("multi-turn, assistant is model",
     [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": " b "},
      {"role": "user", "content": "c"}], True,
     "<bos><start_of_turn>user\nS\n\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n"
     "<start_of_turn>user\nc<end_of_turn>\n<start_of_turn>model\n"),
    ("multi-part content with an image",
     [{"role": "user", "content": [{"type": "text", "text": " Look: "}, {"type": "image"},
                                   {"type": "text", "text": "what is it?"}]}], True,
     "<bos><start_of_turn>user\nLook:<start_of_image>what is it?<end_of_turn>\n<start_of_turn>model\n"),
    ("system as parts",
     [{"role": "system", "content": [{"type": "text", "text": "Sys"}]},
      {"role": "user", "content": [{"type": "text", "text": "x"}]}, {"role": "assistant", "content": "y"}], False,
     "<bos><start_of_turn>user\nSys\n\nx<end_of_turn>\n<start_of_turn>model\ny<end_of_turn>\n"),
]


@pytest.mark.parametrize("case", GEMMA_CASES, ids=[c[0] for c in GEMMA_CASES])
def test_builtin_gemma_renders_gemma3_format(gemma, case):
    _, messages, agp, want = case
    assert gemma.render(messages, add_generation_prompt=agp) == want


def test_embedded_model_uses_builtin_gemma(gemma_model, gemma):
    g, tok = gemma_model
    assert "tokenizer.chat_template" not in g.metadata
    assert gemma.name == "gemma" and gemma.bos_token == "<bos>" and gemma.eos_token == "<eos>"
    ids = gemma.encode([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert ids[:2] == [tok.bos_id, tok.id_of("<start_of_turn>")] and ids.count(tok.bos_id) == 1
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", add_special=False, parse_special=True)
    assert tok.id_of("<end_of_turn>") in ids


def test_gemma_is_lenient_where_agents_need_it(gemma):
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "42"}, {"role": "system", "content": "late"}, {"role": "user", "content": "c"}]
    assert gemma.render(msgs) == (
        "<bos><start_of_turn>user\na<end_of_turn>\n<start_of_turn>user\nb<end_of_turn>\n"
        "<start_of_turn>model\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}<end_of_turn>\n"
        "<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>user\nlate\n\nc<end_of_turn>\n<start_of_turn>model\n")


# -- the other built-ins --------------------------------------------------------------------------------


def test_builtin_llama3():
    t = ChatTemplate(builtin_source("llama3"), bos_token="<|begin_of_text|>", name="llama3")
    out = t.render([{"role": "system", "content": "S "}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
    out = t.render([{"role": "user", "content": "w?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get", "arguments": '{"q": 1}'}}]}, {"role": "tool", "content": "ok"}],
        tools=[{"type": "function", "function": {"name": "get"}}], add_generation_prompt=False)
    assert '"name": "get"' in out.split("<|eot_id|>")[0]  # the tool schema is in the system turn
    assert '{"name": "get", "parameters": {"q": 1}}<|eot_id|>' in out
    assert out.endswith("<|start_header_id|>ipython<|end_header_id|>\n\nok<|eot_id|>")


def test_builtin_chatml():
    t = ChatTemplate(builtin_source("chatml"), bos_token="", eos_token="<|im_end|>", name="chatml")
    assert t.render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    out = t.render([{"role": "user", "content": "w?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                    {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
                   tools=[{"type": "function", "function": {"name": "f"}}], add_generation_prompt=False)
    assert out.startswith("<|im_start|>system\n# Tools") and "<tools>\n{\"type\": \"function\"" in out
    assert "<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\n" in out
    assert out.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                        "</tool_response><|im_end|>\n")


def test_no_template_and_no_builtin_is_an_error(tmp_path):
    g = GGUFFile(_write_vocab_gguf(tmp_path / "x.gguf", arch="mamba", template=None, turn_tokens=False))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_gguf(g, Tokenizer.from_metadata_only(g))
    with pytest.raises(ChatTemplateError):
        ChatTemplate.builtin("nonesuch")


# -- a template from the GGUF ------------------------------------------------------------------------------

GGUF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>{% endif %}{% endif %}"
)


def test_gguf_provided_template(tmp_path):
    g = GGUFFile(_write_vocab_gguf(tmp_path / "m.gguf", arch="qwen2", template=GGUF_TEMPLATE))
    tok = Tokenizer.from_metadata_only(g)
    t = ChatTemplate.from_gguf(g, tok)
    assert t.name == "gguf" and t.bos_token == "<s>"
    msgs = [{"role": "user", "content": "é <b>"}, {"role": "skip", "content": "x"}]
    assert t.render(msgs, tools=[{"name": "f", "d": "<&>"}], think=True) == (
        '<s><|im_start|>user\né <b><|im_end|>\n[{"name": "f", "d": "<&>"}]<|im_start|>assistant\n<think>')
    ids = t.encode(msgs, add_generation_prompt=False)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1 and tok.id_of("<|im_start|>") in ids
    assert tok.decode(ids, skip_special=False) == "<s><|im_start|>user\né <b><|im_end|>\n"


# -- HF's helpers ----------------------------------------------------------------------------------------


def test_tojson_has_hf_semantics():
    t = _plain("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}")
    x = {"b": "<é&'>", "a": [1, None, True]}
    assert t.render(USER, x=x) == (
        '{"b": "<é&\'>", "a": [1, null, true]}|{\n  "b": "<é&\'>",\n  "a": [\n    1,\n    null,\n    true\n  ]\n}|'
        '{"a": [1, null, true], "b": "<é&\'>"}')


def test_helpers_and_extensions():
    src = ("{{ strftime_now('%Y') | length }} {{ bos_token }}{{ eos_token }} {{ add_generation_prompt }} "
           "{{ tools }} {% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %} "
           "{% generation %}gen{% endgeneration %} {{ messages[0].content }} {{ extra }}")
    assert _plain(src).render(USER, extra="kw") == "4 <s></s> True None 012 gen Hi kw"
    # trim_blocks / lstrip_blocks, as HF sets them
    assert _plain("  {% if true %}\nA\n  {% endif %}\nB").render(USER) == "A\nB"


def test_raise_exception_is_a_chat_template_error():
    t = _plain("{% if messages[0].role != 'system' %}"
               "{{ raise_exception('System message required.\\nReally.') }}{% endif %}")
    with pytest.raises(ChatTemplateError) as err:
        t.render(USER)
    assert str(err.value) == "System message required. Really."


def test_syntax_and_runtime_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        _plain("ok\n{% if %}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        _plain("{% for m in messages %}")
    for src in ("{{ messages[3].content }}", "{{ 1 / 0 }}", "{{ nothing.here }}", "{{ messages | join(1, 2, 3) }}"):
        with pytest.raises(ChatTemplateError) as err:
            _plain(src).render(USER)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("src", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{{ messages[0].update({'content': 'changed'}) }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = 'a' * 100000000 %}",
    "{% for i in range(1000000000) %}{% endfor %}",
])
def test_sandbox_refuses_escapes(src):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ChatTemplateError) as err:
        _plain(src).render(messages)
    assert "\n" not in str(err.value)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_messages_must_be_a_list():
    with pytest.raises(ChatTemplateError):
        _plain("{{ messages }}").render("hello")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="string or a list of parts"):
        ChatTemplate.builtin("gemma").render([{"role": "user", "content": 5}])


# -- helpers -----------------------------------------------------------------------------------------------


def _write_vocab_gguf(path: Path, *, arch: str, template: str | None, turn_tokens: bool = True) -> Path:
    """A small SentencePiece-style vocabulary (byte fallback for everything else)."""
    from gguf import GGUFWriter

    tokens = ["<unk>", "<s>", "</s>"] + (["<|im_start|>", "<|im_end|>"] if turn_tokens else [])
    types = [2] + [3] * (len(tokens) - 1)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "u", "s", "e", "r", "us", "er", "user", "<", ">", "b"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [1] * len(pieces)
    w = GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path
