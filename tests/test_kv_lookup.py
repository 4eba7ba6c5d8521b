"""POST /v1/kv/lookup on a real worker: of a token sequence's full blocks, how many its KV store holds on
disk (what a restart would find) and can supply now; refused without the API key and for bad ids."""

from __future__ import annotations

import time

import httpx

ARGS = ("--ctx", "1024", "--kv-mem", "64MiB", "--max-seqs", "2")


def _lookup(w, tokens: list[int], headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{w.url}/v1/kv/lookup", json={"tokens": tokens}, headers=w.headers() if headers is None
                      else headers, timeout=30)


def test_a_completed_prompt_is_found_on_disk_and_a_new_one_is_not(start_worker, tmp_path):
    w = start_worker(*ARGS, "--kv-dir", str(tmp_path / "kv"))
    text = "The lighthouse keeper counted the candles, checked the lamp and wound the clock. " * 6
    ids = httpx.post(f"{w.url}/tokenize", json={"content": text, "add_special": True}, headers=w.headers(),
                     timeout=30).json()["tokens"]
    before = _lookup(w, ids).json()
    bs = before["block_size"]
    assert before == {"tokens": len(ids), "block_size": bs, "full_blocks": len(ids) // bs, "on_disk": 0,
                      "stored": 0, "persistence": True}
    r = httpx.post(f"{w.url}/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0},
                   headers=w.headers(), timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while (got := _lookup(w, ids).json())["on_disk"] < got["full_blocks"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the writer lands the prompt's blocks behind the answer
    assert got["on_disk"] == got["full_blocks"] > 0 and got["stored"] == got["full_blocks"], got
    # the same head with another tail: the shared blocks only
    other = ids[: 2 * bs] + [t + 1 for t in ids[2 * bs :]]
    assert _lookup(w, other).json()["on_disk"] == 2
    assert _lookup(w, [ids[0] + 1, *ids[1:]]).json()["on_disk"] == 0


def test_the_lookup_takes_the_api_key_and_refuses_bad_ids(start_worker):
    w = start_worker(*ARGS)  # no --kv-dir: a store in the default state dir, persisting
    assert _lookup(w, [1, 2, 3], headers={}).status_code == 401
    bad = _lookup(w, [1, -2])
    assert bad.status_code == 400 and "not negative" in bad.text
    assert httpx.post(f"{w.url}/v1/kv/lookup", json={"tokens": "abc"}, headers=w.headers(),
                      timeout=30).status_code == 400
    assert httpx.post(f"{w.url}/v1/kv/lookup", json={"tokens": [1], "x": 1}, headers=w.headers(),
                      timeout=30).status_code == 400
    off = start_worker(*ARGS, "--kv-persist", "off")
    r = _lookup(off, list(range(40))).json()
    assert r["persistence"] is False and r["on_disk"] == 0 and r["full_blocks"] == 40 // r["block_size"]
