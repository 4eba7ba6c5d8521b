"""installer/kubernetes/ember.yaml: valid against the Kubernetes schemas (kubernetes-validate, strict:
no unknown fields), its probes on the worker's contract paths, its config a valid worker config, and
the router pointed at the workers' port."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ember.ops import contract
from ember.worker import config as worker_config

MANIFEST = Path(__file__).resolve().parent.parent / "installer" / "kubernetes" / "ember.yaml"
DOCS = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
BY_KIND = {(d["kind"], d["metadata"]["name"]): d for d in DOCS}


@pytest.mark.parametrize("doc", DOCS, ids=[f"{d['kind']}-{d['metadata']['name']}" for d in DOCS])
def test_every_resource_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_worker_pods_probe_the_contract_and_hold_one_gpu_each():
    sts = BY_KIND[("StatefulSet", "ember-worker")]
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == contract.LIVE_PATH
    assert c["startupProbe"]["httpGet"]["path"] == contract.LIVE_PATH
    assert c["readinessProbe"]["httpGet"]["path"] == contract.READY_PATH
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > worker_config.WorkerConfig().drain_seconds
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert "state" in claims  # each worker's KV directory outlives its restarts


def test_the_config_map_is_a_valid_worker_config():
    toml = BY_KIND[("ConfigMap", "ember-config")]["data"]["ember.toml"]
    cfg = worker_config.WorkerConfig(**tomllib.loads(toml)["worker"])
    worker_config.validate(cfg)
    assert cfg.host == "0.0.0.0" and cfg.kv_dir.startswith("/var/lib/ember")


def test_the_router_finds_the_workers_on_their_port():
    dep = BY_KIND[("Deployment", "ember-router")]
    [c] = dep["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    port = args[args.index("--service-discovery-port") + 1]
    worker = BY_KIND[("Service", "ember-worker")]["spec"]["ports"][0]["port"]
    assert int(port) == worker and args[args.index("--policy") + 1] == "cache_aware"
    assert args[args.index("--health-check-endpoint") + 1] == contract.READY_PATH
    assert ("Role", "ember-router") in BY_KIND  # service discovery reads the pods
