"""`[daemon] replicas = 2` through the real CLI (daemon/fleet.py): two numpy workers, each under a
daemon and supervisord of its own, behind sglang-router on the public port. A worker killed with
SIGKILL is archived and restarted by its own daemon (its bundle names the replica), the router routes
around it meanwhile, `ember status` and `ember crashes list --all-replicas` show each member, and
`ember stop` leaves no process behind."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_daemon_support import kill

pytest.importorskip("sglang_router", reason="sglang-router is not installed (the test extra installs it)")

WORKER = {"max_seqs": 2, "ctx": 1024, "kv_mem": "96MiB", "drain_seconds": 2}
CHAT = {"model": "ember", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 4}


def test_two_replicas_behind_the_router(ember):
    # the daemons' default patience (two workers, a router and three daemons share the CI's two cores)
    ember.configure(worker=WORKER, fast=False, replicas=2, tick="0.1s", startup_poll="0.1s", ready_interval="0.5s",
                    backoff_base="0.2s", stop_timeout="10s")
    r = ember.start(timeout=240)
    assert r.returncode == 0, r.stderr + r.stdout
    st = ember.status()
    assert st["state"] == "ready" and st["worker"]["engine"] == "replicas"
    names = [m["name"] for m in st["replicas"]]
    assert names == ["replica-0", "replica-1"] and st["router"]["port"] == ember.port
    ports = {m["port"] for m in st["replicas"]}
    assert ports == {ember.port + 1, ember.port + 2}
    for m in st["replicas"]:  # each its own state dir, its own worker
        assert m["state"] == "ready" and m["pid"] and m["state_dir"].endswith(f"replicas/{m['name']}")
    with httpx.Client(base_url=ember.url, timeout=60) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.get(f"http://127.0.0.1:{ember.port + 1}/health/ready").status_code == 200

    text = ember.run("status").stdout
    assert "replica-0" in text and "replica-1" in text and "router" in text, text

    victim = st["replicas"][0]
    kill(victim["pid"])  # SIGKILL replica-0's worker
    sent_after = []
    with httpx.Client(base_url=ember.url, timeout=60) as c:
        for _ in range(6):  # the router routes around it while its daemon restarts it
            sent_after.append(c.post("/v1/chat/completions", json=CHAT).status_code)
            time.sleep(0.5)
    assert sent_after == [200] * 6, sent_after
    st = ember.wait(lambda s: s["state"] == "ready" and s["replicas"][0]["restarts"] >= 1
                    and s["replicas"][0]["pid"] != victim["pid"], timeout=90, what="replica-0 restarted")
    assert st["replicas"][1]["restarts"] == 0

    crashes = ember.run("crashes", "list", "--all-replicas", "--json")
    rows = json.loads(crashes.stdout)
    assert [r["replica"] for r in rows] == ["replica-0"], rows
    bundle = ember.state / "replicas" / "replica-0" / "crashes" / rows[0]["id"] / "meta.json"
    meta = json.loads(bundle.read_text())
    assert meta["worker"]["replica"] == "replica-0" and meta["signal"] == "SIGKILL"
    table = ember.run("crashes", "list", "--all-replicas").stdout
    assert "REPLICA" in table and "replica-0" in table


def test_the_fleet_plan_ports_gpus_and_environments(tmp_path):
    """Which members a fleet runs, on which ports and GPUs, with which environment (no processes)."""
    from ember.daemon import fleet
    from ember.daemon.paths import Layout
    from ember.daemon.settings import SettingsError, load

    cfg = tmp_path / "ember.toml"
    cfg.write_text('[worker]\nport = 9000\nkv_dir = "/srv/kv"\n[daemon]\ngpus = "0,2"\nrouter_policy = "round_robin"\n')
    s = load(env={"EMBER_CONFIG": str(cfg)})
    assert s.fleet
    members = fleet.plan(s, Layout(tmp_path / "state"))
    assert [(m.name, m.port, m.gpu) for m in members] == [("replica-0", 9001, "0"), ("replica-1", 9002, "2"),
                                                          ("router", 9000, None)]
    env = fleet.member_env(s, members[1], env={"NOTIFY_SOCKET": "/run/x", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["EMBER_KV_DIR"] == "/srv/kv/replica-1"
    assert env["EMBER_REPLICA"] == "replica-1" and env["EMBER_STATE_DIR"].endswith("replicas/replica-1")
    assert "NOTIFY_SOCKET" not in env  # systemd hears from the fleet daemon alone
    router = fleet.member_argv(s, members[2], members)
    cmd = router[router.index("--command") + 1]
    assert "--policy round_robin" in cmd and "http://127.0.0.1:9001 http://127.0.0.1:9002" in cmd
    assert router[router.index("--completions-url") + 1] == ""
    # a member reads the same file and runs one worker (or the router), never a fleet of its own
    assert not load(env={"EMBER_CONFIG": str(cfg), "EMBER_REPLICA": "replica-0"}).fleet
    for bad, why in (('gpus = "0,0"', "distinct"), ("replicas = 0", "1 to 64"),
                     ('replicas = 2\ncommand = "llama-server"\nhealth_url = "http://x/health"', "runs alone"),
                     ('replicas = 2\nrouter_policy = "lru"', "router_policy")):
        cfg.write_text(f"[daemon]\n{bad}\n")
        with pytest.raises(SettingsError, match=why):
            s = load(env={"EMBER_CONFIG": str(cfg)})
            fleet.plan(s, Layout(tmp_path / "state"))
