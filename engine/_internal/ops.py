"""The engine's operations: capture, graft, fresh, and decoding from a graft.

``fresh`` recomputes a prefix exactly as ``capture`` computes it (one forward pass over the
prefix tokens), then runs the continuation exactly as ``graft`` runs it (one forward pass over
the continuation on the cache), so own-position exactness means equal logits bytes.

Every decode goes one way: ``continue_from`` restores an artifact's chain into a ``KVState``
(or starts empty), runs the suffix through ``KVState.extend`` and hands the last position's
logits to ``greedy_decode``, the one decode loop of a single sequence (``generate``,
``Library.ask`` and ``run_eval`` use it). ``decode_batch`` decodes many sequences per forward
pass for evaluations; both follow ``DecodeRule``, the one rule of what a step keeps and when it
ends. A step's token is the row's argmax (greedy, the default, exact) or, with ``Sampling``, a
draw reproducible from its seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvgraft.schemas import MAX_SEED, MAX_TEMPERATURE, DeterminismProfile

from .artifacts import Captured, LoadedArtifact, logits_digest, write_artifact
from .errors import InputTextError
from .kvstate import KVBatch, KVState, Segment
from .llamacpp import LlamaCppBatch, LlamaCppModel, LlamaCppState, load_llamacpp_model
from .models import LoadedModel, load_model
from .profiles import applied

#: A model either backend runs: transformers on torch, or llama.cpp (profile ``llamacpp-cpu``).
AnyModel = LoadedModel | LlamaCppModel
#: Its attention state: ``KVState`` or its llama.cpp counterpart, with the same ``extend``.
AnyState = KVState | LlamaCppState


def load_model_for(name: str, profile: DeterminismProfile) -> AnyModel:
    """Model ``name`` ready to run under ``profile``: llama.cpp's on the GGUF itself for a
    llama.cpp profile (``load_llamacpp_model``), else the converted model (``load_model``)."""
    if profile.device_kind == "llamacpp":
        return load_llamacpp_model(name)
    return load_model(name)


def _join(rows: KVBatch | LlamaCppBatch, state: AnyState) -> None:
    """Add ``state`` to ``rows``, a batch of its own backend."""
    if isinstance(rows, LlamaCppBatch) and isinstance(state, LlamaCppState):
        rows.add(state)
    elif isinstance(rows, KVBatch) and isinstance(state, KVState):
        rows.add(state)
    else:
        raise TypeError(f"a {type(state).__name__} cannot join a {type(rows).__name__}")


def prefix_rows(model: AnyModel) -> int | None:
    """How many logits rows a prefix's pass computes where only its last is read (``capture``,
    ``fresh``): llama.cpp's one (the prefix's state is the same whichever rows are output; a
    262K-token vocabulary over every position costs more than the prefix itself); the torch
    engine's every row, as its artifacts have always been made."""
    return 1 if isinstance(model, LlamaCppModel) else None


def new_state(model: AnyModel) -> AnyState:
    """An empty state of ``model`` in its backend."""
    return LlamaCppState(model) if isinstance(model, LlamaCppModel) else KVState(model)


def restored(model: AnyModel, chain: list[Segment], *, shift: int = 0) -> AnyState:
    """``chain`` restored into a state of ``model`` in its backend (``KVState.restore``)."""
    if isinstance(model, LlamaCppModel):
        return LlamaCppState.restore(model, chain, shift=shift)
    return KVState.restore(model, chain, shift=shift)


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


def _tokens(model: AnyModel, text: str, *, first: bool, what: str) -> list[int]:
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
    #: Wall time of the whole: the prefix's state made, then the continuation's pass.
    seconds: float
    #: Of ``seconds``, the time until the prefix's state existed: ``KVState.restore`` for a graft,
    #: the prefix's recompute for ``fresh``; 0 where prefix and continuation ran as one pass.
    state_seconds: float = 0.0

    @property
    def pass_seconds(self) -> float:
        """Of ``seconds``, the continuation's own pass (its tokenizing included); the whole
        where prefix and continuation ran as one pass."""
        return self.seconds - self.state_seconds

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
    model: AnyModel,
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
            state, start = new_state(model), 0
        else:
            state = restored(model, parent.segments())
            start = state.end
        ids = _tokens(model, text, first=parent is None, what="text")
        logits = state.extend(ids, keep_last=prefix_rows(model))
        return write_artifact(
            out, model=model, profile=profile, state=state, start=start, last_logits=logits[-1],
            text=text, parent=parent, key=key, passphrase=passphrase,
        )


def graft(
    model: AnyModel,
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
        state = restored(model, artifact.segments(), shift=shift)
        t1 = time.perf_counter()
        ids = _tokens(model, text, first=False, what="continuation text")
        logits = state.extend(ids, keep_last=keep_last)
        return Continuation(logits, artifact.statement.predicate.positions.end, ids, time.perf_counter() - t0, t1 - t0)


def fresh(model: AnyModel, profile: DeterminismProfile, prefix: str, text: str) -> Continuation:
    """Recompute ``prefix`` as capture does, then run ``text`` as graft does."""
    with applied(profile):
        t0 = time.perf_counter()
        state = new_state(model)
        state.extend(_tokens(model, prefix, first=True, what="prefix text"), keep_last=prefix_rows(model))
        t1 = time.perf_counter()
        ids = _tokens(model, text, first=False, what="continuation text")
        logits = state.extend(ids)
        return Continuation(logits, len(state.token_ids) - len(ids), ids, time.perf_counter() - t0, t1 - t0)


@dataclass(frozen=True)
class Sampling:
    """How ``DecodeRule`` picks each token from a logits row.

    ``temperature`` 0 (the default, ``GREEDY``) is greedy: the row's argmax, the lowest id on a
    tie, exact and reproducible with no seed. Above 0 the token is drawn from
    ``softmax(row / temperature)`` computed in float64 on the CPU, kept to the smallest set of
    most probable tokens whose probability reaches ``top_p`` (nucleus sampling; 1 keeps all;
    ties in probability ordered by id), with a ``torch.Generator`` seeded with ``seed`` and
    drawn from once per token: the same logits and seed give the same tokens on any machine
    torch runs on. Sampling needs a seed: the caller picks one (a server draws a random one) and
    reports it, so every sampled answer can be drawn again.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InputTextError(f"temperature {self.temperature} is not between 0 and {MAX_TEMPERATURE:g}",
                                 hint="pass 0 for greedy decoding, or up to 2")
        if not 0.0 < self.top_p <= 1.0:
            raise InputTextError(f"top_p {self.top_p} is not above 0 and at most 1", hint="pass 1 to keep every token")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InputTextError(f"seed {self.seed} is not between 0 and 2**63 - 1", hint="pass a non-negative integer")
        if not self.greedy and self.seed is None:
            raise InputTextError(f"sampling at temperature {self.temperature:g} needs a seed, to be drawn again",
                                 hint="pass a seed")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0): ``top_p`` and ``seed`` play no part then."""
        return self.temperature == 0.0

    def offset(self, n: int) -> Sampling:
        """The sampling of the ``n``-th of several draws (an evaluation's problem, a request's
        choice): the same, with ``seed + n`` (wrapped into the seed range); greedy stays greedy."""
        if self.greedy or self.seed is None:
            return self
        return Sampling(self.temperature, self.top_p, (self.seed + n) % (MAX_SEED + 1))

    def chooser(self) -> Callable[[torch.Tensor], int]:
        """A function from a logits row to the next token, with its own generator (one per sequence)."""
        if self.greedy or self.seed is None:
            return _argmax
        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.seed)
        temperature, top_p = self.temperature, self.top_p

        def choose(row: torch.Tensor) -> int:
            probs = torch.softmax(row.detach().to("cpu", torch.float64) / temperature, dim=-1)
            if top_p >= 1.0:
                return int(torch.multinomial(probs, 1, generator=generator))
            ordered, order = torch.sort(probs, descending=True, stable=True)
            # Keep a token while the mass before it is below top_p: the first always stays.
            kept = torch.where(torch.cumsum(ordered, 0) - ordered < top_p, ordered, torch.zeros_like(ordered))
            return int(order[torch.multinomial(kept, 1, generator=generator)])

        return choose


def _argmax(row: torch.Tensor) -> int:
    """The index of the row's largest value, the first on a tie (torch's and numpy's rule alike).
    numpy's on the CPU: one thread, where torch's parallel argmax wakes OpenMP threads whose
    spinning takes the cores from llama.cpp's own threads between steps (a 262K-word vocabulary
    decoded 16 rows at a time lost 10% to it)."""
    if row.device.type == "cpu":
        return int(np.argmax(row.detach().numpy()))
    return int(row.argmax())


#: Greedy decoding: the default everywhere, for exactness.
GREEDY = Sampling()


#: Why ``greedy_decode`` ended: the model's EOS, the caller's ``stop``, the model's window, or the budget.
StopReason = Literal["eos", "stop", "window", "max_new_tokens"]


@dataclass(frozen=True)
class Decoded:
    """What ``greedy_decode`` produced: the tokens (EOS among them only when kept), their text
    (``tokenizer.decode(tokens)``) and why decoding ended."""

    tokens: list[int]
    text: str
    stopped_by: StopReason


class DecodeRule:
    """One sequence's greedy decoding rule, fed one logits row at a time: the one rule of the
    engine's decoding, which ``greedy_decode`` (one sequence) and ``decode_batch`` (many, one
    forward pass per step) both follow.

    ``next(row)`` takes the logits of the last position run (float32 ``[vocab]``) and, in this
    order:

    1. the next token is ``argmax`` of the row (the lowest id on a tie), or with a non-greedy
       ``sampling`` a draw from it (``Sampling``; each rule has its own seeded generator);
    2. the tokenizer's EOS ends decoding (``stopped_by="eos"``); it is among the returned tokens
       only when ``keep_eos`` (``generate`` reports it; the library and evaluations count only
       the text's tokens);
    3. otherwise the token is kept; ``stop(text so far)`` true ends decoding (``"stop"``);
    4. a token whose position would pass the model's window ends decoding (``"window"``): it is
       kept but never run;
    5. the ``max_new_tokens``-th token (EOS included when kept) ends decoding
       (``"max_new_tokens"``): kept, never run;
    6. otherwise ``next`` returns the token, which the caller runs at position ``end`` and
       whose logits it passes to the next call.

    ``next`` returns None once decoding has ended; ``decoded()`` is then the result.
    """

    def __init__(self, model: AnyModel, end: int, *, max_new_tokens: int, keep_eos: bool,
                 stop: Callable[[str], bool] | None = None, sampling: Sampling = GREEDY) -> None:
        self.model = model
        self._choose = sampling.chooser()
        #: The position the next token runs at (the sequence's length so far).
        self.end = end
        self.max_new_tokens = max_new_tokens
        self.keep_eos = keep_eos
        self.stop = stop
        self.tokens: list[int] = []
        # A budget of no tokens has ended before it began.
        self.stopped_by: StopReason | None = None if max_new_tokens > 0 else "max_new_tokens"

    def next(self, row: torch.Tensor) -> int | None:
        """The token to run next at position ``end``, or None when decoding has ended (see the class)."""
        if self.stopped_by is not None:
            return None
        nxt = self._choose(row)
        if nxt == self.model.tokenizer.eos_token_id:
            if self.keep_eos:
                self.tokens.append(nxt)
            self.stopped_by = "eos"
            return None
        self.tokens.append(nxt)
        if self.stop is not None and self.stop(self.model.tokenizer.decode(self.tokens)):
            self.stopped_by = "stop"
        elif self.end + 1 > self.model.spec.window:
            self.stopped_by = "window"
        elif len(self.tokens) >= self.max_new_tokens:
            self.stopped_by = "max_new_tokens"
        else:
            self.end += 1
            return nxt
        return None

    def decoded(self) -> Decoded:
        """What was decoded; only once ``next`` has returned None."""
        if self.stopped_by is None:
            raise RuntimeError("DecodeRule.decoded() called before decoding ended")
        return Decoded(self.tokens, self.model.tokenizer.decode(self.tokens), self.stopped_by)


def greedy_decode(
    state: AnyState,
    logits: torch.Tensor,
    *,
    max_new_tokens: int,
    keep_eos: bool,
    stop: Callable[[str], bool] | None = None,
    sampling: Sampling = GREEDY,
) -> Decoded:
    """Decoding on ``state`` from ``logits`` (float32 ``[n, vocab]``; row ``-1`` is the last
    position run), by ``DecodeRule``, each kept token run through ``state.extend``: the engine's
    one decode loop of a single sequence, greedy unless ``sampling`` says otherwise. Call it
    under the profile's ``applied`` (``continue_from`` does), as every forward pass runs."""
    rule = DecodeRule(state.model, state.end, max_new_tokens=max_new_tokens, keep_eos=keep_eos, stop=stop,
                      sampling=sampling)
    while (nxt := rule.next(logits[-1])) is not None:
        logits = state.extend([nxt])  # [1, vocab]
    return rule.decoded()


@dataclass(frozen=True)
class DecodeJob:
    """One sequence for ``decode_batch``: what ``continue_from`` takes, as a value."""

    artifact: LoadedArtifact | None
    suffix_ids: list[int]
    max_new_tokens: int
    keep_eos: bool
    stop: Callable[[str], bool] | None = None
    sampling: Sampling = GREEDY


def decode_batch(
    model: AnyModel,
    profile: DeterminismProfile,
    jobs: Iterable[DecodeJob],
    *,
    batch: int,
    on_done: Callable[[int, Decoded], None],
    refill: Callable[[int], Sequence[DecodeJob]] | None = None,
) -> None:
    """Decode every job as ``continue_from`` would, up to ``batch`` of them per forward pass.

    ``refill`` (continuous batching, as a server needs it): once ``jobs`` is exhausted, whenever
    rows are free before a step, ``refill(free rows)`` is asked for at most that many more jobs
    (none now is an empty sequence; it is asked again before the next step). Their indices
    continue after the jobs'. Decoding ends when no row runs and ``refill`` gives nothing.

    Each job is prefilled alone when a row is free (its artifact restored, its suffix run by
    ``KVState.extend``) and joins a ``KVBatch``; every step runs one token per row in one pass
    and feeds each row's logits to its own ``DecodeRule``; a row leaves when its rule ends, and
    ``on_done(job index, decoded)`` is called then, in the order rows end. ``jobs`` is read
    lazily, one job per free row, so only ``batch`` artifacts are held at a time.

    The rows' numbers differ from a one-row run only by reduction order (see ``KVBatch``):
    a batched evaluation is reproducible for the same jobs and ``batch``, and is not an
    exactness claim. Own-position profiles only: the schedule-invariant kernels are fixed to one
    row.
    """
    if batch < 1:
        raise InputTextError(f"batch {batch} is not a positive number of rows", hint="pass --batch 1 or more")
    if profile.exactness != "own-position":
        raise InputTextError(f"profile {profile.name} is {profile.exactness}; batched decoding needs an own-position profile",
                             hint="decode one problem at a time (batch 1) under this profile")
    if isinstance(model, LlamaCppModel):
        batch = min(batch, model.settings.n_seq_max)  # one llama.cpp sequence per row
    pending: Iterator[DecodeJob] = iter(jobs)
    taken = 0  # the next job's index
    with applied(profile):
        rows: KVBatch | LlamaCppBatch = LlamaCppBatch(model) if isinstance(model, LlamaCppModel) else KVBatch(model)
        running: list[tuple[int, DecodeRule]] = []
        tokens: list[int] = []  # the token each running row runs next
        more = True
        while True:
            while more and len(running) < batch:
                job = next(pending, None)
                if job is None and refill is not None:
                    pending = iter(refill(batch - len(running))[:batch - len(running)])
                    job = next(pending, None)
                    if job is None:
                        break  # nothing waits now: step the running rows, then ask again
                if job is None:
                    more = False
                    break
                i, taken = taken, taken + 1
                state = new_state(model) if job.artifact is None else restored(model, job.artifact.segments())
                logits = state.extend(job.suffix_ids, keep_last=1)  # [1, vocab]
                rule = DecodeRule(model, state.end, max_new_tokens=job.max_new_tokens, keep_eos=job.keep_eos, stop=job.stop,
                                  sampling=job.sampling)
                first = rule.next(logits[-1])
                if first is None:
                    on_done(i, rule.decoded())
                    continue
                _join(rows, state)
                running.append((i, rule))
                tokens.append(first)
            if not running:
                return
            logits = rows.step(tokens)  # [rows, vocab]
            ended: list[int] = []
            tokens = []
            for r, (i, rule) in enumerate(running):
                nxt = rule.next(logits[r])
                if nxt is None:
                    ended.append(r)
                    on_done(i, rule.decoded())
                else:
                    tokens.append(nxt)
            if ended:
                rows.remove(ended)
                gone = set(ended)
                running = [run for r, run in enumerate(running) if r not in gone]


def continue_from(
    model: AnyModel,
    profile: DeterminismProfile,
    artifact: LoadedArtifact | None,
    suffix_ids: list[int],
    *,
    max_new_tokens: int,
    keep_eos: bool,
    stop: Callable[[str], bool] | None = None,
    keep_last: int | None = 1,
    sampling: Sampling = GREEDY,
) -> Decoded:
    """Restore ``artifact``'s chain at its own positions (``None``: an empty state), run
    ``suffix_ids`` after it in one ``KVState.extend``, then ``greedy_decode`` (see there for
    ``max_new_tokens``, ``keep_eos``, ``stop`` and ``sampling``), all under ``profile``.

    ``keep_last``: how many of the suffix's logits rows the lm head computes (``KVState.extend``);
    decoding reads only the last, and ``None`` (every row) is what ``generate`` has always run.
    """
    with applied(profile):
        state = new_state(model) if artifact is None else restored(model, artifact.segments())
        logits = state.extend(suffix_ids, keep_last=keep_last)  # [keep_last or len(suffix_ids), vocab]
        return greedy_decode(state, logits, max_new_tokens=max_new_tokens, keep_eos=keep_eos, stop=stop, sampling=sampling)


def generate(
    model: AnyModel, profile: DeterminismProfile, artifact: LoadedArtifact, text: str, max_new_tokens: int
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
