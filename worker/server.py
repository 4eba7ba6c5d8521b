"""`ember worker`: load the model, start the engine, serve HTTP, and stop by the contract.

Exit codes (docs/architecture.md, "The contracts"; ops/contract.ExitCode): 0 clean stop; 75 poisoned
compute context (restart now); 78 configuration error (do not restart); 69 the port is held by
another process (listen.py; the daemon retries with backoff). The port is bound before anything
loads. SIGTERM drains: readiness turns `draining`, admissions stop, in-flight work gets
--drain-seconds to finish, then exit 0; a second SIGTERM exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from ember.ops.contract import Event, ExitCode, HealthState

from . import config as worker_config
from . import listen
from .logs import log

if TYPE_CHECKING:
    import socket

    import uvicorn

    from .backends.base import Backend
    from .backends.faults import FaultInjector
    from .engine.spec.drafters import Drafter

EX_OK, EX_POISONED, EX_CONFIG = ExitCode.OK, ExitCode.POISONED, ExitCode.CONFIG
POISON_FLUSH_SECONDS = 0.5  # time for in-flight streams to send their error events


def kv_blocks_for(cfg_kv_mem: str, model_config, block_size: int, backend: str = "numpy",
                  mtp: bool = False, drafter_width: int = 0) -> int | None:
    """The KV pool's blocks for --kv-mem (None: auto on CUDA, where the backend sizes the pool itself
    from the device's free memory once everything else is allocated). mtp: the numpy pool keeps the
    next-token layer's rows too; drafter_width: and this many floats a position of a block drafter's."""
    if backend == "cuda":  # float16 KV on the device
        if cfg_kv_mem == "auto":
            return None
        from .backends.cuda.backend import CudaBackend
        from .backends.cuda.hyper import CudaHyperBackend

        per_block = (CudaHyperBackend.kv_bytes_per_block(model_config, block_size, mtp, drafter_width)
                     if model_config.hyper is not None else CudaBackend.kv_bytes_per_block(model_config, block_size))
    else:
        from .backends.numpy.backend import NumpyBackend

        if cfg_kv_mem == "auto":
            cfg_kv_mem = worker_config.NUMPY_AUTO_KV_MEM
        per_block = NumpyBackend.kv_bytes_per_block(model_config, block_size, mtp, drafter_width)
    return max(4, worker_config.parse_size(cfg_kv_mem, "kv_mem") // per_block)


def _version() -> str:
    try:
        return version("ember")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _draft_backend(kind: str, model, n_blocks: int, block_size: int, gpu_mem: int | None = None):
    """The backend a draft model (--spec draft:PATH) runs on: the target's kind, a KV pool of its own."""
    if kind == "cuda":
        from .backends.cuda import open_backend

        return open_backend(model.config, model.gguf, n_blocks=n_blocks, block_size=block_size, gpu_mem=gpu_mem)
    from .backends.numpy.backend import NumpyBackend
    from .model.weights import load_weights

    return NumpyBackend(model.config, load_weights(model.gguf, model.config), n_blocks=n_blocks, block_size=block_size)


class _Loaded:
    """What loading produces: the engine over the model, its formats, and the facts `ready` reports."""

    def __init__(self, engine, model, store, facts: dict, formats=None):
        self.engine, self.model, self.store, self.facts, self.formats = engine, model, store, facts, formats


def _load(cfg: worker_config.WorkerConfig, metrics, faults, on_poisoned) -> _Loaded:
    """Open the model, build backend, KV store and engine (blocking; runs off the event loop)."""
    from .backends.numpy.backend import NumpyBackend
    from .engine.limits import EngineLimits
    from .engine.loop import Engine
    from .model.gguf_file import model_stem
    from .model.loader import open_model
    from .model.weights import load_weights
    from .runtime import DEFAULT_BLOCK_SIZE

    model = open_model(cfg.model)
    mtp_file = None
    if cfg.spec.startswith("mtp:"):  # the layer from its own file: the model is the trunk and that layer
        from .model.mtp_file import open_mtp_file

        mtp_file = open_mtp_file(cfg.spec[4:], model)
        model = dataclasses.replace(model, config=mtp_file.config, mtp_gguf=mtp_file.gguf)
    mtp = cfg.spec == "mtp" or mtp_file is not None
    dspark_file = None
    if cfg.spec.startswith("dspark:"):  # a DSpark block drafter (model/dspark_file.py): its rows join the pool's
        from .model.dspark_file import open_dspark_file

        dspark_file = open_dspark_file(cfg.spec[7:], model)
        model = dataclasses.replace(model, dspark_gguf=dspark_file.gguf)
    if mtp and not (model.config.hyper is not None and model.config.hyper.nextn_layers):
        raise worker_config.ConfigError(f"spec: mtp needs a model with a next-token (MTP) layer; {model.path.name} "
                                        "has none (try suffix or ngram)")
    chunk = worker_config.prefill_chunk(cfg)
    n_blocks = kv_blocks_for(cfg.kv_mem, model.config, DEFAULT_BLOCK_SIZE, cfg.backend, mtp,
                             dspark_file.key_width if dspark_file is not None else 0)
    memory: dict = {}
    gpu_mem = None if cfg.gpu_mem == "auto" else worker_config.parse_size(cfg.gpu_mem, "gpu_mem")
    drafter: Drafter | None = None
    backend: Backend
    if cfg.spec.startswith("replay:"):  # a benchmark's drafter (engine/spec/replay.py)
        from .engine.spec.replay import ReplayDrafter, parse_replay

        drafter = ReplayDrafter(parse_replay(cfg.spec), model.config.vocab_size)
    if cfg.spec.startswith("draft:"):  # before the model's backend: an automatic KV pool takes what is left
        from .engine.spec.draft_model import ModelDrafter, open_draft_model

        room = min(cfg.ctx or model.config.context_length, model.config.context_length) + cfg.spec_k
        draft = open_draft_model(cfg.spec[6:], model)
        draft_blocks = cfg.max_seqs * -(-room // DEFAULT_BLOCK_SIZE) + 1
        drafter = ModelDrafter(draft, _draft_backend(cfg.backend, draft, draft_blocks, DEFAULT_BLOCK_SIZE, gpu_mem),
                               draft_blocks)
    if cfg.backend == "cuda":
        # sticky CUDA errors surface from the backend as ContextPoisoned (engine_poisoned, exit 75)
        from ember.kernels.errors import CudaUnavailable

        from .backends.cuda import open_backend

        try:
            host_tier = worker_config.parse_size(cfg.kv_host_mem, "kv_host_mem") if cfg.kv_persist != "off" else 0
            # a DeepSeek V4 step's drafters
            layer = {"mtp": True, "mtp_gguf": model.mtp_gguf} if mtp else {"dspark": dspark_file} if dspark_file else {}
            backend = cuda = open_backend(model.config, model.gguf, n_blocks=n_blocks, block_size=DEFAULT_BLOCK_SIZE,
                                          max_rows=max(chunk, cfg.max_seqs), max_seqs=cfg.max_seqs,
                                          f16_weights=cfg.f16_weights, host_tier_bytes=host_tier, gpu_mem=gpu_mem,
                                          **layer)
            cuda.runs_ahead = cfg.run_ahead and cuda.runs_ahead  # (DeepSeek V4's step does not run ahead)
            memory = cuda.memory.as_dict()
            if mtp or dspark_file is not None:
                from .backends.cuda.hyper import CudaHyperBackend
                from .engine.spec.dspark_drafter import DSparkDrafter
                from .engine.spec.mtp_drafter import MtpDrafter

                assert isinstance(cuda, CudaHyperBackend)
                drafter = (MtpDrafter(cuda.mtp) if cuda.mtp is not None
                           else DSparkDrafter(cuda.dspark) if cuda.dspark is not None else None)
        except CudaUnavailable as e:  # no driver or device: a configuration problem, not a crash
            raise worker_config.ConfigError(f"backend: cuda is not available here ({e})") from None
    else:
        assert n_blocks is not None
        weights = load_weights(model.gguf, model.config)
        if mtp_file is not None:
            weights = mtp_file.attach(weights)
        dspark = (dspark_file, dspark_file.weights(weights)) if dspark_file is not None else None
        backend = host = NumpyBackend(model.config, weights, n_blocks=n_blocks, block_size=DEFAULT_BLOCK_SIZE, mtp=mtp,
                                      dspark=dspark)
        if mtp:
            from .engine.spec.mtp_drafter import MtpDrafter

            assert host.mtp is not None
            drafter = MtpDrafter(host.mtp)
        if dspark is not None:
            from .engine.spec.dspark_drafter import DSparkDrafter

            assert host.dspark is not None
            drafter = DSparkDrafter(host.dspark)
    kv_tokens = backend.n_blocks * DEFAULT_BLOCK_SIZE
    ctx = min(cfg.ctx or model.config.context_length, model.config.context_length, kv_tokens)
    faults.check_backend(backend)
    if faults:  # step faults (poison, hang, slow, cuda-illegal-address) wrap the backend; see backends/faults.py
        from .backends.faults import FaultyBackend

        backend = FaultyBackend(backend, faults)
    from .text.formats import resolve as resolve_formats

    formats = resolve_formats(model.template, model.tokenizer, cfg.reasoning_format,  # once per model
                              model.config.family.formats)
    sized = not cfg.prefill_chunk and cfg.itl_target_ms > 0  # auto chunks, sized at each step to the target
    limits = EngineLimits.configured(cfg, max_seqs=cfg.max_seqs, max_queue=cfg.max_queue, prefill_chunk=chunk,
                                     itl_target_s=cfg.itl_target_ms / 1000 if sized else None,
                                     max_step_tokens=max(chunk, cfg.max_seqs), context=ctx)
    store = None
    if cfg.kv_persist != "off":
        from .engine.kv_blocks import chain_hash, kv_salt
        from .kvstore.store import KVStore
        from .paths import state_dir

        kv_dir = Path(cfg.kv_dir).expanduser() if cfg.kv_dir else state_dir() / "kv"
        store = KVStore(kv_dir, salt=kv_salt(model.fingerprint, backend.kv_layout), model_key=model.fingerprint,
                        block_shape=backend.read_block(0).shape, block_tokens=DEFAULT_BLOCK_SIZE,
                        block_dtype=backend.block_dtype,
                        chain_hash=chain_hash, persist=cfg.kv_persist,
                        disk_budget=worker_config.disk_budget(cfg, kv_dir),
                        host_budget=worker_config.parse_size(cfg.kv_host_mem, "kv_host_mem"),
                        disk_full=faults.disk_full if any(f.kind == "disk-full" for f in faults.faults) else None,
                        buffers=backend.restore_buffers())  # restored blocks are read into the backend's memory
        metrics.attach_store(store)
    engine = Engine(model, backend, limits, metrics=metrics, faults=faults, on_poisoned=on_poisoned, store=store,
                    drafter=drafter)
    facts = dict(model=model_stem(model.path), fingerprint=model.fingerprint, backend=backend.name, ctx=ctx,
                 kv_tokens=kv_tokens, max_seqs=cfg.max_seqs, prefill_chunk=chunk, **memory,
                 kv_persistence=store.persistence.snapshot() if store is not None else None)
    return _Loaded(engine, model, store, facts, formats)


def serve(cfg: worker_config.WorkerConfig, sources: dict[str, str]) -> int:
    """Serve HTTP at once (health says `loading`), load the model off the event loop, then serve."""
    from .backends.faults import FaultInjector, FaultSpecError, parse_faults
    from .model.gguf_file import ModelFileError
    from .model.loader import resolve_model_path

    t0 = time.monotonic()
    # the daemon sends SIGUSR1 before killing a hung worker: every thread's stack lands in the log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    log(Event.CONFIG, version=_version(), pid=os.getpid(), config=worker_config.redacted(cfg),
        sources={k: v for k, v in sources.items() if v != "default"})
    try:
        listeners = listen.bind(cfg.host, cfg.port)
    except listen.PortBusy as e:
        log(Event.PORT_BUSY, level="error", host=cfg.host, port=cfg.port, error=str(e))
        log("exit", code=ExitCode.PORT_BUSY)
        return ExitCode.PORT_BUSY
    except worker_config.ConfigError as e:
        log(Event.CONFIG_ERROR, level="error", error=str(e))
        return EX_CONFIG
    try:
        faults = FaultInjector(parse_faults(cfg.fault))
        model_path = resolve_model_path(cfg.model)
    except (ModelFileError, FaultSpecError) as e:
        log(Event.CONFIG_ERROR, level="error", error=str(e))
        return EX_CONFIG
    return _Serving(cfg, faults, model_path, t0).run(listeners)


class _Serving:
    """One worker's HTTP server from its first request to its exit code: the model loads while it
    serves health, SIGTERM drains, a poisoned context exits at once."""

    def __init__(self, cfg: worker_config.WorkerConfig, faults: FaultInjector, model_path: Path, t0: float):
        from .api.state import ServerState
        from .metrics import Metrics

        self.cfg, self.faults, self.t0 = cfg, faults, t0
        self.state = ServerState(HealthState.LOADING, stall_seconds=cfg.stall_seconds)
        self.metrics = Metrics()
        self.poisoned_exit = threading.Event()
        self.server = self._http_server(model_path)
        self.exit_code: int = EX_OK
        self.terms = 0
        self.loaded: _Loaded | None = None

    def _http_server(self, model_path: Path) -> uvicorn.Server:
        import uvicorn

        from .api import readguard
        from .api.app import create_app
        from .api.limits import RequestLimits
        from .api.security import Guard
        from .model.gguf_file import model_stem

        cfg = self.cfg
        guard = Guard(api_key=cfg.api_key or None, loopback_only=worker_config.is_loopback(cfg.host),
                      allowed_origins=tuple(worker_config.origins(cfg)), metrics_auth=cfg.metrics_auth)
        if not guard.loopback_only and guard.api_key is None:
            log("insecure_bind", level="warning", host=cfg.host, port=cfg.port,
                message=f"serving {cfg.host}:{cfg.port} beyond loopback WITHOUT an API key: anyone who can reach "
                        "this port can use the model; set --api-key (see README: Security)")
        app = create_app(None, None, api_key=cfg.api_key, model_name=model_stem(model_path), state=self.state,
                         limits=RequestLimits.from_config(cfg), guard=guard, log_prompts=cfg.log_prompts,
                         version=_version())
        slow = readguard.ReadLimits(cfg.read_header_seconds, cfg.read_body_seconds, cfg.read_body_min_rate,
                                    cfg.max_slow_connections)
        http = readguard.protocol_class(slow, closed=lambda phase: self.metrics.slow_clients.labels(phase).inc())

        class OwnSignals(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # we own SIGTERM/SIGINT (drain, then exit)

        return OwnSignals(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", http=http,
                                         access_log=False, lifespan="on", timeout_graceful_shutdown=1))

    def run(self, listeners: list[socket.socket]) -> int:
        try:
            asyncio.run(self._main(listeners))
        finally:
            if self.loaded is not None:
                self.loaded.engine.shutdown(timeout=2.0)
                if self.loaded.store is not None:
                    self.loaded.store.close(timeout=10.0)  # queued blocks reach the disk before a clean exit
        log("exit", code=self.exit_code)
        return self.exit_code

    async def _main(self, listeners: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.create_task(self._watch_poison())
        loader = loop.create_task(self._load_then_serve())
        await self.server.serve(sockets=listeners)
        if not self.server.started:
            self.exit_code = self.exit_code or 1
        loader.cancel()

    def _on_poisoned(self, e: BaseException) -> None:  # engine thread
        self.state.set(HealthState.POISONED)
        self.poisoned_exit.set()

    def _busy(self) -> bool:
        return self.loaded is not None and self.loaded.engine.stats.busy

    async def _drain(self) -> None:
        self.state.set(HealthState.DRAINING)
        if self.loaded is not None:
            self.loaded.engine.stop_accepting()
            st = self.loaded.engine.stats
            log("draining", in_flight=st.running + st.waiting, seconds=self.cfg.drain_seconds)
        deadline = time.monotonic() + self.cfg.drain_seconds
        while self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._busy():
            log("drain_timeout", level="warning")
        self.server.should_exit = True

    def _on_signal(self, signum: int) -> None:
        self.terms += 1
        log("signal", signal=signal.Signals(signum).name, count=self.terms)
        if self.terms > 1:
            os._exit(EX_OK)
        asyncio.get_running_loop().create_task(self._drain())

    async def _watch_poison(self) -> None:
        while not self.poisoned_exit.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(POISON_FLUSH_SECONDS)
        log("exit", code=EX_POISONED, reason="poisoned compute context")
        os._exit(EX_POISONED)  # never wait on a poisoned context's teardown

    async def _load_then_serve(self) -> None:
        from .backends.faults import FaultSpecError
        from .model.gguf_file import ModelFileError
        from .text.chat_template import ChatTemplateError

        server = self.server
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.01)
        try:
            result = await asyncio.to_thread(_load, self.cfg, self.metrics, self.faults, self._on_poisoned)
            self.loaded = result
            if self.state.state == HealthState.DRAINING:  # SIGTERM while loading: nothing to drain
                server.should_exit = True
                return
            result.engine.start()
        except (ModelFileError, ChatTemplateError, worker_config.ConfigError, FaultSpecError) as e:
            log(Event.CONFIG_ERROR, level="error", error=str(e))
            self.exit_code = EX_CONFIG
            server.should_exit = True
            return
        except Exception as e:  # unforeseen: say what and where, and exit (a crash the daemon restarts), never
            # serve `loading` forever from a task whose exception nobody reads
            frame = traceback.extract_tb(e.__traceback__)[-1]
            log(Event.LOAD_FAILED, level="error", error=f"{type(e).__name__}: {e}",
                where=f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}")
            self.exit_code = ExitCode.FAILURE
            server.should_exit = True
            return
        self.state.store = result.store  # (before the engine: the bodies read "off" from a store-less engine)
        self.state.attach(result.engine, result.model, result.formats)
        self.state.set(HealthState.READY)
        log(Event.READY, host=self.cfg.host, port=self.cfg.port, **result.facts,
            startup_seconds=round(time.monotonic() - self.t0, 2))
