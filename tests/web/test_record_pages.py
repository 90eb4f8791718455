"""Record pages (issue 38): an evaluation shows its arm (base or library) and its library first,
not buried in a settings dump full of ``None``; a wrong item shows the expected answer beside the
claimed one; evaluation, pre-registration and replay pages link to each other both ways."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgraft.schemas import (
    EXPECTED_OUTPUTS_FILE,
    OUTPUTS_FILE,
    EvaluationStatement,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
    sha256_bytes,
)
from kvgraft.verifier import load_dataset
from tests.registry.conftest import Harness, Key, harness, subject

from .conftest import GSM8K, World, _evaluation, publish_world


@dataclass(frozen=True)
class Linked:
    world: World
    base_eval: str
    prereg: str
    replay: str


def _published(h: Harness, key: Key, statement: object) -> str:
    r = h.publish(key.sign(statement))
    assert r.status_code == 201, r.text
    return str(r.json()["entry"]["digest"])


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory, web_keys: dict[str, Key]) -> tuple[Path, Linked]:
    data = tmp_path_factory.mktemp("record-pages") / "data"
    alice = web_keys["alice"]
    with harness(data, web_keys) as h:
        world = publish_world(h, alice, web_keys["bob"])
        evaluation, outputs = _evaluation(world.root)
        p = evaluation.predicate
        # The base arm: the same problems, no library, settings with an unset value.
        base_outputs = outputs.replace(b'"18"', b'"17"')
        assert h.put_blob(base_outputs).status_code in (200, 201)
        base = EvaluationStatement(
            subject=[subject(OUTPUTS_FILE, base_outputs)],
            predicate=p.model_copy(update={
                "library_artifacts": [], "items": [i.model_copy(update={"library_entry": None}) for i in p.items],
                "outputs_digest": sha256_bytes(base_outputs), "settings": {"max_new_tokens": 64, "library": None},
            }),
        )
        base_eval = _published(h, alice, base)
        prereg_statement = PreRegistrationStatement(
            subject=[subject(EXPECTED_OUTPUTS_FILE, outputs)],
            predicate=PreRegistrationPredicate(
                model=p.model, profile=p.profile, dataset=p.dataset, command=["kvgraft", "eval"], settings={},
                expected_output_hashes={}, expected_outputs_digest=sha256_bytes(outputs),
            ),
        )
        prereg = _published(h, alice, prereg_statement)
        prereg_index = h.client.get(f"/v1/entries/{prereg}").json()["entry"]["log_index"]
        replay = _published(h, alice, ReplayStatement(
            subject=[subject(OUTPUTS_FILE, outputs)],
            predicate=ReplayPredicate(
                pre_registration=PreRegistrationRef(envelope_digest=prereg, log_index=prereg_index),
                output_hashes={}, outputs_digest=sha256_bytes(outputs), reproduced=True,
            ),
        ))
    return data, Linked(world, base_eval, prereg, replay)


@pytest.fixture(scope="module")
def pages(linked: tuple[Path, Linked], web_keys: dict[str, Key]) -> Iterator[tuple[Harness, Linked]]:
    with harness(linked[0], web_keys) as h:
        yield h, linked[1]


def _text(page: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_regression_evaluation_arm_and_library_come_first(pages: tuple[Harness, Linked]) -> None:
    h, linked = pages
    library = h.client.get(f"/records/{linked.world.evaluation_digest}").text
    lead = library[library.index('<p class="lead">'):library.index("</p>", library.index('<p class="lead">'))]
    assert 'id="arm">library arm</span> answers from 1 library artifact' in lead
    assert library.index('id="setup"') < library.index('id="aggregates"') < library.index('id="items"')
    assert f'href="/artifacts/{linked.world.root.digest}"' in library[library.index('id="setup"'):library.index('id="aggregates"')]
    base = h.client.get(f"/records/{linked.base_eval}").text
    assert 'id="arm">base arm</span> the model alone, no library' in base
    setup = _text(base[base.index('id="setup"'):base.index('id="aggregates"')])
    assert "Arm base : the model alone, nothing grafted" in setup
    assert "Settings max_new_tokens=64" in setup and "None" not in setup and "library=" not in setup


def test_regression_wrong_items_show_the_expected_answer(pages: tuple[Harness, Linked]) -> None:
    h, linked = pages
    page = h.client.get(f"/records/{linked.world.evaluation_digest}").text
    items = page[page.index('id="items"'):]
    rows = re.findall(r"<tr>\s*<td class=\"num\">(\d+)</td>(.*?)</tr>", items, flags=re.S)
    by_doc = {int(doc): row for doc, row in rows}
    expected = load_dataset(GSM8K).reference(2)
    # doc 2 was answered 7 and graded wrong: its expected answer is shown, marked.
    assert f'<strong class="bad"><code>{expected}</code></strong>' in by_doc[2] and ">wrong<" in by_doc[2]
    assert "<code>7</code>" in by_doc[2] and expected != "7"
    assert f"<code>{load_dataset(GSM8K).reference(0)}</code>" in by_doc[0] and ">correct<" in by_doc[0]


def test_regression_evaluation_prereg_and_replay_link_both_ways(pages: tuple[Harness, Linked]) -> None:
    h, linked = pages
    evaluation = linked.world.evaluation_digest
    expectations = {
        evaluation: {linked.prereg: "pre-registers a replay of this evaluation", linked.replay: "replays this evaluation"},
        linked.prereg: {evaluation: "the evaluation this pre-registers", linked.replay: "a replay answering this pre-registration"},
        linked.replay: {linked.prereg: "the pre-registration this replay answers",
                        evaluation: "the evaluation this replay reproduced"},
    }
    for shown, links in expectations.items():
        page = h.client.get(f"/records/{shown}").text
        assert 'id="related"' in page, shown
        related = page[page.index('id="related"'):page.index("</section>", page.index('id="related"'))]
        for target, relation in links.items():
            assert f'href="/records/{target}"' in related, (shown, target)
            assert relation in related, (shown, relation)
        # The base evaluation shares no file with them: it is not linked.
        assert linked.base_eval not in related
