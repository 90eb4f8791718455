"""View helpers of the provenance pages that need no registry: plain values in, plain values out.

- ``record_summary``: the one-line summary of a record in a listing, from its decoded statement
  JSON (never raises: a statement whose fields do not read says so);
- ``same_figure`` and ``mean_figure``: a record's claimed figures against the recomputed ones,
  total over numbers no float holds;
- ``lineage_view``: the lineage drawing (``lineage_svg``) and lists of an artifact page.
"""

from __future__ import annotations

import math
from typing import Any

from .render import short_digest
from .svg import LineageNode, lineage_svg

#: Ancestors drawn before the chain is shortened to "root, n more, ..., parent".
_DRAWN_ANCESTORS = 3
_DRAWN_CHILDREN = 6


def record_summary(kind: str, payload: dict[str, Any]) -> str:
    """One line about a record of ``kind`` from its statement JSON ``payload`` ("" for another kind)."""
    p = payload.get("predicate") or {}
    try:
        if kind == "exactness":
            s = p["summary"]
            level = p.get("level", "")
            shift = f" shift {p['shift']}" if p.get("shift") else ""
            return f"{p['model']['name']} {level}{shift}: {s['bitwise_equal']}/{s['samples']} bit-equal, max KL {s['max_kl_divergence']:.3g}"
        if kind == "evaluation":
            a = p["aggregates"]
            return f"{p['model']['name']} on {p['dataset']['name']}: {a['correct']}/{a['items']} correct"
        if kind == "pre-registration":
            return f"{p['model']['name']} on {p['dataset']['name']}: {len(p['expected_output_hashes'])} expected outputs"
        if kind == "replay":
            ref = p["pre_registration"]
            return f"answers entry {ref['log_index']}: {'reproduced' if p['reproduced'] else 'NOT reproduced'}"
        if kind == "slot":
            return f"llama-server slot of {len(p['tokens'])} tokens, {p['gguf_file']} ({p['build_info']})"
    except (KeyError, TypeError, ValueError, ArithmeticError):
        # ArithmeticError: a number no float holds (an int beyond 1.8e308) in a format.
        return "(summary unreadable; open the record)"
    return ""


def _finite_float(value: Any) -> float | None:
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def same_figure(a: Any, b: Any) -> bool:
    """Whether a claimed figure equals the recomputed one (floats within 1e-9 relative); total."""
    if isinstance(a, float) or isinstance(b, float):
        fa, fb = _finite_float(a), _finite_float(b)
        if fa is None or fb is None:
            # Beyond float range or not finite: only the very same value is the same.
            return bool(a == b)
        return abs(fa - fb) <= 1e-9 * max(1.0, abs(fa))
    return bool(a == b)


def mean_figure(values: list[Any]) -> Any:
    """The mean of ``values`` (0.0 for none); of ints no float holds, an int mean (floor division)."""
    if not values:
        return 0.0
    total = sum(values)
    try:
        return total / len(values)
    except OverflowError:
        return total // len(values)


def _node(item: dict[str, Any], role: str) -> LineageNode:
    if item.get("log_index") is None:
        return LineageNode(short_digest(item["digest"], 10), "no entry in this log", None, "missing")
    start, end = item["positions"]
    return LineageNode(short_digest(item["digest"], 10), f"entry {item['log_index']} \u00b7 pos {start}\u2013{end}",
                       f"/artifacts/{item['digest']}", role)


def _cut_note(cut: str | None, limit: int | None, shown: int) -> str | None:
    if cut == "cycle":
        return (f"The parent chain loops back on itself after {shown} ancestor{'' if shown == 1 else 's'}: "
                "an artifact is its own ancestor, so this lineage can never reach a root.")
    if cut == "depth":
        return (f"The parent chain goes on past the {limit} nearest ancestors; this registry walks no further "
                "(its max_lineage_depth setting).")
    return None


def lineage_view(
    artifact: dict[str, Any],
    parents: list[dict[str, Any]],
    children: list[dict[str, Any]],
    *,
    cut: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """The lineage drawing and lists; ``cut`` (from ``ancestors``) marks a walk stopped early."""
    chain_items = list(reversed(parents))  # root first (or the farthest ancestor walked)
    chain: list[LineageNode] = []
    if cut is not None:
        marker = "\u2026 cycle" if cut == "cycle" else "\u2026 more"
        chain.append(LineageNode(marker, "walk stopped here", None, "more"))
    if len(chain_items) > _DRAWN_ANCESTORS:
        # The root, a marker for those in between, and the nearest parents.
        hidden = len(chain_items) - _DRAWN_ANCESTORS
        chain.append(_node(chain_items[0], "ancestor"))
        chain.append(LineageNode(f"\u2026 {hidden} more", "ancestors", None, "more"))
        chain += [_node(p, "ancestor") for p in chain_items[-(_DRAWN_ANCESTORS - 1):]]
    else:
        chain += [_node(p, "ancestor") for p in chain_items]
    start, end = artifact["positions"]
    current = LineageNode(short_digest(artifact["digest"], 10), f"this \u00b7 pos {start}\u2013{end}", None, "current")
    drawn_children = [_node(c, "child") for c in children[:_DRAWN_CHILDREN]]
    if len(children) > _DRAWN_CHILDREN:
        drawn_children.append(
            LineageNode(f"+ {len(children) - _DRAWN_CHILDREN} more", "children", f"/artifacts?parent={artifact['digest']}", "more")
        )
    return {
        "svg": lineage_svg(chain, current, drawn_children),
        "parents": parents,
        "children": children,
        "cut": cut,
        "cut_note": _cut_note(cut, limit, len(parents)),
    }
