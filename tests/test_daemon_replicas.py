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
    # ready means routed: the router's own health checks have passed for both (its /health says 200 before)
    assert st["router"]["healthy_replicas"] == st["router"]["replicas"] == 2, st["router"]
    with httpx.Client(base_url=ember.url, timeout=60) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert c.get(f"http://127.0.0.1:{ember.port + 1}/health/ready").status_code == 200

    text = ember.run("status").stdout
    assert "replica-0" in text and "replica-1" in text and "routes to 2 of 2" in text, text

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
    # its metrics port is checked free before each start, like its own (taken, sglang-router panics)
    assert "--prometheus-port 9003" in cmd and router[router.index("--also-listens") + 1] == "127.0.0.1:9003"
    # a member reads the same file and runs one worker (or the router), never a fleet of its own
    assert not load(env={"EMBER_CONFIG": str(cfg), "EMBER_REPLICA": "replica-0"}).fleet
    for bad, why in (('gpus = "0,0"', "distinct"), ("replicas = 0", "1 to 64"),
                     ('replicas = 2\ncommand = "llama-server"\nhealth_url = "http://x/health"', "runs alone"),
                     ('replicas = 2\nrouter_policy = "lru"', "router_policy")):
        cfg.write_text(f"[daemon]\n{bad}\n")
        with pytest.raises(SettingsError, match=why):
            s = load(env={"EMBER_CONFIG": str(cfg)})
            fleet.plan(s, Layout(tmp_path / "state"))


def test_the_fleet_is_ready_only_once_the_router_routes_to_every_replica(tmp_path):
    """sglang-router's /health answers 200 as soon as it listens; a request then gets 503 until its own
    health check of a replica passes (seen in CI). The fleet counts the router ready from its /workers."""
    from ember.daemon import fleet
    from ember.daemon.paths import Layout
    from ember.daemon.settings import load

    cfg = tmp_path / "ember.toml"
    cfg.write_text("[daemon]\nreplicas = 2\n")
    f = fleet.Fleet(load(env={"EMBER_CONFIG": str(cfg)}), Layout(tmp_path / "state"))
    f.seen = {m.name: {"state": "ready", "worker": {"pid": 1}} for m in f.members}
    f.routing = {"healthy_replicas": 1, "replicas": 2}
    st = f.status()
    assert st["state"] == "starting" and "router starting (routes to 1 of 2 replicas)" in st["not_ready_reason"]
    f.routing = {"error": "connection refused"}
    assert f.status()["router"]["not_ready_reason"] == "connection refused"
    f.routing = {"healthy_replicas": 2, "replicas": 2}
    st = f.status()
    assert st["state"] == "ready" and st["not_ready_reason"] is None and st["router"]["healthy_replicas"] == 2
    f._ready_told = True  # once ready, a replica the router dropped makes the fleet not ready
    f.routing = {"healthy_replicas": 1, "replicas": 2}
    assert f.status()["state"] == "not-ready"


def test_router_view_reads_the_real_routers_worker_list(tmp_path):
    """A real sglang-router whose replica's port is closed lists no worker (it registers one after its
    first health check passes); once something there answers /health, it lists it healthy."""
    import subprocess
    import sys

    from test_daemon_support import free_port

    from ember.daemon import fleet
    from ember.daemon.settings import load

    port, replica = free_port(), free_port()
    cfg = tmp_path / "ember.toml"
    cfg.write_text(f"[worker]\nport = {port}\n")
    s = load(env={"EMBER_CONFIG": str(cfg)})
    assert "error" in fleet.router_view(s)  # nothing listens yet
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")  # GET /health -> 200 from a plain file server
    procs = [subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--worker-urls", f"http://127.0.0.1:{replica}", "--log-level", "warn"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        def wait_for(want: dict) -> dict:
            deadline = time.monotonic() + 60
            while (view := fleet.router_view(s)) != want and time.monotonic() < deadline:
                time.sleep(0.2)
            return view

        assert wait_for({"healthy_replicas": 0, "replicas": 0}) == {"healthy_replicas": 0, "replicas": 0}
        procs.append(subprocess.Popen([sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-d",
                                       str(tmp_path / "www"), str(replica)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        assert wait_for({"healthy_replicas": 1, "replicas": 1}) == {"healthy_replicas": 1, "replicas": 1}
    finally:
        for p in procs:
            p.kill()
            p.wait()
