"""The experiment scripts' statistics against values worked by hand (and SciPy's, where known)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "experiment_stats.py"


@pytest.fixture(scope="module")
def stats() -> ModuleType:
    spec = importlib.util.spec_from_file_location("experiment_stats", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mcnemar_exact_is_twice_the_smaller_binomial_tail(stats: ModuleType) -> None:
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 6) == 2 / 64  # both tails of binomial(6, 1/2) at 0 and 6
    assert stats.mcnemar_exact(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert stats.mcnemar_exact(5, 5) == 1.0  # capped: the two tails overlap at the centre
    # scipy.stats.binomtest(3, 15, 0.5).pvalue
    assert stats.mcnemar_exact(3, 12) == pytest.approx(0.03515625)


def test_wilson_interval_of_known_proportions(stats: ModuleType) -> None:
    lo, hi = stats.wilson(0, 50)
    assert lo == 0.0 and hi == pytest.approx(0.0713, abs=1e-4)
    lo, hi = stats.wilson(1, 50)
    assert (round(lo, 3), round(hi, 3)) == (0.004, 0.105)
    assert stats.wilson(0, 0) == (0.0, 0.0)


def test_paired_difference_counts_the_discordant_problems(stats: ModuleType) -> None:
    first = [True, False, False, True, False]
    second = [True, True, True, False, False]
    p = stats.paired(first, second)
    assert p["difference"] == pytest.approx(1 / 5)
    assert (p["only_second_correct"], p["only_first_correct"]) == (2, 1)
    assert p["mcnemar_exact_p"] == 1.0
    half = 1.96 * math.sqrt(0.7 / 5)  # the sample variance of [0, 1, 1, -1, 0] is 0.7
    assert (p["low"], p["high"]) == (pytest.approx(0.2 - half), pytest.approx(0.2 + half))
    with pytest.raises(ValueError):
        stats.paired([True], [True, False])
