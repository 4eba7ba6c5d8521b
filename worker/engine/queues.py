"""The engine's requests, held in one place: the inbox, the waiting queue and the running batch.

A request is in at most one of them. The HTTP thread puts new sequences in the inbox (under the
lock, which the engine thread sleeps on when there is no work); the engine thread moves the inbox
into `waiting` once a turn, admits the head of `waiting` into `running`, and puts a preempted
sequence back at the head of `waiting`. `remove` is the one way out, whichever of the three holds
the sequence: settling a request calls it once, so nothing it settled stays queued.

It decides nothing: admission order, preemption and settling are the loop's (loop.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from .sequence import Seq


class RequestQueues:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self.inbox: collections.deque[Seq] = collections.deque()  # submitted, not yet seen by the loop
        self.waiting: collections.deque[Seq] = collections.deque()  # in admission order (preempted first)
        self.running: list[Seq] = []

    # -- the HTTP thread (holding `lock`) ----------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests waiting for a slot (the inbox's too)."""
        return len(self.waiting) + len(self.inbox)

    def put(self, s: Seq) -> None:
        """A new request (the caller holds `lock`); wakes the loop."""
        self.inbox.append(s)
        self._wake.notify()

    def wake(self) -> None:
        with self.lock:
            self._wake.notify()

    # -- the engine thread -----------------------------------------------------------------------------------

    def wait_for_work(self, stopping: Callable[[], bool], idle: Callable[[], None]) -> bool:
        """Sleep until there is work (calling `idle` about once a second meanwhile), then take the
        inbox into `waiting`. False: `stopping()` said to stop."""
        with self.lock:
            while not stopping() and not self.busy:
                self._wake.wait(timeout=1.0)
                idle()
            if stopping():
                return False
            self._take_inbox()
            return True

    def take_inbox(self) -> None:
        """The inbox joins the waiting queue, in arrival order."""
        with self.lock:
            self._take_inbox()

    def _take_inbox(self) -> None:
        self.waiting.extend(self.inbox)
        self.inbox.clear()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.inbox)

    def admit(self, s: Seq) -> None:
        """The head of the waiting queue starts running."""
        assert self.waiting and self.waiting[0] is s
        self.waiting.popleft()
        self.running.append(s)

    def requeue(self, s: Seq) -> None:
        """A preempted sequence waits again, first in line."""
        self.running.remove(s)
        self.waiting.appendleft(s)

    def remove(self, s: Seq) -> str | None:
        """Take the sequence out of whichever queue holds it: "running", "waiting", "inbox", or None
        where none does (already removed)."""
        if s in self.running:
            self.running.remove(s)
            return "running"
        if s in self.waiting:
            self.waiting.remove(s)
            return "waiting"
        with self.lock:
            if s in self.inbox:
                self.inbox.remove(s)
                return "inbox"
        return None

    def in_flight(self) -> list[Seq]:
        """Every admitted or waiting sequence, running first (a copy: settling them changes the queues)."""
        return [*self.running, *self.waiting]

    def clear(self) -> None:
        self.running.clear()
        self.waiting.clear()
