"""Web UI fixtures: a registry filled with a small signed world, served in-process and for real.

The world: a chain of three artifacts (root -> middle -> leaf) and a second child of the root,
an own-position exactness record and a shifted one over the root and middle, an evaluation
record over the shipped GSM8K test set, and an artifact whose text and model name hold hostile
HTML. Everything is signed with real Ed25519 keys and published through the real API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgraft.schemas import (
    DatasetRef,
    EvaluationAggregates,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    hex_of,
    sha256_bytes,
)
from kvgraft.verifier import harness_hashes, load_dataset
from tests.registry.conftest import (
    REPO,
    Artifact,
    Harness,
    Key,
    Server,
    artifact,
    harness,
    make_key,
    model_ref,
    profile,
    running_server,
    subject,
)

SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
HOSTILE_TEXT = f"hostile {SCRIPT} and {IMG} end"
HOSTILE_MODEL = f"evil{IMG}"
GSM8K = REPO / "data" / "datasets" / "gsm8k_test.jsonl"
SCREENSHOTS = REPO / "test-artifacts" / "web"


@dataclass(frozen=True)
class World:
    """What the fixture published, to navigate by."""

    root: Artifact
    middle: Artifact
    leaf: Artifact
    sibling: Artifact
    hostile: Artifact
    exactness_digest: str
    shifted_digest: str
    evaluation_digest: str
    entries: int


def _exactness(prefixes: list[Artifact], *, shift: int, kls: list[float]) -> tuple[ExactnessStatement, list[bytes]]:
    """An exactness record over ``prefixes``; bit-equal exactly when KL is 0."""
    samples = []
    files = []
    for i, (prefix, kl) in enumerate(zip(prefixes, kls, strict=True)):
        fresh = f"fresh-{i}-{shift}".encode()
        graft = fresh if kl == 0 else f"graft-{i}-{shift}".encode()
        files += [fresh, graft]
        samples.append(
            ExactnessSample(
                index=i, prefix_artifact=prefix.digest, prefix_tokens=prefix.statement.predicate.positions.end,
                continuation_digest=sha256_bytes(f"cont-{i}".encode()), continuation_tokens=4,
                fresh_logits_sha256=sha256_bytes(fresh), graft_logits_sha256=sha256_bytes(graft),
                bitwise_equal=kl == 0, kl_divergence=kl, argmax_agreement=1.0 if kl < 0.01 else 0.75, shift=shift,
            )
        )
    subjects = [subject(f"logits/{hex_of(sha256_bytes(f))}.f32", f) for f in dict.fromkeys(files)]
    statement = ExactnessStatement(
        subject=subjects,
        predicate=ExactnessPredicate(
            model=model_ref(), profile=profile(), level="shifted" if shift else "own-position", shift=shift, vocab_size=8,
            seed=0, samples=samples,
            summary=ExactnessSummary(
                samples=len(samples), bitwise_equal=sum(s.bitwise_equal for s in samples),
                argmax_agree_all=sum(s.argmax_agreement == 1.0 for s in samples),
                max_kl_divergence=max(kls), mean_argmax_agreement=sum(s.argmax_agreement for s in samples) / len(samples),
            ),
        ),
    )
    return statement, list(dict.fromkeys(files))


def _evaluation(library: Artifact) -> tuple[EvaluationStatement, bytes]:
    docs = load_dataset(GSM8K).docs
    outputs = b'{"doc_id": 0, "output": "18"}\n{"doc_id": 1, "output": "3"}\n{"doc_id": 2, "output": "7"}\n'
    items = [
        EvaluationItem(
            doc_id=i, doc_hash=harness_hashes(docs[i], "", "").doc_hash, prompt_hash=hex_of(sha256_bytes(f"p{i}".encode())),
            target_hash=hex_of(sha256_bytes(f"t{i}".encode())), output_hash=hex_of(sha256_bytes(f"o{i}".encode())),
            extracted_answer=answer, correct=correct, prompt_tokens=100 + i, decode_tokens=20 + i,
            library_entry=library.digest if i == 0 else None,
        )
        for i, (answer, correct) in enumerate([("18", True), ("3", True), ("7", False)])
    ]
    statement = EvaluationStatement(
        subject=[subject("outputs.jsonl", outputs)],
        predicate=EvaluationPredicate(
            model=model_ref(), profile=profile(),
            dataset=DatasetRef(name="gsm8k_test.jsonl", digest=sha256_bytes(GSM8K.read_bytes())),
            settings={"max_new_tokens": 64}, items=items,
            aggregates=EvaluationAggregates(items=3, correct=2, accuracy=2 / 3, prompt_tokens=303, decode_tokens=63),
            outputs_digest=sha256_bytes(outputs), library_artifacts=[library.digest],
        ),
    )
    return statement, outputs


def publish_world(h: Harness, alice: Key, bob: Key) -> World:
    """Publish the small world through ``h``'s API."""
    root = artifact("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.")
    middle = artifact("Chlorophyll absorbs mostly blue and red light.", parent=root)
    leaf = artifact("The Calvin cycle fixes carbon in the stroma.", parent=middle)
    sibling = artifact("Plants also respire at night.", parent=root)
    hostile_base = artifact(HOSTILE_TEXT)
    hostile = dataclasses.replace(
        hostile_base,
        statement=hostile_base.statement.model_copy(
            update={"predicate": hostile_base.statement.predicate.model_copy(update={"model": model_ref(HOSTILE_MODEL)})}
        ),
    )
    for art in (root, middle, leaf):
        h.publish_artifact(art, alice)
    h.publish_artifact(sibling, bob, "bob")
    h.publish_artifact(hostile, bob, "bob")
    digests = []
    for shift, kls in ((0, [0.0, 0.0]), (3, [0.0123, 0.0456])):
        statement, files = _exactness([root, middle], shift=shift, kls=kls)
        for f in files:
            assert h.put_blob(f).status_code in (200, 201)
        r = h.publish(alice.sign(statement))
        assert r.status_code == 201, r.text
        digests.append(r.json()["entry"]["digest"])
    evaluation, outputs = _evaluation(root)
    assert h.put_blob(outputs).status_code in (200, 201)
    r = h.publish(alice.sign(evaluation))
    assert r.status_code == 201, r.text
    return World(root, middle, leaf, sibling, hostile, digests[0], digests[1], r.json()["entry"]["digest"], 8)


@pytest.fixture(scope="session")
def web_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Key]:
    d = tmp_path_factory.mktemp("web-keys")
    return {n: make_key(d, n) for n in ("alice", "bob", "eve")}


@pytest.fixture(scope="session")
def world_data(tmp_path_factory: pytest.TempPathFactory, web_keys: dict[str, Key]) -> tuple[Path, World]:
    """A data directory holding the world (published in-process, then closed)."""
    data = tmp_path_factory.mktemp("web") / "data"
    with harness(data, web_keys) as h:
        world = publish_world(h, web_keys["alice"], web_keys["bob"])
    return data, world


@pytest.fixture(scope="module")
def ui(world_data: tuple[Path, World], web_keys: dict[str, Key]) -> Iterator[tuple[Harness, World]]:
    """The world's registry in-process (a Litestar test client)."""
    data, world = world_data
    with harness(data, web_keys) as h:
        yield h, world


@pytest.fixture(scope="module")
def live(world_data: tuple[Path, World]) -> Iterator[tuple[Server, World]]:
    """``kvgraft serve`` over the world, on a free 127.0.0.1 port."""
    data, world = world_data
    with running_server(data) as server:
        yield server, world

