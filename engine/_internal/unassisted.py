"""The model alone, asked without a library: ``ask_model`` for one question, ``ask_model_stream``
for questions that keep arriving (continuous batching, as ``engine serve`` runs base answers on
llama.cpp). Each answer is ``unassisted``, what a library reports when nothing is grafted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvgraft.schemas import DeterminismProfile

from .errors import InputTextError
from .library import NOTHING_GRAFTED, Answer, EnergyMeter, check_window, parameters_of
from .ops import GREEDY, AnyModel, Decoded, DecodeJob, Sampling, continue_from, decode_batch


def ask_model(model: AnyModel, profile: DeterminismProfile, question: str, *, max_new_tokens: int = 256,
              stop: Callable[[str], bool] | None = None, sampling: Sampling = GREEDY) -> Answer:
    """The model's own answer to ``question`` (greedy unless ``sampling``), with no library: the question's tokens
    (after BOS) on an empty state, decoded until EOS, ``max_new_tokens`` or ``stop`` (called
    after every token with the text so far). Kind ``unassisted``, method ``none``, no entry, no
    extracted answer (there is no dataset kind to read one by), signature ``NOTHING_GRAFTED``;
    finished only when it ended at EOS."""
    t0 = time.perf_counter()
    energy = EnergyMeter(parameters_of(model))
    energy.start()
    ids = _question_ids(model, question)
    decoded = continue_from(model, profile, None, ids, max_new_tokens=max_new_tokens, keep_eos=False, stop=stop,
                            sampling=sampling)
    joules, method = energy.stop(len(ids) + len(decoded.tokens))
    return _answer(question, ids, decoded, sampling, time.perf_counter() - t0, joules, method)


def _question_ids(model: AnyModel, question: str) -> list[int]:
    """The question's tokens (after BOS); refused when none, or past the model's window."""
    ids = model.tokenizer.encode(question, first=True)
    if not ids:
        raise InputTextError("the question tokenizes to no tokens", hint="ask a question with some text")
    check_window(model, 0, ids)
    return ids


def _answer(question: str, ids: list[int], decoded: Decoded, sampling: Sampling, seconds: float, joules: float,
            method: str) -> Answer:
    """What the model alone answered (the module docstring's kind, and ``ask_model``'s fields)."""
    return Answer(
        question=question, kind="unassisted", finished=decoded.stopped_by == "eos", answer=None, text=decoded.text,
        prompt=question, entry=None, method="none", score=0.0,
        prompt_tokens=len(ids), decode_tokens=len(decoded.tokens), context_tokens=len(ids),
        seconds=seconds, energy_joules=joules, energy_method=method, signature=NOTHING_GRAFTED,
        stopped_by=decoded.stopped_by, seed=None if sampling.greedy else sampling.seed,
    )


#: What a caller of ``ask_model_stream`` knows each question by.
K = TypeVar("K")


@dataclass(frozen=True)
class Question:
    """One question for ``ask_model_stream``: what ``ask_model`` takes, as a value."""

    question: str
    max_new_tokens: int = 256
    stop: Callable[[str], bool] | None = None
    sampling: Sampling = GREEDY


def ask_model_stream(
    model: AnyModel,
    profile: DeterminismProfile,
    more: Callable[[int], Sequence[tuple[K, Question]]],
    *,
    on_answer: Callable[[K, Answer], None],
    on_refused: Callable[[K, InputTextError], None],
    batch: int,
) -> None:
    """``ask_model`` for questions that keep arriving, decoded together (continuous batching:
    ``decode_batch`` with ``refill``; one forward pass, or one llama.cpp batch, per step for every
    unfinished question, at most ``batch``).

    ``more(free)`` is asked, whenever rows are free, for at most ``free`` new ``(key, question)``
    pairs (none now: an empty sequence); asking ends when it gives none and nothing runs. Each
    answer goes to ``on_answer(key, answer)`` as soon as its decode ends, as ``ask_model``
    reports it but for the numbers of a batched run (see ``KVBatch``); a question that tokenizes
    to nothing or past the window goes to ``on_refused`` and is never run. Energy: the meter's
    joules over the answer's own span, times its share of the tokens the run processed in that
    span (prompt tokens of every question started, decoded tokens of every answer ended).
    """
    processed = 0  # tokens counted so far (see above)
    started: dict[int, tuple[K, Question, list[int], float, int, EnergyMeter]] = {}
    count = 0  # decode_batch's index of the next job

    def jobs(free: int) -> list[DecodeJob]:
        nonlocal processed, count
        made: list[DecodeJob] = []
        for key, q in more(free):
            try:
                tokens = _question_ids(model, q.question)
            except InputTextError as e:
                on_refused(key, e)
                continue
            energy = EnergyMeter(parameters_of(model))
            energy.start()
            started[count + len(made)] = (key, q, tokens, time.perf_counter(), processed, energy)
            processed += len(tokens)
            made.append(DecodeJob(None, tokens, max_new_tokens=q.max_new_tokens, keep_eos=False, stop=q.stop,
                                  sampling=q.sampling))
        count += len(made)
        return made

    def done(i: int, d: Decoded) -> None:
        nonlocal processed
        key, q, tokens, t0, at, energy = started.pop(i)
        processed += len(d.tokens)
        own = len(tokens) + len(d.tokens)
        joules, method = energy.stop(own)
        if method == "measured":
            joules *= own / max(processed - at, own)
        on_answer(key, _answer(q.question, tokens, d, q.sampling, time.perf_counter() - t0, joules, method))

    decode_batch(model, profile, [], batch=batch, on_done=done, refill=jobs)
