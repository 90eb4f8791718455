"""Audit a report folder offline: every signature, digest, log proof, exactness record,
evaluation and replay in it, and every number its summary claims.

The audit does not stop at the first failure: each record is checked on its own and the
result is a list of lines, ``CONFIRMED <what> <value>``, ``UNCONFIRMED <what> <value>`` or
``REFUTED <what>: <why>``. The layout is in docs/records.md.

Trust comes from outside the folder. A folder's own ``trusted-keys.json`` and
``registry-key.pub.pem`` are whatever its author put there: whoever forged the records would put
their own keys beside them. So the auditor passes the publishers' keys (``trusted_keys``) and the
registry's key (``registry_key``) it got elsewhere; a check that rests only on a key from inside
the folder still runs, and passes as UNCONFIRMED, never CONFIRMED.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.schemas import (
    CHECKPOINT_FILE,
    LOG_PROOF_FILE,
    RECORD_FILE,
    REGISTRY_KEY_FILE,
    REPORT_DATASETS_DIR,
    REPORT_FOLDERS,
    STATEMENT_FILE,
    SUMMARY_FILE,
    TRUSTED_KEYS_FILE,
    ReplayStatement,
    SchemaError,
    Sha256Digest,
    Statement,
    parse_json,
    sha256_bytes,
)

from .dsse import parse_envelope, verify_statement_envelope
from .errors import ClaimMismatchError, LogProofError, MalformedInputError, UnknownKeyError, VerificationError
from .evaluation import MAX_ENVELOPE_BYTES, verify_evaluation_record
from .exactness import verify_exactness_record
from .files import read_input
from .grading import Dataset, load_dataset
from .keys import TrustedKeys, load_trusted_keys
from .replay import load_checkpoint, verify_log_proof, verify_pre_registration, verify_replay
from .subjects import verify_subjects
from .tlog import Checkpoint

#: The report's sub-folders, in the order they are audited (a pre-registration before its replay).
RECORD_KINDS = tuple(folder for folder, _ in REPORT_FOLDERS.values())

_MAX_SUMMARY_BYTES = 16 << 20


@dataclass(frozen=True)
class AuditLine:
    """One audited number or check: it held, with its value, or it was refuted, with the reason.

    ``vouched`` is False for a check that held but rests on a key taken from inside the folder
    (its ``trusted-keys.json`` or ``registry-key.pub.pem``): UNCONFIRMED, not CONFIRMED.
    """

    confirmed: bool
    what: str
    detail: str
    vouched: bool = True

    def render(self) -> str:
        """The line as printed: ``CONFIRMED <what> <value>``, ``UNCONFIRMED <what> <value>`` or
        ``REFUTED <what>: <why>``."""
        if not self.confirmed:
            return f"REFUTED {self.what}: {self.detail}"
        return f"{'CONFIRMED' if self.vouched else 'UNCONFIRMED'} {self.what} {self.detail}"


@dataclass(frozen=True)
class AuditReport:
    """Everything an audit confirmed and refuted, in the order it was checked."""

    directory: Path
    lines: tuple[AuditLine, ...]

    #: The keys from inside the folder that unconfirmed lines rest on (file names), if any.
    inside_keys: tuple[str, ...] = ()

    @property
    def confirmed(self) -> tuple[AuditLine, ...]:
        """The confirmed lines: held, and vouched for by keys from outside the folder."""
        return tuple(line for line in self.lines if line.confirmed and line.vouched)

    @property
    def unconfirmed(self) -> tuple[AuditLine, ...]:
        """The lines that held, but only by a key from inside the folder."""
        return tuple(line for line in self.lines if line.confirmed and not line.vouched)

    @property
    def refuted(self) -> tuple[AuditLine, ...]:
        """The refuted lines."""
        return tuple(line for line in self.lines if not line.confirmed)

    def require_all_confirmed(self) -> None:
        """Raise ``ClaimMismatchError`` if anything was refuted, ``UnknownKeyError`` if anything
        rests only on keys from inside the folder, ``MalformedInputError`` if nothing was checked."""
        if self.refuted:
            first = self.refuted[0]
            raise ClaimMismatchError(
                f"the audit of {self.directory} refuted {len(self.refuted)} of {len(self.lines)} checks, "
                f"first {first.what}: {first.detail}"
            )
        if self.unconfirmed:
            raise UnknownKeyError(
                f"the audit of {self.directory} left {len(self.unconfirmed)} of {len(self.lines)} checks unconfirmed: "
                f"they rest only on {' and '.join(self.inside_keys)} from inside the folder, which whoever wrote it chose",
                hint=outside_keys_hint(self.inside_keys),
            )
        if not self.confirmed:
            raise MalformedInputError(f"the audit of {self.directory} checked nothing", hint="pass a report folder (see docs/records.md)")


def outside_keys_hint(inside: tuple[str, ...]) -> str:
    """What to pass instead of the folder's own ``inside`` key files."""
    wanted = []
    if TRUSTED_KEYS_FILE in inside:
        wanted.append("--trusted-keys FILE (the publishers' keys, from them)")
    if REGISTRY_KEY_FILE in inside:
        wanted.append("--registry-key PEM (the registry's key, from its operator or your pinned copy)")
    return f"pass {' and '.join(wanted)}, got from outside the folder"


def _show(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _field(data: Any, path: str) -> Any:
    node = data
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ClaimMismatchError(f"the record has no field {path!r} (no {part!r})")
    return node


def _same(claimed: object, actual: object) -> bool:
    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if number(claimed) and number(actual):
        return claimed == actual
    return type(claimed) is type(actual) and claimed == actual


@dataclass
class _Auditor:
    root: Path
    #: The publishers' keys and the registry's key from outside the folder (None: the folder's own).
    outside_keys: TrustedKeys | None = None
    outside_registry_key: Path | None = None
    lines: list[AuditLine] = field(default_factory=list)
    trusted: TrustedKeys | None = None
    checkpoint: Checkpoint | None = None
    datasets: dict[Sha256Digest, Dataset] = field(default_factory=dict)
    #: relative record dir -> its verified predicate as JSON, for the summary's claims.
    predicates: dict[str, Any] = field(default_factory=dict)
    #: relative record dir -> whether its lines were vouched for (its claims are no better).
    vouched: dict[str, bool] = field(default_factory=dict)

    def vouches(self, *, keys: bool, log: bool) -> bool:
        # A check resting on the publishers' keys, the registry's key, or both is vouched for
        # only when each came from outside the folder.
        return (not keys or self.outside_keys is not None) and (not log or self.outside_registry_key is not None)

    def ok(self, what: str, value: object, *, keys: bool = True, log: bool = False) -> None:
        shown = value if isinstance(value, str) else _show(value)
        self.lines.append(AuditLine(True, what, shown, vouched=self.vouches(keys=keys, log=log)))

    def refute(self, what: str, why: str) -> None:
        self.lines.append(AuditLine(False, what, " ".join(why.split())))

    @contextlib.contextmanager
    def check(self, what: str) -> Iterator[None]:
        # One record's failure is one REFUTED line; the audit goes on with the others.
        try:
            yield
        except VerificationError as e:
            self.refute(what, f"{type(e).__name__}: {e.message}")
        except SchemaError as e:
            self.refute(what, f"MalformedInputError: {e}")

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def records(self, kind: str) -> list[Path]:
        base = self.root / kind
        return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []

    # -- shared inputs ------------------------------------------------------------------

    def inside_keys(self) -> tuple[str, ...]:
        """The key files from inside the folder that the audit used (unconfirmed lines rest on them)."""
        inside = [TRUSTED_KEYS_FILE] if self.outside_keys is None else []
        if self.outside_registry_key is None and self.checkpoint is not None:
            inside.append(REGISTRY_KEY_FILE)
        return tuple(inside)

    def load_inputs(self) -> None:
        if self.outside_keys is not None:
            self.trusted = self.outside_keys
            self.ok("trusted keys (given)", f"{len(self.trusted.keys)} key(s): {', '.join(k.name for k in self.trusted.keys)}")
        else:
            with self.check(TRUSTED_KEYS_FILE):
                self.trusted = load_trusted_keys(self.root / TRUSTED_KEYS_FILE)
                self.ok(
                    f"{TRUSTED_KEYS_FILE} (from inside the folder)",
                    f"{len(self.trusted.keys)} key(s): {', '.join(k.name for k in self.trusted.keys)}",
                )
        if (self.root / CHECKPOINT_FILE).exists():
            key_file = self.outside_registry_key or self.root / REGISTRY_KEY_FILE
            shown = "the given registry key" if self.outside_registry_key else f"{REGISTRY_KEY_FILE} (from inside the folder)"
            with self.check(CHECKPOINT_FILE):
                self.checkpoint = load_checkpoint(self.root / CHECKPOINT_FILE, key_file)
                self.ok(f"{CHECKPOINT_FILE} signed by {shown}, size", self.checkpoint.size, keys=False, log=True)
        for path in sorted((self.root / REPORT_DATASETS_DIR).glob("*.jsonl")):
            with self.check(self.rel(path)):
                ds = load_dataset(path)
                self.datasets[ds.digest] = ds
                self.ok(f"{self.rel(path)} digest", ds.digest, keys=False)

    def log_inclusion(self, record_dir: Path, envelope: Path, *, required: bool = False) -> int | None:
        proof = record_dir / LOG_PROOF_FILE
        if not proof.exists() and not required:
            return None
        what = f"{self.rel(record_dir)} log inclusion"
        with self.check(what):
            if self.checkpoint is None:
                raise LogProofError(
                    f"{self.rel(record_dir)} has a log proof but the report has no verified {CHECKPOINT_FILE}",
                    hint=f"put the registry's signed {CHECKPOINT_FILE} and {REGISTRY_KEY_FILE} in the report",
                )
            data = read_input(envelope, "envelope", limit=MAX_ENVELOPE_BYTES)
            index = verify_log_proof(data, proof, self.checkpoint, what=self.rel(envelope))
            self.ok(f"{what}, index", index, keys=False, log=True)
            return index
        return None

    def signed(self, envelope: Path) -> tuple[Statement, tuple[str, ...]]:
        if self.trusted is None:
            raise MalformedInputError(f"no usable {TRUSTED_KEYS_FILE}, so no signature can be checked")
        data = read_input(envelope, "envelope", limit=MAX_ENVELOPE_BYTES)
        verified, statement = verify_statement_envelope(parse_envelope(data, source=f"envelope {envelope}"), self.trusted)
        return statement, tuple(k.name for k in verified.signers)

    def keys(self) -> TrustedKeys:
        if self.trusted is None:
            raise MalformedInputError(f"no usable {TRUSTED_KEYS_FILE}, so no signature can be checked")
        return self.trusted

    # -- records ------------------------------------------------------------------------

    def artifact(self, d: Path) -> None:
        name = self.rel(d)
        with self.check(name):
            statement, signers = self.signed(d / STATEMENT_FILE)
            verify_subjects(statement, d, exclude=[d / STATEMENT_FILE, d / LOG_PROOF_FILE])
            self.ok(f"{name} signed by", ", ".join(signers))
            for s in statement.subject:
                self.ok(f"{name} subject {s.name}", f"sha256:{s.digest.sha256}")
            self.predicates[name] = statement.model_dump(mode="json", by_alias=True)["predicate"]
        self.log_inclusion(d, d / STATEMENT_FILE)

    def exactness(self, d: Path) -> None:
        name = self.rel(d)
        with self.check(name):
            # The record's subjects are its logits files; log.json sits beside them and is
            # not one, so the record is checked in a copy without it.
            with tempfile.TemporaryDirectory(prefix="kvgraft-audit-") as tmp:
                copy = Path(tmp) / d.name
                shutil.copytree(d, copy, ignore=lambda _dir, names: [n for n in names if n == LOG_PROOF_FILE and _dir == str(d)])
                try:
                    statement, signers = verify_exactness_record(copy, self.keys())
                except VerificationError as e:
                    raise type(e)(e.message.replace(str(copy), str(d)), hint=e.hint) from e
            s = statement.predicate.summary
            self.ok(f"{name} signed by", ", ".join(signers))
            self.ok(f"{name} level", statement.predicate.level)
            for key in ("samples", "bitwise_equal", "argmax_agree_all", "max_kl_divergence", "mean_argmax_agreement"):
                self.ok(f"{name} {key}", getattr(s, key))
            self.predicates[name] = statement.model_dump(mode="json", by_alias=True)["predicate"]
        self.log_inclusion(d, d / RECORD_FILE)

    def evaluation(self, d: Path) -> None:
        name = self.rel(d)
        with self.check(name):
            verified = verify_evaluation_record(d, self.datasets, self.keys())
            p = verified.statement.predicate
            self.ok(f"{name} signed by", ", ".join(verified.signers))
            self.ok(f"{name} dataset", f"{p.dataset.name} {p.dataset.digest}")
            for key in ("items", "correct", "accuracy", "prompt_tokens", "decode_tokens"):
                self.ok(f"{name} {key}", getattr(p.aggregates, key))
            self.predicates[name] = verified.statement.model_dump(mode="json", by_alias=True)["predicate"]
        self.log_inclusion(d, d / RECORD_FILE)

    def pre_registration(self, d: Path) -> None:
        name = self.rel(d)
        with self.check(name):
            verified = verify_pre_registration(d, self.keys())
            self.ok(f"{name} signed by", ", ".join(verified.signers))
            self.ok(f"{name} expected outputs", len(verified.statement.predicate.expected_output_hashes))
            self.predicates[name] = verified.statement.model_dump(mode="json", by_alias=True)["predicate"]
        self.log_inclusion(d, d / RECORD_FILE, required=True)

    def replay(self, d: Path, preregs: dict[Sha256Digest, Path]) -> None:
        name = self.rel(d)
        with self.check(name):
            statement, _ = self.signed(d / RECORD_FILE)
            if not isinstance(statement, ReplayStatement):
                raise MalformedInputError(f"{self.rel(d / RECORD_FILE)} is a {statement.predicate_type} statement, not a replay record")
            digest = statement.predicate.pre_registration.envelope_digest
            prereg = preregs.get(digest)
            if prereg is None:
                raise ClaimMismatchError(
                    f"the replay answers to pre-registration {digest}, which is not among the report's pre-registrations",
                    hint="put the pre-registration this replay names in pre-registrations/",
                )
            if self.checkpoint is None:
                raise LogProofError(f"a replay needs the log's order, but the report has no verified {CHECKPOINT_FILE}")
            verified = verify_replay(d, prereg, self.keys(), self.checkpoint)
            self.ok(f"{name} signed by", ", ".join(verified.signers), log=True)
            self.ok(f"{name} answers", self.rel(prereg), log=True)
            self.ok(f"{name} log inclusion, index", verified.log_index, log=True)
            self.ok(f"{name} log order", f"pre-registration at {verified.pre_registration_log_index} < replay at {verified.log_index}", log=True)
            self.ok(f"{name} outputs", verified.outputs, log=True)
            self.ok(f"{name} reproduced", verified.reproduced, log=True)
            self.predicates[name] = verified.statement.model_dump(mode="json", by_alias=True)["predicate"]
            self.vouched[name] = self.vouches(keys=True, log=True)

    def summary(self) -> None:
        path = self.root / SUMMARY_FILE
        if not path.exists():
            return
        claims: object = None
        with self.check(SUMMARY_FILE):
            doc = parse_json(read_input(path, "summary", limit=_MAX_SUMMARY_BYTES), what=SUMMARY_FILE)
            claims = doc.get("claims") if isinstance(doc, dict) else None
            if not isinstance(claims, list):
                raise MalformedInputError(f'{SUMMARY_FILE} is not {{"claims": [...]}}')
        if not isinstance(claims, list):
            return
        for n, claim in enumerate(claims):
            if not isinstance(claim, dict) or not {"what", "value", "source", "field"} <= set(claim):
                self.refute(f"{SUMMARY_FILE} claim {n}", "MalformedInputError: a claim needs what, value, source and field")
                continue
            what = str(claim["what"])
            source, path_ = str(claim["source"]).strip("/"), str(claim["field"])
            if source not in self.predicates:
                self.refute(what, f"its source {source} is not a record that verified in this report")
                continue
            with self.check(what):
                actual = _field(self.predicates[source], path_)
                if not _same(claim["value"], actual):
                    raise ClaimMismatchError(
                        f"the summary claims {_show(claim['value'])}, but {source} {path_} is {_show(actual)}"
                    )
                # A claim is as good as the record it reads.
                self.lines.append(AuditLine(True, what, _show(claim["value"]), vouched=self.vouched.get(source, self.vouches(keys=True, log=False))))


def audit_report(
    directory: Path, *, trusted_keys: TrustedKeys | None = None, registry_key: Path | None = None
) -> AuditReport:
    """Audit the report folder at ``directory``; return every line confirmed, unconfirmed or refuted.

    ``trusted_keys`` (the publishers' keys) and ``registry_key`` (the registry's Ed25519 public
    key, PEM) are what the auditor got from outside the folder; without them the folder's own
    ``trusted-keys.json`` and ``registry-key.pub.pem`` are used, and every check resting on them
    is UNCONFIRMED (``AuditReport.unconfirmed``). A record signed only by a key that is not in
    ``trusted_keys`` is REFUTED. Raises ``MalformedInputError`` only when ``directory`` is not a
    folder; every other failure is a refuted line.
    """
    if not directory.is_dir():
        raise MalformedInputError(f"report folder {directory} does not exist or is not a directory")
    a = _Auditor(directory, outside_keys=trusted_keys, outside_registry_key=registry_key)
    a.load_inputs()
    found = {kind: a.records(kind) for kind in RECORD_KINDS}
    if not any(found.values()):
        a.refute(directory.name or str(directory), f"no records to audit (none of {', '.join(RECORD_KINDS)} holds a record)")
    for d in found["artifacts"]:
        a.artifact(d)
    for d in found["exactness"]:
        a.exactness(d)
    for d in found["evaluations"]:
        a.evaluation(d)
    preregs: dict[Sha256Digest, Path] = {}
    for d in found["pre-registrations"]:
        a.pre_registration(d)
        if (d / RECORD_FILE).is_file():
            preregs[sha256_bytes((d / RECORD_FILE).read_bytes())] = d
    for d in found["replays"]:
        a.replay(d, preregs)
    a.summary()
    return AuditReport(directory, tuple(a.lines), a.inside_keys())
