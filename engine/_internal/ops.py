"""The engine's operations: capture, graft, fresh and generate.

``fresh`` recomputes a prefix exactly as ``capture`` computes it (one forward pass over the
prefix tokens), then runs the continuation exactly as ``graft`` runs it (one forward pass over
the continuation on the cache), so own-position exactness means equal logits bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

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
    model: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact, text: str, *, shift: int = 0, keep_last: int | None = None
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


def generate(model: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact, text: str, max_new_tokens: int) -> dict[str, object]:
    """Greedy decoding from a graft: run ``text`` on the artifact, then up to ``max_new_tokens``."""
    with applied(profile):
        t0 = time.perf_counter()
        state = KVState.restore(model, artifact.segments())
        logits = state.extend(_tokens(model, text, first=False, what="text"))
        new: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(logits[-1].argmax())
            new.append(nxt)
            if nxt == model.tokenizer.eos_token_id or state.end + 1 > model.spec.window:
                break
            logits = state.extend([nxt])
        return {
            "text": model.tokenizer.decode(new),
            "tokens": new,
            "decode_tokens": len(new),
            "prefix_tokens": artifact.statement.predicate.positions.end,
            "seconds": round(time.perf_counter() - t0, 6),
        }


