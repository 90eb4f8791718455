"""The statistics the experiment scripts report, in one place: Wilson intervals for accuracies,
paired differences with McNemar's exact test for two conditions run on the same problems."""

from __future__ import annotations

import math
from typing import Any


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of the proportion ``k / n`` ((0, 0) when ``n`` is 0)."""
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs: twice the smaller
    tail of binomial(b + c, 1/2), at most 1."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(first: list[bool], second: list[bool], z: float = 1.96) -> dict[str, Any]:
    """``second - first`` per problem: the mean difference with a normal-approximation 95%
    interval (``low``, ``high``), the discordant counts and McNemar's exact p."""
    d = [int(s) - int(f) for f, s in zip(first, second, strict=True)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    only_second, only_first = sum(x == 1 for x in d), sum(x == -1 for x in d)
    return {"difference": mean, "low": mean - half, "high": mean + half, "only_second_correct": only_second,
            "only_first_correct": only_first, "mcnemar_exact_p": mcnemar_exact(only_second, only_first)}
