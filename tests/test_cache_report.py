"""`ember cache report` and the chat path of a miss (issue 43 item 2): a real worker on a tiny synthetic
qwen2 serves an agent whose second turn rewrites a line of its system prompt (its git status), through
the official openai and anthropic clients; the admit line names the message and the character where the
prompt diverged and the client's user agent, a new conversation on the same system prompt is no miss,
and the report over that worker's log adds it up. Then the report's own rules on a log written here:
probes left out, --since, rotated files, a missing log.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from ember.daemon import cli
from ember.ops import cache_report
from ember.ops.contract import (
    ADMIT_CLIENT_FIELD,
    ADMIT_MISS_FIELDS,
    ENV_STATE_DIR,
    Event,
    ExitCode,
    MissCause,
    log_line,
)
from ember.worker.bench.synth import make_model

SYSTEM = ("You are a coding agent working in the user's repository. Be terse and precise. "
          "gitStatus: This is the git status at the start of the conversation.\nCurrent branch: main\n"
          "Status:\nM src/app.py\nM README.md\n\n"
          "Always run the tests before you answer. Prefer small, reviewed changes. Explain what you changed, "
          "file by file, and why, in one sentence each. Never touch files outside the repository. " * 2)
CHANGED = SYSTEM.replace("M README.md", "A docs/new.md", 1)  # the agent committed: its git status changed


@pytest.fixture(scope="module")
def worker(start_worker, tmp_path_factory):
    model = make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "qwen2.gguf", seed=1)
    w = start_worker("--ctx", "4096", "--kv-mem", "32MiB", "--max-seqs", "2", model=model)
    yield w
    w.stop()


def test_a_rewritten_system_prompt_names_its_message_and_the_report_adds_it_up(worker, openai_factory, capsys):
    import anthropic

    client = openai_factory(worker)
    ask = {"model": "m", "max_tokens": 8, "temperature": 0}
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the changed files."}]
    answer = client.chat.completions.create(messages=first, **ask).choices[0].message.content or ""
    second = [{"role": "system", "content": CHANGED}, first[1], {"role": "assistant", "content": answer},
              {"role": "user", "content": "Now run the tests."}]
    client.chat.completions.create(messages=second, **ask)
    other = [{"role": "system", "content": CHANGED}, {"role": "user", "content": "Something else entirely: "
              "summarise the README for a newcomer, with its install steps and first commands."}]
    client.chat.completions.create(messages=other, **ask)
    claude = anthropic.Anthropic(base_url=worker.url, api_key=worker.api_key, max_retries=0, timeout=120)
    claude.messages.create(model="m", max_tokens=8, system=CHANGED, messages=[{"role": "user", "content": "Hi."}])

    turns = [r for r in worker.events(Event.ADMIT) if not r.get("probe")]
    assert len(turns) == 4
    one, two, three, four = turns
    assert all(r["user_agent"].startswith("OpenAI/Python") for r in (one, two, three))
    assert four["user_agent"].startswith("Anthropic/Python") and four["protocol"] == "messages"
    assert two["miss_cause"] == MissCause.CHANGED_TEXT
    assert two["diverged_message"] == {"index": 0, "role": "system"}
    change = len("<|im_start|>system\n") + SYSTEM.index("M README.md")  # in the rendered prompt
    assert change - 64 <= two["diverged_char"] <= change  # the first token of the block that holds the change
    assert two["cached_tokens"] == two["diverged_at"] and two["could_have_cached"] > two["cached_tokens"]
    base = {"ts", "level", "event", "request_id", "seq", "protocol", "prompt_tokens", "cached_tokens", "new_tokens"}
    assert set(two) - base == set(ADMIT_MISS_FIELDS) - {"evicted_from"} | {ADMIT_CLIENT_FIELD}  # the contract's names
    assert not set(ADMIT_MISS_FIELDS) & set(three) and three["cached_tokens"] > 0  # a new conversation: no miss

    assert cli.main(["cache", "report", "--log", str(worker.log_path), "--json"]) == ExitCode.OK
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] == 4 and r["cached_tokens"] == sum(t["cached_tokens"] for t in turns)
    assert {p["name"]: p["requests"] for p in r["by_protocol"]} == {"chat": 3, "messages": 1}
    assert {c["name"]: c["requests"] for c in r["by_client"]} == {"OpenAI": 3, "Anthropic": 1}
    [cause] = r["reprefilled_by_cause"]
    assert cause == {"cause": "changed_text", "admits": 1, "tokens": two["could_have_cached"] - two["cached_tokens"]}
    [point] = r["divergence_points"]
    assert point["message"] == "#0 system" and point["median_char"] == two["diverged_char"]
    assert r["new_tokens"] == r["reprefilled_tokens"] + r["first_seen_tokens"]

    assert cli.main(["cache", "report", "--log", str(worker.log_path)]) == ExitCode.OK
    text = capsys.readouterr().out
    assert "by client (user agent)" in text and "changed_text" in text and "#0 system" in text
    print(text)  # the sample in the report (pytest -s)


# -- the report's own rules ------------------------------------------------------------------------------------


def _admit(ago: float, rid: str, **fields) -> str:
    rec = json.loads(log_line(Event.ADMIT, request_id=rid, seq=1, **fields))
    rec["ts"] = (datetime.now(UTC) - timedelta(seconds=ago)).isoformat(timespec="milliseconds")
    return json.dumps(rec)


def test_the_report_leaves_out_probes_and_older_lines_and_reads_rotations(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker.log.2").write_text(_admit(7200, "old", protocol="chat", prompt_tokens=100, cached_tokens=0,
                                              new_tokens=100) + "\n")
    (logs / "worker.log.1").write_text("\n".join([
        "a line that is no JSON record",
        _admit(60, "probe", protocol="completions", prompt_tokens=5, cached_tokens=0, new_tokens=5, probe=True),
        _admit(50, "a", protocol="chat", prompt_tokens=1000, cached_tokens=800, new_tokens=200,
               user_agent="claude-cli/1.0.3 (external, cli)"),
    ]) + "\n")
    (logs / "worker.log").write_text(_admit(10, "b", protocol="messages", prompt_tokens=1000, cached_tokens=0,
                                            new_tokens=1000, user_agent="claude-cli/1.0.3 (external, cli)",
                                            miss_cause="evicted", evicted_from="disk", diverged_at=0,
                                            could_have_cached=960, diverged_char=0,
                                            diverged_message={"index": 0, "role": "system"}) + "\n")
    assert [p.name for p in cache_report.log_files(logs)] == ["worker.log.2", "worker.log.1", "worker.log"]
    assert cli.main(["cache", "report", "--log", str(logs), "--since", "1h", "--json"]) == ExitCode.OK
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] == 2 and r["prompt_tokens"] == 2000 and r["cached_tokens"] == 800  # no probe, no "old"
    assert r["by_client"] == [{"name": "claude-cli", "requests": 2, "warm": 1, "prompt_tokens": 2000,
                               "cached_tokens": 800, "cached_share": 0.4}]
    assert r["reprefilled_by_cause"] == [{"cause": "evicted (disk)", "admits": 1, "tokens": 960}]
    assert r["reprefilled_tokens"] == 960 and r["first_seen_tokens"] == 240
    assert cli.main(["cache", "report", "--log", str(logs)]) == ExitCode.OK  # all three files
    assert "3 requests admitted" in capsys.readouterr().out


def test_a_missing_log_and_a_bad_duration_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV_STATE_DIR, str(tmp_path))  # the daemon's place: nothing there yet
    assert cli.main(["cache", "report"]) == ExitCode.FAILURE
    assert f"no worker log at {tmp_path / 'logs' / 'worker.log'}" in capsys.readouterr().err
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker.log").write_text("")
    assert cli.main(["cache", "report", "--since", "5 fortnights"]) == ExitCode.USAGE
    assert "is not a duration" in capsys.readouterr().err
    assert cli.main(["cache", "report"]) == ExitCode.OK
    assert "no admitted requests" in capsys.readouterr().out
