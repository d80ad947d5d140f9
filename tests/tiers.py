"""The fast tier's share of a cross-product (the markers are pyproject's): a parametrized test lists every case; the
cases its `fast` rule leaves out carry the slow mark, so `pytest -m "not slow"` runs a curated slice of it and the
full command runs all of it (as llama.cpp's test-backend-ops runs one list of cases, checked against a reference)."""
import itertools

import pytest

SLOW = pytest.mark.slow


def cases(*axes, fast):
    """Every combination of the axes (each a list of values, or of tuples for a joint axis such as (E, I, H)) as one
    flat case each, those `fast(*case)` rejects marked slow."""
    out = []
    for combo in itertools.product(*axes):
        case = tuple(v for part in combo for v in (part if isinstance(part, tuple) else (part,)))
        out.append(case if fast(*case) else pytest.param(*case, marks=SLOW))
    return out


def some(values, fast):
    """A list of cases: those in `fast` stay in the fast tier, the others are slow. A tuple is one case of several
    arguments (as parametrize reads it)."""
    return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=SLOW) for v in values]
