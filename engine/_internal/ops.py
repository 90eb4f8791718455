"""The engine's operations: capture, graft, fresh, and decoding from a graft.

``fresh`` recomputes a prefix exactly as ``capture`` computes it (one forward pass over the
prefix tokens), then runs the continuation exactly as ``graft`` runs it (one forward pass over
the continuation on the cache), so own-position exactness means equal logits bytes.

Every decode goes one way: ``continue_from`` restores an artifact's chain into a ``KVState``
(or starts empty), runs the suffix through ``KVState.extend`` and hands the last position's
logits to ``greedy_decode``, the one decode loop (``generate``, ``Library.ask`` and
``run_eval`` all use it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kvgraft.schemas import DeterminismProfile

from .artifacts import Captured, LoadedArtifact, logits_digest, write_artifact
from .errors import InputTextError
from .kvstate import KVState
from .models import LoadedModel
from .profiles import applied


def read_text(path: Path, *, what: str = "text file") -> str:
    """Read a UTF-8 text file, refusing missing, binary or empty files."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise InputTextError(f"{what} {path} does not exist") from e
    except IsADirectoryError as e:
        raise InputTextError(f"{what} {path} is a directory") from e
    except UnicodeDecodeError as e:
        raise InputTextError(f"{what} {path} is not UTF-8 text") from e
    except OSError as e:
        raise InputTextError(f"cannot read {what} {path}: {e.strerror}") from e
    if not text:
        raise InputTextError(f"{what} {path} is empty")
    return text


def _tokens(model: LoadedModel, text: str, *, first: bool, what: str) -> list[int]:
    ids = model.tokenizer.encode(text, first=first)
    if not ids:
        raise InputTextError(f"the {what} tokenizes to no tokens")
    return ids


@dataclass(frozen=True)
class Continuation:
    """The logits of a continuation run on a prefix state, summarized for comparison."""

    logits: torch.Tensor  # [continuation_tokens, vocab] float32 (the last keep_last rows when graft was given it)
    prefix_tokens: int
    continuation_ids: list[int]
    seconds: float

    @property
    def positions(self) -> tuple[int, int]:
        """``[start, end)`` of the continuation."""
        return (self.prefix_tokens, self.prefix_tokens + len(self.continuation_ids))

    def summary(self) -> dict[str, object]:
        """The JSON fields ``graft`` and ``fresh`` report."""
        return {
            "logits_sha256": logits_digest(self.logits).removeprefix("sha256:"),
            "argmax": self.logits.argmax(dim=-1).tolist(),
            "prefix_tokens": self.prefix_tokens,
            "continuation_tokens": len(self.continuation_ids),
            "positions": list(self.positions),
            "seconds": round(self.seconds, 6),
        }


def capture(
    model: LoadedModel,
    profile: DeterminismProfile,
    text: str,
    out: Path,
    *,
    key: Path,
    parent: LoadedArtifact | None = None,
    passphrase: bytes | None = None,
) -> Captured:
    """Run ``text`` (after the parent's tokens) and write the state as a signed artifact."""
    with applied(profile):
        if parent is None:
            state, start = KVState(model), 0
        else:
            state = KVState.restore(model, parent.segments())
            start = state.end
        ids = _tokens(model, text, first=parent is None, what="text")
        logits = state.extend(ids)
        return write_artifact(
            out, model=model, profile=profile, state=state, start=start, last_logits=logits[-1],
            text=text, parent=parent, key=key, passphrase=passphrase,
        )


def graft(
    model: LoadedModel,
    profile: DeterminismProfile,
    artifact: LoadedArtifact,
    text: str,
    *,
    shift: int = 0,
    keep_last: int | None = None,
) -> Continuation:
    """Restore ``artifact`` at its own positions (or ``shift`` away, approximately) and run ``text``.

    ``keep_last``: compute the logits of only the last N positions (``keep_last=1`` is what a
    time to first token needs); the default keeps every position's, which exactness compares.
    """
    with applied(profile):
        t0 = time.perf_counter()
        state = KVState.restore(model, artifact.segments(), shift=shift)
        ids = _tokens(model, text, first=False, what="continuation text")
        logits = state.extend(ids, keep_last=keep_last)
        return Continuation(logits, artifact.statement.predicate.positions.end, ids, time.perf_counter() - t0)


def fresh(model: LoadedModel, profile: DeterminismProfile, prefix: str, text: str) -> Continuation:
    """Recompute ``prefix`` as capture does, then run ``text`` as graft does."""
    with applied(profile):
        t0 = time.perf_counter()
        state = KVState(model)
        state.extend(_tokens(model, prefix, first=True, what="prefix text"))
        ids = _tokens(model, text, first=False, what="continuation text")
        logits = state.extend(ids)
        return Continuation(logits, len(state.token_ids) - len(ids), ids, time.perf_counter() - t0)


#: Why ``greedy_decode`` ended: the model's EOS, the caller's ``stop``, the model's window, or the budget.
StopReason = Literal["eos", "stop", "window", "max_new_tokens"]


@dataclass(frozen=True)
class Decoded:
    """What ``greedy_decode`` produced: the tokens (EOS among them only when kept), their text
    (``tokenizer.decode(tokens)``) and why decoding ended."""

    tokens: list[int]
    text: str
    stopped_by: StopReason


def greedy_decode(
    state: KVState,
    logits: torch.Tensor,
    *,
    max_new_tokens: int,
    keep_eos: bool,
    stop: Callable[[str], bool] | None = None,
) -> Decoded:
    """Greedy decoding on ``state`` from ``logits`` (float32 ``[n, vocab]``; row ``-1`` is the
    last position run). The one decode loop of the engine; call it under the profile's
    ``applied`` (``continue_from`` does), as every forward pass runs.

    Each step, in this order:

    1. the next token is ``argmax`` of the last logits row (the lowest id on a tie);
    2. the tokenizer's EOS ends decoding (``stopped_by="eos"``); it is among the returned tokens
       only when ``keep_eos`` (``generate`` reports it; the library and evaluations count only
       the text's tokens);
    3. otherwise the token is kept; ``stop(text so far)`` true ends decoding (``"stop"``);
    4. a token whose position would pass the model's window ends decoding (``"window"``): it is
       returned but never run;
    5. otherwise it runs (``state.extend([token])``) and its logits feed the next step.

    At most ``max_new_tokens`` tokens (EOS included when kept), else ``"max_new_tokens"``.
    """
    model = state.model
    eos = model.tokenizer.eos_token_id
    tokens: list[int] = []
    stopped_by: StopReason = "max_new_tokens"
    for _ in range(max_new_tokens):
        nxt = int(logits[-1].argmax())
        if nxt == eos:
            if keep_eos:
                tokens.append(nxt)
            stopped_by = "eos"
            break
        tokens.append(nxt)
        if stop is not None and stop(model.tokenizer.decode(tokens)):
            stopped_by = "stop"
            break
        if state.end + 1 > model.spec.window:
            stopped_by = "window"
            break
        logits = state.extend([nxt])  # [1, vocab]
    return Decoded(tokens, model.tokenizer.decode(tokens), stopped_by)


def continue_from(
    model: LoadedModel,
    profile: DeterminismProfile,
    artifact: LoadedArtifact | None,
    suffix_ids: list[int],
    *,
    max_new_tokens: int,
    keep_eos: bool,
    stop: Callable[[str], bool] | None = None,
    keep_last: int | None = 1,
) -> Decoded:
    """Restore ``artifact``'s chain at its own positions (``None``: an empty state), run
    ``suffix_ids`` after it in one ``KVState.extend``, then ``greedy_decode`` (see there for
    ``max_new_tokens``, ``keep_eos`` and ``stop``), all under ``profile``.

    ``keep_last``: how many of the suffix's logits rows the lm head computes (``KVState.extend``);
    decoding reads only the last, and ``None`` (every row) is what ``generate`` has always run.
    """
    with applied(profile):
        state = KVState(model) if artifact is None else KVState.restore(model, artifact.segments())
        logits = state.extend(suffix_ids, keep_last=keep_last)  # [keep_last or len(suffix_ids), vocab]
        return greedy_decode(state, logits, max_new_tokens=max_new_tokens, keep_eos=keep_eos, stop=stop)


def generate(
    model: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact, text: str, max_new_tokens: int
) -> dict[str, object]:
    """Greedy decoding from a graft: run ``text`` on the artifact, then up to ``max_new_tokens``
    (the EOS token, when reached, is the last of ``tokens`` and counted in ``decode_tokens``)."""
    t0 = time.perf_counter()
    ids = _tokens(model, text, first=False, what="text")
    # Every row's logits, as generate has always computed them: its tokens stay what they were.
    decoded = continue_from(model, profile, artifact, ids, max_new_tokens=max_new_tokens, keep_eos=True, keep_last=None)
    return {
        "text": decoded.text,
        "tokens": decoded.tokens,
        "decode_tokens": len(decoded.tokens),
        "prefix_tokens": artifact.statement.predicate.positions.end,
        "seconds": round(time.perf_counter() - t0, 6),
    }
