"""Write tests/fixtures/tokenizer/corpus.jsonl: the strings the tokenizer is checked on.

Deterministic (fixed seed, no set or hash ordering), so re-running it reproduces the committed file
byte for byte. Hand-written edge cases first, then generated ones. Every string is valid Unicode
without surrogates, so it has a UTF-8 encoding that llama.cpp and ember both receive unchanged.

    /work/venv/bin/python tests/oracle/make_tokenizer_corpus.py [--out PATH]

Each line: {"id": N, "cat": CATEGORY, "text": STRING}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20250601
OUT = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer" / "corpus.jsonl"

# -- hand-written cases -----------------------------------------------------------------------------

HAND: list[tuple[str, str]] = []


def hand(cat: str, *texts: str) -> None:
    HAND.extend((cat, t) for t in texts)


hand("empty", "")
hand("whitespace", " ", "  ", "   ", "    ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "\r", "\r\n", "\r\n\r\n",
     " \n", "\n ", " \t ", "\t \t", "\v", "\f", "\u00a0", "\u3000", "\u2003", " " * 31, " " * 32, " " * 33,
     " " * 62, " " * 64, " " * 100, "\n" * 31, "\n" * 32, "\n" * 45, "\t" * 31, "\t" * 40, " \n" * 20,
     "a" + " " * 40 + "b", "x\n\n\n\n\ny", "trailing   ", "   leading", "  both  ", "mid  dle   spaces    here",
     "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n")
hand("special", "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
     "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
     "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>", "<unused98>", "<unused99>", "<unused6241>",
     "<start_of_image>", "<end_of_image>", "[multimodal]", "<s>", "</s>", "a</s>b", "<s>text</s>",
     "<start_of_turn", "start_of_turn>", "<<start_of_turn>>", "<start_of_turn><start_of_turn>",
     "<end_of_turn><eos><bos>", "text<eos>more", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<|endoftext|>",
     "<0x41>", "<0xFF>", "<0x0A>", "<0x00>", "▁", "▁▁", "▁hello", "hello▁world", "<b>bold</b> <i>it</i>",
     "<table><tr><td>1</td></tr></table>", "<h1>Title</h1>\n<blockquote>q</blockquote>",
     "<code>x = 1</code>", "<div><span>nested</span></div>", "<think>reasoning</think>answer",
     "<tool_call>{\"name\": \"f\"}</tool_call>", "<start_of_turn>user\n<start_of_image>look<end_of_turn>",
     "  <start_of_turn>  spaced  <end_of_turn>  ", "\n<start_of_turn>\n", "<start_of_turn>model\n\n\n",
     "[INST] hi [/INST]", "<<SYS>>\nsys\n<</SYS>>", "<unused5>x<unused6>", "<eos " "<eos/>")
hand("normalization", "caf\u00e9", "cafe\u0301", "\u212b", "\u00c5", "A\u030a", "\ufb01le", "ﬁ", "ＡＢＣ１２３",
     "\u1100\u1161\u11a8", "\uac01", "n\u0303", "\u00f1", "\u1e9b\u0323", "\u0041\u0308\u0301", "Ǆ ǅ ǆ",
     "ß SS ẞ", "İstanbul ıi", "ﬀ ﬃ ﬄ", "½ ¼ ¾ ⅓", "x² y³ z⁴ H₂O", "Ⅻ ⅻ", "℃ ℉ № ™ ℠",
     "e\u0301\u0301\u0301", "\u0301leading combining", "\u200b", "a\u200bb", "\ufeffbom", "zero\u200dwidth\u200cjoiner",
     "\u2060word\u2060joiner", "soft\u00adhyphen", "\u034f", "variation\ufe0f", "\ufe0e")
hand("control", "\x00", "a\x00b", "\x01\x02\x03", "\x07bell", "\x08back", "\x1b[31mred\x1b[0m", "\x7f", "\x85",
     "line\u2028sep", "para\u2029sep", "\x1f\x1e\x1d", "tab\there", "cr\ronly", "mixed\r\n\n\r", "\x0b\x0c",
     "\u200e\u200f", "\u202a\u202b\u202c\u202d\u202e", "\u2066\u2067\u2068\u2069", "\ufffd", "\ufffe\uffff",
     "\U0010ffff", "\U000e0001\U000e0041", "\ue000\uf8ff", "\U000f0000")
hand("emoji", "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🏴‍☠️", "🇺🇸🇯🇵🇩🇪", "1️⃣ #️⃣ *️⃣", "❤️ ❤", "🧑🏿‍💻",
     "👩‍❤️‍💋‍👨", "🫠🫡🫶", "😀😃😄😁😆😅🤣😂", "emoji in text 🎉 party 🎊!", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "☺️☹️✌🏻",
     "🐍 python 🦀 rust", "🤷‍♂️🤷‍♀️", "👁️‍🗨️")
hand("cjk", "你好，世界！", "我爱自然语言处理。", "日本語のテキストです。カタカナとひらがな。", "東京都渋谷区",
     "한국어 텍스트입니다.", "안녕하세요 세계", "中文English混合text", "𠀀𠀁𠀂 rare CJK ext B", "ｶﾀｶﾅ halfwidth",
     "「引用」『二重』【括弧】", "一二三四五六七八九十百千万億", "漢字かな交じり文",
     "繁體中文與简体中文", "ㄅㄆㄇㄈ bopomofo", "〇〻〆", "囧 槑 靐 齉")
hand("rtl", "مرحبا بالعالم", "العربية لغة جميلة", "שלום עולם", "עברית מימין לשמאל", "فارسی زبان",
     "اردو زبان", "مرحبا hello שלום", "نص عربي مع أرقام ١٢٣ و 456", "\u200fRTL mark\u200e",
     "ܫܠܡܐ", "ދިވެހި", "كِتَابٌ مُشَكَّلٌ", "בְּרֵאשִׁית בָּרָא", "﷽", "ﻻ ﻼ")
hand("scripts", "Привет, мир!", "Ελληνικά γράμματα", "हिन्दी भाषा", "தமிழ் மொழி", "ภาษาไทยไม่มีช่องว่าง",
     "ქართული ენა", "Հայերեն", "አማርኛ", "ᐃᓄᒃᑎᑐᑦ", "ᚠᚢᚦᚨᚱᚲ", "Tiếng Việt có dấu", "Ŧĥïŝ ïŝ ŵëïŗð",
     "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉", "ℕ ℤ ℚ ℝ ℂ ∀x∃y", "∑∫∂∇√∞≈≠≤≥", "┌─┐│ │└─┘", "⠓⠑⠇⠇⠕ braille",
     "ᠮᠣᠩᠭᠣᠯ", "ꦗꦮ", "𓀀𓀁𓂀 hieroglyphs", "🜁🜂🜃🜄", "Ⓐⓑⓒ ⑴⑵⑶")
hand("numbers", "0", "1234567890", "3.14159265358979", "-0.0", "1e-10", "6.022e23", "1,000,000", "1.000.000,00",
     "0x1F 0b1010 0o777", "1/2 3/4", "$100.00 €50 £20 ¥1000", "100%", "192.168.0.1", "2024-01-15T10:30:00Z",
     "+1 (555) 123-4567", "v1.2.3-beta.4", "123456789012345678901234567890", "٠١٢٣٤٥٦٧٨٩", "०१२३४५",
     "12:34:56.789", "1st 2nd 3rd 4th", "π ≈ 3.14", "-273.15°C")
hand("url", "https://example.com/path?query=value&other=1#frag", "http://localhost:8080/v1/chat/completions",
     "ftp://user:pass@host:21/file.txt", "mailto:someone@example.org", "www.example.co.uk/über/straße",
     "https://例え.jp/パス", "file:///home/user/.config/ember/config.toml", "git@github.com:org/repo.git",
     "s3://bucket/key/with%20spaces", "data:text/plain;base64,SGVsbG8gd29ybGQ=")
hand("code", "def f(x):\n\treturn x + 1\n",
     "def f(x):\n    if x:\n        return 1\n    return 0\n",
     "func main() {\n\tfmt.Println(\"hi\")\n\tfor i := 0; i < 10; i++ {\n\t\tgo work(i)\n\t}\n}\n",
     "all: build\n\nbuild:\n\t$(CC) -o app main.c\n\t@echo done\n",
     "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
     "const x = (a, b) => { return a ?? b; };\n", "SELECT * FROM users WHERE id = 1 AND name LIKE '%a%';",
     "fn main() -> Result<(), Box<dyn Error>> {\n    let v: Vec<u8> = vec![1, 2, 3];\n    Ok(())\n}\n",
     "<?php echo $x; ?>", "x <<= 2; y >>= 3; z **= 4; a //= 5;", "if (a && b || !c) { i++; --j; }",
     "lambda x: [i**2 for i in range(x) if i % 2 == 0]", "    \t    mixed indentation\n\t    again\n",
     "class A:\n    '''doc'''\n    def __init__(self):\n        self.x = {'a': [1, 2], \"b\": (3,)}\n",
     "  - name: step\n    run: |\n      echo \"hi\"\n      exit 0\n",
     "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\"\ndone\n",
     "\t\t\t\tdeep tabs\n\t\t\t\t\t\tdeeper", "public static void main(String[] args) {}",
     "@decorator\nasync def g(): await asyncio.sleep(0)", "x = 'it''s'; y = \"say \\\"hi\\\"\"",
     "// comment\n/* block\n   comment */\n", "<!-- html comment --><script>alert('x')</script>",
     "diff --git a/f b/f\n@@ -1,3 +1,3 @@\n-old\n+new\n context\n", "```python\nprint('hi')\n```")
hand("markdown", "# Heading\n\n## Sub\n\n- item 1\n- item 2\n  - nested\n\n1. one\n2. two\n",
     "**bold** _italic_ `code` ~~strike~~ [link](http://x.y)", "> quote\n> > nested quote",
     "| a | b |\n|---|---|\n| 1 | 2 |\n", "---\ntitle: Post\n---\n\nBody text.", "![img](a.png \"title\")",
     "- [ ] todo\n- [x] done", "Line one  \nLine two (hard break)", "Term\n: Definition", "***\n___\n---")
hand("json", '{"key": "value", "n": 1, "arr": [1, 2, 3], "nested": {"a": null, "b": true}}',
     '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
     '{"unicode": "\\u00e9\\u4e2d", "escaped": "line\\nbreak\\ttab", "quote": "\\""}',
     '{\n  "indented": {\n    "deep": [\n      1,\n      2\n    ]\n  }\n}',
     '{"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get","arguments":"{\\"x\\":1}"}}]}',
     '{"emoji": "😀", "cjk": "中文", "empty": "", "num": -1.5e-3}')
hand("prose", "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you?",
     "It's a dog's life; they're here, we've gone, I'm done, you'll see, he'd know.",
     "\"Quoted\" 'single' «guillemets» „German“ “curly” ‘quotes’", "Ellipsis… em—dash en–dash",
     "ALL CAPS TEXT AND lower case text And Title Case", "Don't stop believing!!! Really??? Yes...",
     "Mr. Smith went to Washington, D.C., on Jan. 5th.", "a b c d e f g h i j k l m n o p q r s t u v w x y z",
     "Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
     "hello", "Hello", "HELLO", " hello", "hello ", "\nhello", "hello\n", "don't", "DON'T", "'s 't 're 've 'm 'll 'd",
     "i'm I'M I'm", "naïve coöperate résumé façade jalapeño", "The year 2024 had 366 days.")
hand("long", "The quick brown fox jumps over the lazy dog. " * 120, "a" * 5000, "ab" * 1500, "😀" * 400,
     "中文" * 800, "x " * 2000, "\n".join(f"line {i}: " + "word " * (i % 13) for i in range(300)),
     "    " + "if x:\n        " * 200)

# -- generated cases --------------------------------------------------------------------------------

# The word lists read better as strings than as lists of quoted words, hence SIM905 silenced.
WORDS_EN = (  # noqa: SIM905
    "the of and to in is you that it he was for on are as with his they I at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do how "
    "their if will up other about out many then them these so some her would make like him into time "
    "has look two more write go see number no way could people my than first water been call who oil "
    "its now find long down day did get come made may part model token cache server request stream").split()
WORDS_OTHER = (  # noqa: SIM905
    "Straße über Größe naïve café niño año Ærø Øre Ålesund çà où même peut-être сегодня завтра "
    "привет мир Ελλάδα καλημέρα 東京 大阪 北京 上海 서울 부산 こんにちは ありがとう مرحبا شكرا שלום תודה "
    "नमस्ते धन्यवाद สวัสดี ขอบคุณ Xin chào Cảm ơn Dziękuję Příliš žluťoučký kůň İyi günler").split()
PUNCT = list(".,;:!?-—–…'\"()[]{}<>/\\|@#$%^&*_+=~`")
EMOJI = ["😀", "😂", "🥲", "🤖", "🎉", "🔥", "✨", "👍", "👍🏻", "👍🏿", "🙏", "💯", "🚀", "🌍", "🇫🇷", "🇧🇷",
         "👨‍💻", "👩‍🔬", "🧑‍🤝‍🧑", "👨‍👩‍👧", "🏳️‍⚧️", "❤️‍🔥", "🐕‍🦺", "😶‍🌫️", "🧔‍♀️", "1️⃣", "©️", "®️", "™️", "♻️"]
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>", "<unk>", "<unused7>",
            "<start_of_image>", "[multimodal]", "<b>", "</b>", "<s>", "</s>", "<table>", "<td>", "<|im_start|>",
            "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<think>", "</think>", "<0x0A>"]
WS = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", " \n", "\n  ", "\r\n", "\u00a0", "\u3000"]
# Code-point ranges to sample random characters from (all assigned-ish, none in the surrogate block).
RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF),
          (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2190, 0x22FF), (0x2500, 0x257F),
          (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xF900, 0xFAFF), (0xFE00, 0xFE0F), (0xFF00, 0xFFEF),
          (0x1D400, 0x1D7FF), (0x1F300, 0x1F64F), (0x1F900, 0x1F9FF), (0x20000, 0x2A6DF), (0x0, 0x1F)]


def rand_char(rng: random.Random) -> str:
    lo, hi = RANGES[rng.randrange(len(RANGES))]
    return chr(rng.randint(lo, hi))


def gen_mixed(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 25)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(WORDS_EN))
        elif r < 0.5:
            parts.append(rng.choice(WORDS_OTHER))
        elif r < 0.6:
            parts.append(rng.choice(PUNCT))
        elif r < 0.68:
            parts.append(rng.choice(EMOJI))
        elif r < 0.76:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif r < 0.84:
            parts.append("".join(rand_char(rng) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice(WS))
        parts.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
    return "".join(parts)


def gen_whitespace(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 8)):
        c = rng.choice([" ", "\t", "\n", "\r\n", "\u00a0", "x", "ab", "\u2003"])
        out.append(c * rng.randint(1, 70) if len(c) == 1 else c * rng.randint(1, 5))
    return "".join(out)


def gen_code(rng: random.Random) -> str:
    ind = rng.choice(["    ", "  ", "\t", "        ", "\t\t"])
    names = ["x", "y", "value", "result", "self.cache", "items[i]", "ctx", "tokens", "n_ctx", "blk_hash"]
    ops = [" = ", " += ", " == ", " != ", " -> ", " => ", " := ", " <= ", " >>= "]
    lines = []
    depth = 0
    for _ in range(rng.randint(2, 14)):
        kind = rng.random()
        name = rng.choice(names)
        if kind < 0.25:
            lines.append(ind * depth + f"if {name}{rng.choice(ops)}{rng.randint(0, 999)}:")
            depth = min(depth + 1, 6)
        elif kind < 0.35 and depth:
            depth -= 1
            lines.append(ind * depth + rng.choice(["}", "end", "return " + name, "pass"]))
        elif kind < 0.5:
            lines.append(ind * depth + f"{name}{rng.choice(ops)}{rng.choice(names)}"
                                       f"({rng.randint(0, 99)}, '{rng.choice(WORDS_EN)}')")
        elif kind < 0.6:
            lines.append(ind * depth + "# " + " ".join(rng.choice(WORDS_EN) for _ in range(rng.randint(1, 8))))
        elif kind < 0.7:
            lines.append("")
        elif kind < 0.8:
            lines.append(ind * depth + f"for (int i = 0; i < {rng.randint(1, 64)}; ++i) {{")
            depth = min(depth + 1, 6)
        else:
            lines.append(ind * depth + f"print(f\"{{{name}!r}} {rng.choice(WORDS_OTHER)}\")" + " " * rng.randint(0, 3))
    return "\n".join(lines) + rng.choice(["", "\n", "\n\n"])


def gen_special(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 10)):
        r = rng.random()
        if r < 0.4:
            parts.append(rng.choice(SPECIALS))
        elif r < 0.5:
            s = rng.choice(SPECIALS)
            cut = rng.randint(1, len(s) - 1)
            parts.append(s[:cut] if rng.random() < 0.5 else s[cut:])
        elif r < 0.8:
            parts.append(" ".join(rng.choice(WORDS_EN) for _ in range(rng.randint(1, 5))))
        else:
            parts.append(rng.choice(WS))
    return "".join(parts)


def gen_chat(rng: random.Random) -> str:
    out = ["<bos>"] if rng.random() < 0.5 else []
    for i in range(rng.randint(1, 4)):
        role = "user" if i % 2 == 0 else "model"
        body = rng.choice([gen_mixed, gen_code, gen_whitespace])(rng).strip("\n")
        out.append(f"<start_of_turn>{role}\n{body}<end_of_turn>\n")
    if rng.random() < 0.7:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def gen_json(rng: random.Random) -> str:
    def value(d: int):
        r = rng.random()
        if d > 2 or r < 0.3:
            return rng.choice([rng.randint(-1000, 1000), rng.random() * 100, True, None, rng.choice(WORDS_OTHER),
                               gen_mixed(rng)[:40]])
        if r < 0.65:
            return {rng.choice(WORDS_EN): value(d + 1) for _ in range(rng.randint(1, 4))}
        return [value(d + 1) for _ in range(rng.randint(0, 4))]
    return json.dumps(value(0), ensure_ascii=rng.random() < 0.3, indent=rng.choice([None, 2, 4, "\t"]))


def gen_emoji(rng: random.Random) -> str:
    return "".join(rng.choice(EMOJI) + rng.choice(["", "", " ", "\u200d", "\ufe0f", rng.choice(WORDS_EN)])
                   for _ in range(rng.randint(1, 12)))


def gen_random_chars(rng: random.Random) -> str:
    return "".join(rand_char(rng) for _ in range(rng.randint(1, 40)))


def gen_numbers(rng: random.Random) -> str:
    fmt = rng.choice(["{:d}", "{:,d}", "{:.3f}", "{:e}", "0x{:x}", "{:08d}", "-{:d}", "{:d}%"])
    return " ".join(fmt.format(rng.randint(0, 10 ** rng.randint(1, 15))) for _ in range(rng.randint(1, 6)))


def gen_url(rng: random.Random) -> str:
    host = rng.choice(["example.com", "api.openai.com", "localhost:8080", "192.168.1.10", "例え.テスト",
                       "xn--e1afmkfd.xn--p1ai"])
    path = "/".join(rng.choice(WORDS_EN + WORDS_OTHER) for _ in range(rng.randint(0, 4)))
    q = "&".join(f"{rng.choice(WORDS_EN)}={rng.randint(0, 99)}" for _ in range(rng.randint(0, 3)))
    return f"{rng.choice(['https', 'http', 'ws', 'ftp'])}://{host}/{path}" + (f"?{q}" if q else "")


GENERATORS = [
    ("gen-mixed", gen_mixed, 110), ("gen-whitespace", gen_whitespace, 50), ("gen-code", gen_code, 60),
    ("gen-special", gen_special, 60), ("gen-chat", gen_chat, 40), ("gen-json", gen_json, 30),
    ("gen-emoji", gen_emoji, 25), ("gen-chars", gen_random_chars, 60), ("gen-numbers", gen_numbers, 20),
    ("gen-url", gen_url, 15),
]


def build() -> list[dict]:
    rng = random.Random(SEED)
    rows: list[tuple[str, str]] = list(HAND)
    for cat, fn, count in GENERATORS:
        for _ in range(count):
            rows.append((cat, fn(rng)))
    out, seen = [], set()
    for cat, text in rows:
        text.encode("utf-8")  # raises on surrogates
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": len(out), "cat": cat, "text": text})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = build()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            line = json.dumps(r, ensure_ascii=False)
            for ch in "\u2028\u2029\x85":  # line breaks to some readers: keep them escaped
                line = line.replace(ch, f"\\u{ord(ch):04x}")
            f.write(line + "\n")
    print(f"wrote {len(rows)} strings to {args.out}")


if __name__ == "__main__":
    main()
