"""The worker's metrics: Prometheus text at /metrics, the same figures as JSON at /v1/stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ember.ops.contract import OUTCOMES, PersistState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.started = Counter("ember_requests_started", "Requests admitted to the queue", registry=r)
        self.outcomes = Counter("ember_requests", "Requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.outcomes.labels(o)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("ember_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("ember_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Time from arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ember_inter_token_latency_seconds", "Time between tokens of one stream",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("ember_engine_steps", "Engine steps run", registry=r)
        # the steps decoding streams waited on, against the decode-latency target (engine/cost_sampling.py)
        self.step_seconds = Histogram("ember_step_seconds", "Time of the engine's steps with decoding streams, "
                                      "by what they carried (decode, or decode+prefill)", ["kind"],
                                      buckets=_STEP_BUCKETS, registry=r)
        for kind in ("decode", "decode+prefill"):
            self.step_seconds.labels(kind)
        self.steps_over_target = Counter("ember_steps_over_itl_target", "Steps with decoding streams that took "
                                         "longer than --itl-target-ms", registry=r)
        self.spec_drafted = Counter("ember_spec_drafted_tokens", "Draft tokens checked by speculative decoding",
                                    registry=r)
        self.spec_accepted = Counter("ember_spec_accepted_tokens", "Draft tokens that stood", registry=r)
        self.spec_steps = Counter("ember_spec_verify_steps", "Sequence steps that carried a draft", registry=r)
        self.spec_seconds = Counter("ember_spec_seconds", "Host time spent drafting and verifying", ["phase"],
                                    registry=r)
        self.queue_depth = Gauge("ember_queue_depth", "Requests waiting for a slot", registry=r)
        self.running = Gauge("ember_running_sequences", "Sequences in the running batch", registry=r)
        self.kv_blocks_total = Gauge("ember_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_blocks_used = Gauge("ember_kv_blocks_used", "KV blocks referenced by sequences", registry=r)
        self.kv_blocks_cached = Gauge("ember_kv_blocks_cached", "Unreferenced KV blocks kept for prefix reuse",
                                      registry=r)
        self.kv_usage = Gauge("ember_kv_usage_ratio", "Share of KV blocks referenced by sequences", registry=r)
        self.slow_clients = Counter("ember_http_slow_clients", "Connections closed for sending a request too slowly "
                                    "(phase: head, body, or evicted past --max-slow-connections)", ["phase"],
                                    registry=r)
        for phase in ("head", "body", "evicted"):
            self.slow_clients.labels(phase)
        self.restore_choices = Counter("ember_kv_restore_choices", "Warm admits whose stored blocks were restored "
                                       "or computed again (whichever measured faster)", ["choice"], registry=r)
        self._threads = _ThreadCollector()
        r.register(self._threads)

    def attach_threads(self, watch) -> None:
        """Export a ThreadWatch's deaths (ember_thread_deaths_total{thread}), read at scrape time."""
        if all(w is not watch for w in self._threads.watches):
            self._threads.watches.append(watch)

    def attach_store(self, store) -> None:
        """Export the KV store's figures, read at scrape time."""
        self.registry.register(_StoreCollector(store))

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """The same figures as /metrics, as one JSON-able dict."""
        out: dict = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                if s.name.endswith("_bucket"):
                    continue
                key = s.name + "".join(f"_{v}" for v in s.labels.values())
                out[key] = s.value
        return out


class _ThreadCollector:
    def __init__(self):
        self.watches: list = []

    def collect(self):
        family = CounterMetricFamily("ember_thread_deaths", "Worker threads that died of an exception",
                                     labels=["thread"])
        deaths: dict[str, int] = {}
        for w in self.watches:
            for name, n in list(w.deaths.items()):
                deaths[name] = deaths.get(name, 0) + n
        for name, n in sorted(deaths.items()):
            family.add_metric([name], n)
        yield family


class _StoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        st = self.store.stats
        yield GaugeMetricFamily("ember_kv_disk_bytes", "Bytes of this KV layout's block files on disk",
                                value=self.store.disk_bytes)
        yield GaugeMetricFamily("ember_kv_dir_bytes", "Bytes under the KV dir counted against the disk budget "
                                "(every model and layout, and quarantine)", value=self.store.dir_bytes)
        yield GaugeMetricFamily("ember_kv_disk_budget_bytes", "The KV dir's disk budget", value=self.store.disk_budget)
        yield GaugeMetricFamily("ember_kv_disk_blocks", "KV block files on disk", value=self.store.disk_blocks)
        yield GaugeMetricFamily("ember_kv_write_queue_depth", "KV blocks waiting to be written",
                                value=self.store.write_queue_depth)
        p = self.store.persistence
        yield GaugeMetricFamily("ember_kv_persistence_degraded", "1 while KV writes to disk fail and are retried "
                                "(the disk is full, the directory is gone...): nothing new persists",
                                value=1 if p.state == PersistState.DEGRADED else 0)
        for name, doc, value in [
            ("ember_kv_writes", "KV blocks written to disk", st.writes),
            ("ember_kv_write_drops", "KV blocks not persisted: their request ended before the writer had room",
             st.write_drops),
            ("ember_kv_not_persisted", "KV blocks not persisted because writing to disk failed (degraded)",
             p.not_persisted_total),
            ("ember_kv_restore_hits", "KV blocks restored from the host tier or disk", st.restore_hits),
            ("ember_kv_restore_misses", "KV block restores that found nothing usable", st.restore_misses),
            ("ember_kv_quarantined", "KV block files moved to quarantine", st.quarantined),
            ("ember_kv_evictions", "KV block files evicted for the disk budget", st.evictions),
            ("ember_kv_dir_evictions", "Whole KV directories of other models or layouts evicted for the budget",
             st.dir_evictions),
            ("ember_kv_restore_seconds", "Time spent reading KV blocks for restores", st.restore_seconds),
            ("ember_kv_restore_bytes", "Bytes of KV restored", st.restore_bytes),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
