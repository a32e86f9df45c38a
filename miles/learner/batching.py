"""Cutting a packed batch into mini-batches, per-rank shares and micro-batches (both backends)."""

from __future__ import annotations


def plan_micro_batches(
    lengths: list[int], token_budget: int, *, padded: bool = False
) -> list[tuple[int, int]]:
    """Split sequences (in order) into contiguous ``[start, end)`` ranges of at most ``token_budget`` tokens.

    With ``padded=True`` a range costs ``count * longest`` (what a right-padded micro-batch holds).
    A sequence longer than the budget gets a micro-batch of its own.
    """
    plans: list[tuple[int, int]] = []
    start, used, longest = 0, 0, 0
    for i, n in enumerate(lengths):
        cost = (i - start + 1) * max(longest, n) if padded else used + n
        if i > start and cost > token_budget:
            plans.append((start, i))
            start, used, longest = i, 0, 0
        used += n
        longest = max(longest, n)
    if start < len(lengths):
        plans.append((start, len(lengths)))
    return plans


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` as at most `parts` contiguous non-empty ranges of near-equal size (one range when n is 0)."""
    parts = max(1, min(parts, n)) if n else 1
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


def token_balanced_share(lengths: list[int], rank: int, world: int) -> tuple[int, int]:
    """Contiguous ``[a, b)`` of ``lengths`` for ``rank``, cut where the cumulative token count crosses k/world.

    A rank may get an empty range when there are fewer sequences than ranks.
    """
    total = sum(lengths)
    cuts, acc, j = [0], 0, 1
    for i, n in enumerate(lengths):
        acc += n
        while j < world and acc >= total * j / world:
            cuts.append(i + 1)
            j += 1
    while len(cuts) < world + 1:
        cuts.append(len(lengths))
    return cuts[rank], cuts[rank + 1]
