"""The cache accounting of an agent session (agent_session.py): per turn, the share of prompt tokens
the server served from its cache, and over the session the tokens it prefilled again. Pure over the
proxy's exchanges and, for ember, its JSON log; no I/O but what the caller hands in.

The rule, one for every client and server:
- A request to the client's protocol path that offers tools is the agent's own loop: it continues the
  conversation. One without tools (OpenCode's title, any summary) is a side request: counted and
  shown apart, never judged, since its prompt does not continue the conversation.
- A turn's cached share is the sum of its conversation requests' cached prompt tokens over the sum of
  their prompt tokens. A turn makes one request or several (a forced tool call, then the answer over
  its result; a client's retry), and every one of them counts: what the agent waits for is the turn.
- Prefilled after the first request: every prompt token of the session's conversation requests that
  was not served from cache, but the session's first request's (cold on any server). New tokens (the
  new user message, a tool's result) count too: a server cannot have them cached, so the figure is
  what it prefilled, and the gap between two servers is what one re-prefilled and the other did not.
Where the numbers come from: each response's own usage (what any client sees; llama-server's too), or
ember's log (`admit`: prompt_tokens, cached_tokens, by request id), which the tests hold to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from .agent_proxy import Exchange, Usage
from .agent_session import TurnResult

TARGET_SHARE = 0.95  # issue 43: turns 2 and later, the turns right after a restart too
TARGET_RATIO = 0.5  # issue 43: ember prefills at most half of what llama-server does over the same session


@dataclass(frozen=True)
class Request:
    index: int  # its place among the session's model calls
    turn: int | None
    request_id: str | None
    conversation: bool  # offers tools: the agent's own loop
    forced: str | None
    answer: bool
    status: int
    prompt_tokens: int | None  # None: no count (a request the client abandoned before the server said)
    cached_tokens: int | None

    @property
    def prefilled(self) -> int | None:
        return None if self.prompt_tokens is None or self.cached_tokens is None \
            else self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class TurnRow:
    turn: int
    restart: str | None
    requests: int  # conversation requests
    prompt_tokens: int
    cached_tokens: int
    side_requests: int
    side_prompt_tokens: int
    side_cached_tokens: int
    uncounted: int  # conversation requests without a count

    @property
    def share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def requests_of(exchanges: Iterable[Exchange], protocol_path: str,
                counts: dict[str, Usage] | None = None) -> list[Request]:
    """The session's model calls in order. `counts` (request id -> usage, ember's log) replaces the
    responses' own usage where given."""
    out = []
    calls = [e for e in exchanges if e.method == "POST" and protocol_path in e.path]
    for i, e in enumerate(calls):
        rid = e.request_id
        u = counts.get(rid) if counts is not None and rid is not None else None
        if counts is None:
            u = e.usage()
        out.append(Request(i, e.turn, rid, bool(e.tools), e.forced, e.answer, e.status,
                           u.prompt_tokens if u else None, u.cached_tokens if u else None))
    return out


def turn_rows(requests: list[Request], turns: list[TurnResult]) -> list[TurnRow]:
    rows = []
    for t in turns:
        mine = [r for r in requests if r.turn == t.turn]
        conv = [r for r in mine if r.conversation and r.prompt_tokens is not None]
        side = [r for r in mine if not r.conversation and r.prompt_tokens is not None]
        rows.append(TurnRow(t.turn, t.restart, len(conv), sum(r.prompt_tokens or 0 for r in conv),
                            sum(r.cached_tokens or 0 for r in conv), len(side), sum(r.prompt_tokens or 0 for r in side),
                            sum(r.cached_tokens or 0 for r in side),
                            sum(1 for r in mine if r.conversation and r.prompt_tokens is None)))
    return rows


def totals(requests: list[Request], rows: list[TurnRow]) -> dict:
    conv = [r for r in requests if r.conversation and r.prompt_tokens is not None]
    first, rest = (conv[0], conv[1:]) if conv else (None, [])
    later = [row for row in rows if row.turn >= 2 and row.share is not None]
    shares = [row.share for row in later if row.share is not None]  # (the filter above, for the type checker)
    after_restart = {row.turn for row in rows if row.restart}
    return {
        "requests": len(conv),
        "side_requests": sum(1 for r in requests if not r.conversation),
        "uncounted": sum(1 for r in requests if r.conversation and r.prompt_tokens is None),
        "first_prompt_tokens": first.prompt_tokens if first else None,
        "prompt_tokens_after_first": sum(r.prompt_tokens or 0 for r in rest),
        "prefilled_after_first": sum(r.prefilled or 0 for r in rest),
        "prefilled_after_restarts": sum(row.prefilled for row in rows if row.turn in after_restart),
        "lowest_share_turn_2_on": min(shares, default=None),
        "target_share": TARGET_SHARE,
        "target_met": bool(shares) and all(share >= TARGET_SHARE for share in shares),
    }


def report(client: str, server: dict, requests: list[Request], turns: list[TurnResult], source: str) -> dict:
    """The session as one JSON object (`ember bench agents --json`; --compare reads two)."""
    rows = turn_rows(requests, turns)
    return {"kind": "agent-session", "client": client, "server": server, "counts_from": source,
            "turns": [{**asdict(row), "share": row.share, "seconds": round(t.seconds, 1), "ok": t.ok,
                       "failure": t.failure} for row, t in zip(rows, turns, strict=True)],
            "requests": [asdict(r) for r in requests], "totals": totals(requests, rows)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(rep: dict) -> str:
    """Per turn: what happened before it, requests, prompt and cached tokens, share; then the totals."""
    lines = [f"{rep['client']} against {rep['server'].get('server', '?')} ({rep['server'].get('model', '?')}); "
             f"counts from {rep['counts_from']}",
             f"{'turn':>4}  {'before':<8} {'reqs':>4} {'prompt':>8} {'cached':>8} {'share':>7} {'prefilled':>9}"
             f"  side requests (prompt/cached)  seconds"]
    for t in rep["turns"]:
        side = f"{t['side_requests']} ({t['side_prompt_tokens']}/{t['side_cached_tokens']})" if t["side_requests"] \
            else "-"
        lines.append(f"{t['turn']:>4}  {t['restart'] or '':<8} {t['requests']:>4} {t['prompt_tokens']:>8} "
                     f"{t['cached_tokens']:>8} {_pct(t['share']):>7} {t['prompt_tokens'] - t['cached_tokens']:>9}  "
                     f"{side:<29}  {t['seconds']:>7}" + ("" if t["ok"] else f"  FAILED: {t['failure']}"))
    s = rep["totals"]
    lines += [f"first request {s['first_prompt_tokens']} prompt tokens (cold); after it {s['requests'] - 1} requests, "
              f"{s['prompt_tokens_after_first']} prompt tokens, {s['prefilled_after_first']} prefilled "
              f"({s['prefilled_after_restarts']} on the turns after a restart)",
              f"lowest share from turn 2 on: {_pct(s['lowest_share_turn_2_on'])} "
              f"(target >= {_pct(s['target_share'])}: {'met' if s['target_met'] else 'MISSED'})"]
    if s["uncounted"]:
        lines.append(f"{s['uncounted']} conversation requests without a count (abandoned before the server said)")
    return "\n".join(lines)


def compare(a: dict, b: dict) -> dict:
    """A beside B (issue 43 item 4: ember against llama-server over the same session): per turn the
    shares, and A's prefilled tokens after the first request over B's, against TARGET_RATIO."""
    pa, pb = a["totals"]["prefilled_after_first"], b["totals"]["prefilled_after_first"]
    ratio = pa / pb if pb else None
    turns = [{"turn": x["turn"], "restart": x["restart"], "share_a": x["share"], "share_b": y["share"],
              "prefilled_a": x["prompt_tokens"] - x["cached_tokens"],
              "prefilled_b": y["prompt_tokens"] - y["cached_tokens"]}
             for x, y in zip(a["turns"], b["turns"], strict=False)]
    return {"a": a["server"], "b": b["server"], "client": a["client"], "turns": turns,
            "prefilled_after_first_a": pa, "prefilled_after_first_b": pb, "ratio": ratio,
            "target_ratio": TARGET_RATIO, "target_met": ratio is not None and ratio <= TARGET_RATIO,
            "same_client": a["client"] == b["client"], "same_turns": len(a["turns"]) == len(b["turns"])}


def compare_table(c: dict) -> str:
    name = lambda s: f"{s.get('server', '?')} ({s.get('model', '?')})"  # noqa: E731
    lines = [f"{c['client']} session: A = {name(c['a'])}, B = {name(c['b'])}",
             f"{'turn':>4}  {'before':<8} {'A share':>8} {'B share':>8} {'A prefilled':>12} {'B prefilled':>12}"]
    for t in c["turns"]:
        lines.append(f"{t['turn']:>4}  {t['restart'] or '':<8} {_pct(t['share_a']):>8} {_pct(t['share_b']):>8} "
                     f"{t['prefilled_a']:>12} {t['prefilled_b']:>12}")
    ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
    lines.append(f"prefilled after the first request: A {c['prefilled_after_first_a']}, "
                 f"B {c['prefilled_after_first_b']}; A/B {ratio} "
                 f"(target <= {c['target_ratio']}: {'met' if c['target_met'] else 'MISSED'})")
    if not (c["same_client"] and c["same_turns"]):
        lines.append("note: the two sessions differ (client or number of turns)")
    return "\n".join(lines)


# -- ember's log ----------------------------------------------------------------------------------------------


def log_records(texts: Iterable[str]) -> list[dict]:
    out = []
    for text in texts:
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def admitted(records: list[dict]) -> dict[str, Usage]:
    """request id -> its prompt and cached tokens, from ember's `admit` lines."""
    return {r["request_id"]: Usage(int(r["prompt_tokens"]), int(r["cached_tokens"]))
            for r in records if r.get("event") == "admit" and r.get("request_id")}


def restored(records: list[dict]) -> dict[str, int]:
    """request id -> the tokens its KV came back with from the block store (`kv_restore` lines)."""
    out: dict[str, int] = {}
    for r in records:
        if r.get("event") == "kv_restore" and r.get("request_id"):
            out[r["request_id"]] = out.get(r["request_id"], 0) + int(r.get("tokens") or 0)
    return out
