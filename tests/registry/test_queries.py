"""The registry's one read model (registry/_internal/queries.py): named rows, one filter per listing
shared by the API and the pages, one bounded lineage walk."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal import queries
from kvgraft.registry._internal.errors import BadDigestError, BadRequestError, QueryTooLargeError
from kvgraft.registry._internal.queries import ArtifactFilter, RecordFilter, Seek
from kvgraft.registry._internal.service import Registry

from .conftest import REPO, Artifact, Harness, Key, artifact, exactness_record, harness


@dataclass(frozen=True)
class Filled:
    h: Harness
    registry: Registry
    chain: list[Artifact]
    other: Artifact
    record: str


@pytest.fixture
def filled(tmp_path: Path, keys: dict[str, Key]) -> Iterator[Filled]:
    """root -> a -> b -> c by alice, a root of another model by bob, one exactness record over the root."""
    with harness(tmp_path / "data", keys) as h:
        chain = [artifact("root words here")]
        for text in ("first child words", "second child", "third child light"):
            chain.append(artifact(text, parent=chain[-1]))
        for link in chain:
            h.publish_artifact(link, keys["alice"])
        other = artifact("another model light", model="other-model")
        h.publish_artifact(other, keys["bob"], "bob")
        logits = b"logits-bytes"
        assert h.put_blob(logits).status_code in (200, 201)
        r = h.publish(keys["alice"].sign(exactness_record(chain[0], logits)))
        assert r.status_code == 201, r.text
        yield Filled(h, h.client.app.state.registry, chain, other, r.json()["entry"]["digest"])


def test_entry_rows_have_named_columns_matching_the_api_document(filled: Filled) -> None:
    db = filled.registry.db
    row = queries.entry_at(db, 1)
    assert row is not None and row.artifact is not None
    doc = filled.h.client.get("/v1/entries/1").json()["entry"]
    assert (row.log_index, row.digest, row.kind, row.publisher, list(row.keyids), row.size) == (
        doc["log_index"], doc["digest"], doc["kind"], doc["publisher"], doc["keyids"], doc["size"]
    )
    assert row.leaf_hash.hex() == doc["leaf_hash"]
    assert row.artifact.digest == filled.chain[1].digest and row.artifact.parent == filled.chain[0].digest
    assert [row.artifact.position_start, row.artifact.position_end] == doc["artifact"]["positions"]
    assert queries.entry_by_digest(db, row.digest) == row
    assert queries.index_of(db, row.digest) == 1
    assert queries.entry_at(db, 99) is None and queries.index_of(db, "sha256:" + "0" * 64) is None
    subjects = queries.subjects(db, [1])[1]
    assert [s._asdict() for s in subjects] == doc["subjects"]
    stored = queries.stored_envelope(db, 1)
    assert stored is not None and stored.digest == row.digest
    assert filled.h.client.get("/v1/entries/1/envelope").content == stored.envelope


@pytest.mark.parametrize(
    "chosen",
    [
        ArtifactFilter(),
        ArtifactFilter(parent="none"),
        ArtifactFilter(model="other-model"),
        ArtifactFilter(publisher="alice", q="light"),
        ArtifactFilter(profile="cpu-fp32", q="child"),
    ],
)
def test_the_api_and_the_pages_list_artifacts_through_one_filter(filled: Filled, chosen: ArtifactFilter) -> None:
    db, settings = filled.registry.db, filled.registry.settings
    where = chosen.where(settings)
    oldest_first = queries.entries(db, where, Seek(100)).rows
    newest_first = queries.summaries(db, where, Seek(100, before=2**62), text_chars=10).rows
    assert [r.log_index for r in oldest_first] == [r.log_index for r in reversed(newest_first)]
    assert queries.count(db, where) == len(oldest_first)
    params = {k: v for k, v in vars(chosen).items() if v}
    api = filled.h.client.get("/v1/artifacts", params={**params, "limit": 100}).json()["items"]
    assert [a["log_index"] for a in api] == [r.log_index for r in oldest_first]
    page = filled.h.client.get("/artifacts", params=params).text
    shown = set(re.findall(r'href="/artifacts/(sha256:[0-9a-f]{64})"', page))  # rows, and their parents
    assert {r.artifact_digest for r in newest_first} <= shown
    assert shown <= {r.artifact_digest for r in newest_first} | {r.parent for r in newest_first}
    assert all(r.text is None or len(r.text) <= 10 for r in newest_first)


def test_pages_of_a_listing_say_whether_more_follow(filled: Filled) -> None:
    db = filled.registry.db
    where = ArtifactFilter().where(filled.registry.settings)
    first = queries.entries(db, where, Seek(2))
    assert [r.log_index for r in first.rows] == [0, 1] and first.more
    rest = queries.entries(db, where, Seek(10, after=first.rows[-1].log_index))
    assert [r.log_index for r in rest.rows] == [2, 3, 4] and not rest.more
    newest = queries.summaries(db, where, Seek(2, before=4), text_chars=5)
    assert [r.log_index for r in newest.rows] == [3, 2] and newest.more


def test_filters_refuse_bad_values_before_any_query() -> None:
    settings = RegistrySettings(max_query_length=20)
    with pytest.raises(BadDigestError):
        ArtifactFilter(parent="sha256:XYZ").where(settings)
    with pytest.raises(QueryTooLargeError):
        ArtifactFilter(q="x" * 21).where(settings)
    with pytest.raises(BadRequestError) as refused:
        RecordFilter(kind="artifact").where(artifacts_hint="look elsewhere")
    assert refused.value.hint == "look elsewhere"
    with pytest.raises(BadDigestError):
        RecordFilter(artifact="nope").where(artifacts_hint="")
    assert RecordFilter(kind="https://kvgraft.dev/exactness/v1").resolved_kind(artifacts_hint="") == "exactness"


def test_records_filter_finds_the_records_of_an_artifact(filled: Filled) -> None:
    db = filled.registry.db
    where = RecordFilter(artifact=filled.chain[0].digest, kind="exactness").where(artifacts_hint="")
    rows = queries.entries(db, where, Seek(10)).rows
    assert [r.digest for r in rows] == [filled.record]
    assert queries.count(db, RecordFilter(artifact=filled.other.digest).where(artifacts_hint="")) == 0


def test_the_lineage_walk_is_bounded_and_cycle_safe(filled: Filled) -> None:
    db = filled.registry.db
    chain = filled.chain
    leaf = chain[-1]
    walk = queries.ancestors(db, leaf.digest, chain[-2].digest, 10)
    assert [a.digest for a in walk.ancestors] == [c.digest for c in reversed(chain[:-1])] and walk.cut is None
    short = queries.ancestors(db, leaf.digest, chain[-2].digest, 2)
    assert [a.digest for a in short.ancestors] == [chain[2].digest, chain[1].digest]
    assert (short.cut, short.cut_at) == ("depth", chain[0].digest)
    # A parent with no entry ends the walk, listed without one.
    missing = "sha256:" + "e" * 64
    assert [(a.digest, a.entry) for a in queries.ancestors(db, leaf.digest, missing, 10).ancestors] == [(missing, None)]
    # Old data may hold a cycle: the root's parent is the leaf. Walked once, then cut.
    db.query("UPDATE entries SET parent = ? WHERE artifact_digest = ?", [leaf.digest, chain[0].digest])
    cycle = queries.ancestors(db, leaf.digest, chain[-2].digest, 100)
    assert len(cycle.ancestors) == 3 and (cycle.cut, cycle.cut_at) == ("cycle", leaf.digest)
    assert len(filled.h.client.get(f"/v1/artifacts/{chain[1].digest}").json()["lineage"]["parents"]) == 3
    assert "loops back on itself" in filled.h.client.get(f"/artifacts/{chain[1].digest}").text


def test_counts_facets_and_publishers(filled: Filled) -> None:
    db = filled.registry.db
    totals = queries.totals(db)
    assert totals.kinds == {"artifact": 5, "exactness": 1} and totals.publishers == 2 and totals.keys == 2
    assert queries.kinds_by_publisher(db) == {"alice": {"artifact": 4, "exactness": 1}, "bob": {"artifact": 1}}
    facets = queries.artifact_facets(db)
    assert facets.models == ["other-model", "tiny-llama-test"] and facets.publishers == ["alice", "bob"]
    assert queries.publisher_names(db) == ["alice", "bob"]
    assert len(queries.publisher_keys(db, "alice")) == 1 and queries.publisher_keys(db, "nobody") == ()
    children = queries.children(db, filled.chain[0].digest)
    assert [c.artifact.digest for c in children if c.artifact is not None] == [filled.chain[1].digest]
    listing = queries.checkpoints(db, 2**62, 3)
    assert [c.tree_size for c in listing.rows] == [6, 5, 4] and listing.more
    assert set(queries.checkpoint_roots(db, [0, 6, 99])) == {0, 6}
    assert queries.checkpoint_note(db, 6) == filled.registry.head.note


def _source(path: str) -> str:
    return (REPO / "registry" / "_internal" / path).read_text()


def test_the_api_and_the_pages_read_only_through_the_read_model() -> None:
    ui = _source("http/ui.py")
    assert not re.search(r"\b(SELECT|FROM entries|WHERE)\b", ui), "ui.py holds SQL; it belongs in queries.py"
    # Positional column indexes (r[7], row[0]): rows are read by name.
    for name in ("http/ui.py", "service.py", "reader.py", "documents.py"):
        text = _source(name)
        assert not re.search(r"\b(r|row|first|current)\[\d+\]|\]\[\d+\]", text), f"{name} reads a column by position"
    for name in ("reader.py", "documents.py"):
        assert "SELECT" not in _source(name), f"{name} queries directly; reads delegate to queries.py"
