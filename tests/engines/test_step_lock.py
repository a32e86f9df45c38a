"""The engine's model lock: a weight load waiting for it lands within one decode step, however busy the loop."""

from __future__ import annotations

import threading
import time

from miles.engines.step_lock import StepLock


def test_an_exclusive_holder_waits_for_at_most_the_step_in_progress():
    """Each step notes whether a holder was already waiting when it began: at most one such step per hold
    (the one that took the lock just before the holder arrived), whatever the machine's load."""
    lock, stop = StepLock(), threading.Event()
    steps, began_while_waited = [0], [0]

    def decode_loop() -> None:
        while not stop.is_set():
            with lock.step():
                began_while_waited[0] += lock.waiting > 0
                time.sleep(0.001)  # a step that lets the GIL go, like torch's kernels
                steps[0] += 1

    loop = threading.Thread(target=decode_loop, daemon=True)
    loop.start()
    holds = 30
    try:
        for _ in range(holds):
            with lock.exclusive():
                during = steps[0]
                time.sleep(0.002)
                assert steps[0] == during  # no step while the load holds the model
            time.sleep(0.003)
    finally:
        stop.set()
        loop.join(timeout=10)
    assert steps[0] > holds and began_while_waited[0] <= holds, (steps[0], began_while_waited[0])


def test_the_decode_loop_waits_while_the_model_is_held_and_goes_on_after():
    lock, ran = StepLock(), threading.Event()

    def one_step() -> None:
        with lock.step():
            ran.set()

    with lock.exclusive():
        worker = threading.Thread(target=one_step, daemon=True)
        worker.start()
        worker.join(timeout=0.2)
        assert not ran.is_set()
    worker.join(timeout=10)
    assert ran.is_set()
