"""Processes released together by a barrier, many rounds over: how the tests meet check-then-act
code in two processes at once and count the rounds that went wrong."""

import multiprocessing


def race(sides, rounds):
    """Run each side(n, barrier) in a process of its own, `rounds` times, the sides released together
    each round (a side may wait on the barrier again, as often as every other side does); returns each
    side's outcomes, in round order (an exception counts as one, by its type and message)."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(len(sides), timeout=30), context.Queue()

    def loop(index, side):
        for n in range(rounds):
            barrier.wait()
            try:
                outcome = side(n, barrier)
            except Exception as e:  # noqa: BLE001 - a crash is what these tests count
                outcome = f"{type(e).__name__}: {e}"
            results.put((index, n, outcome))

    processes = [context.Process(target=loop, args=(i, side)) for i, side in enumerate(sides)]
    for p in processes:
        p.start()
    outcomes = [[None] * rounds for _ in sides]
    for _ in range(rounds * len(sides)):
        index, n, outcome = results.get(timeout=60)
        outcomes[index][n] = outcome
    for p in processes:
        p.join(timeout=30)
    return outcomes


def quiet(line):
    """A `note` or `print` that says nothing: the rounds' own lines would bury the test's."""
