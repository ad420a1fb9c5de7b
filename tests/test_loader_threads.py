"""data.loader.settle_loader_threads: before a DataLoader forks its workers on CPython 3.11, the queue
threads of finished iterators must have exited (a fork while one exits can hang the child forever:
docs/data.md). Threads started since the last call are waited for until they end; threads that were
already open then cost the short timeout only."""
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from data.loader import settle_loader_threads

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python >= 3.12 re-initialises the lock: "
                                                                    "settle_loader_threads waits for nothing")


class FeederThread(threading.Thread):
    """Named like multiprocessing.Queue's writer thread; records the timeouts it was joined with."""

    def __init__(self, target):
        super().__init__(target=target, name="QueueFeederThread", daemon=True)
        self.joined_with = []

    def join(self, timeout=None):
        self.joined_with.append(timeout)
        super().join(timeout)


def feeder_threads():
    return [t for t in threading.enumerate() if t.name == "QueueFeederThread" and t.is_alive()]


def test_a_thread_of_a_finished_iterator_is_waited_for_past_the_short_timeout():
    settle_loader_threads(timeout=0.01, exiting_timeout=0.01)  # what is open now (other tests') is known as open
    released = threading.Event()
    slow = FeederThread(lambda: released.wait(30))
    slow.start()
    threading.Timer(0.5, released.set).start()  # it ends 50 times later than the short timeout
    settle_loader_threads(timeout=0.01, exiting_timeout=30)
    assert not slow.is_alive() and slow.joined_with == [30]


def test_a_thread_already_open_at_the_last_call_costs_the_short_timeout_only():
    settle_loader_threads(timeout=0.01, exiting_timeout=0.01)
    stop = threading.Event()
    open_queue = FeederThread(stop.wait)  # an iterator kept open: its thread does not end by itself
    open_queue.start()
    try:
        settle_loader_threads(timeout=0.01, exiting_timeout=0.2)  # new: waited for, up to exiting_timeout
        settle_loader_threads(timeout=0.01, exiting_timeout=0.2)  # known as open now: the short timeout
        settle_loader_threads(timeout=0.01, exiting_timeout=0.2)
        assert open_queue.joined_with == [0.2, 0.01, 0.01] and open_queue.is_alive()
    finally:
        stop.set()
        open_queue.join()


def test_after_real_iterators_with_workers_no_queue_thread_is_left():
    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=1)
    settle_loader_threads(timeout=0.01, exiting_timeout=0.01)
    before = set(feeder_threads())  # iterators other tests in this process may have left open
    for _ in range(3):  # an epoch, then what TrainingLoop does before the next one forks
        assert sum(len(x) for (x,) in loader) == 64
        settle_loader_threads()
        assert set(feeder_threads()) <= before
    stopped_early = iter(loader)  # an epoch cut short and dropped (max_train_steps, early stopping)
    next(stopped_early)
    del stopped_early
    settle_loader_threads()
    assert set(feeder_threads()) <= before
