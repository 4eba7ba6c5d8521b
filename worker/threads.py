"""The worker's long-lived threads, started guarded: a thread that dies is logged, counted and
remembered, so /health/live fails honestly instead of the work it did silently stopping.

`ThreadWatch.thread(name, target, on_death=...)` wraps the target: an exception escaping it logs
`thread_died` (name, error, traceback), adds one to the thread's death count (exported as
`ember_thread_deaths_total{thread}`), records the thread in `dead` (which fails liveness), and then
calls `on_death`, where the owner settles whatever waited on that thread (requests, restore jobs,
futures). A thread that returns is never a death, and neither is an exception once its owner is
stopping (`stopping()` true): the process is going down anyway.

`GuardedPool` is a small executor on such threads (the grammar masks run on one): a call's error
goes to its future; a pool thread whose loop dies fails every queued call, and the pool then
refuses new ones at once, so nothing waits on a thread that is gone.

It sits on the worker's lowest floor, beside logs.py and metrics.py: the KV store, the engine and
its grammar pool all start threads, and none of them may import another for it.
"""

from __future__ import annotations

import collections
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future

from .logs import log


class ThreadDied(RuntimeError):
    """What a caller waiting on a dead thread gets instead of its result."""


class InjectedThreadDeath(RuntimeError):
    """A fault (thread-die): the doomed thread raises this at its next checkpoint."""


class ThreadWatch:
    """The guarded threads of one worker and the record of those that died. The engine and its KV
    store share one (the engine adopts its store's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.dead: dict[str, str] = {}  # thread name -> "Type: message", first death of that name
        self.deaths: collections.Counter[str] = collections.Counter()
        self.doomed: list[str] = []  # name prefixes (fault injection); checked as a plain flag

    def thread(self, name: str, target: Callable[[], None], *,
               on_death: Callable[[BaseException], None] | None = None,
               stopping: Callable[[], bool] | None = None) -> threading.Thread:
        """A daemon thread running `target` under watch (not started)."""

        def run() -> None:
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - whatever ends the thread is reported
                if stopping is not None and stopping():
                    log("thread_exit_error", level="warning", thread=name, error=_describe(e))
                    return
                self._record(name, e)
                if on_death is not None:
                    try:
                        on_death(e)
                    except BaseException as e2:  # noqa: BLE001
                        log("thread_death_cleanup_failed", level="error", thread=name, error=_describe(e2),
                            traceback=traceback.format_exc())

        return threading.Thread(target=run, name=name, daemon=True)

    def _record(self, name: str, e: BaseException) -> None:
        with self._lock:
            self.deaths[name] += 1
            self.dead.setdefault(name, _describe(e))
        log("thread_died", level="error", thread=name, error=_describe(e), error_type=type(e).__name__,
            traceback="".join(traceback.format_exception(e)))

    # -- fault injection --------------------------------------------------------------------------------

    def doom(self, prefix: str) -> None:
        """The next guarded thread named `prefix`... to pass a checkpoint dies (backends/faults.py)."""
        with self._lock:
            self.doomed.append(prefix)

    def checkpoint(self) -> None:
        """Called in a thread's loop behind `if watch.doomed:`; raises for a doomed thread."""
        name = threading.current_thread().name
        with self._lock:
            hit = next((p for p in self.doomed if name.startswith(p)), None)
            if hit is None:
                return
            self.doomed.remove(hit)
        raise InjectedThreadDeath(f"injected death of thread {name}")


class GuardedPool:
    """`workers` guarded threads named `name-0`, `name-1`... running submitted calls."""

    def __init__(self, watch: ThreadWatch, name: str, workers: int = 2):
        self.watch = watch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: str | None = None  # why the pool refuses calls
        self._closed = False
        self._threads = [watch.thread(f"{name}-{i}", self._work, on_death=self._died, stopping=lambda: self._closed)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> Future:
        f: Future = Future()
        with self._lock:
            if self._broken is None and not self._closed:
                self._q.put((f, fn, args))
                return f
            why = self._broken or "the pool is shut down"
        f.set_exception(ThreadDied(why))
        return f

    def shutdown(self) -> None:
        """Cancel what is queued and let the threads end (does not wait)."""
        with self._lock:
            self._closed = True
            self._fail_queued(None)
        for _ in self._threads:
            self._q.put(None)

    def _work(self) -> None:
        watch = self.watch
        while True:
            item = self._q.get()
            if item is None:
                return
            f, fn, args = item
            if watch.doomed:
                try:
                    watch.checkpoint()
                except BaseException as e:
                    f.set_exception(ThreadDied(f"{threading.current_thread().name} died: {_describe(e)}"))
                    raise
            if not f.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except Exception as e:  # noqa: BLE001 - the call's error is its caller's
                f.set_exception(e)
            except BaseException as e:  # noqa: BLE001 - e.g. a Rust panic: the call failed, not the thread
                f.set_exception(RuntimeError(_describe(e)))
            else:
                f.set_result(result)

    def _died(self, e: BaseException) -> None:
        with self._lock:
            self._broken = f"{threading.current_thread().name} died: {_describe(e)}"
            self._fail_queued(self._broken)

    def _fail_queued(self, why: str | None) -> None:
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            f = item[0]
            if why is None:
                f.cancel()
            elif f.set_running_or_notify_cancel():
                f.set_exception(ThreadDied(why))


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())[:500]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
