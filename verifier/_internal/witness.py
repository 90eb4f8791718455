"""Witness cosignatures (c2sp.org/tlog-cosignature) and witness policies (c2sp.org/tlog-policy).

A witness keeps the last checkpoint it verified per log and cosigns a newer one only when a
consistency proof shows it extends that one; a checkpoint cosigned by enough independent
witnesses cannot be one branch of a split view unless those witnesses collude.

**Cosignature lines.** A cosignature is a c2sp.org/signed-note signature line added to the
checkpoint's note, by the witness's key name::

    — witness.example/w1 base64(key ID || timestamp || Ed25519 signature)

- key ID: ``SHA-256(name || 0x0A || 0x04 || 32-byte Ed25519 public key)[:4]`` (signature type
  0x04, "timestamped Ed25519 checkpoint cosignature"), so a witness key never collides with the
  log's own type-0x01 key, even under the same name;
- timestamp: 8 bytes, big-endian, POSIX seconds when the witness cosigned (never 0, at most 2^63-1);
- signature: 64 bytes of Ed25519 over the message ::

      cosignature/v1
      time <timestamp in decimal>
      <the checkpoint's note text, every line, with its final newline>

  (``cosignature_message``). A v1 cosignature says: as of that time, this is the largest
  consistent tree head the witness has seen for the origin.

Witness verifier keys (vkeys) are ``<name>+<hex key ID>+base64(0x04 || public key)``.

**Verification keeps signed-note's rules** (and Go's ``sumdb/note`` ``Open``): lines from keys the
verifier does not know (other names, other key IDs, other types) are ignored; a line whose name
and key ID match a known witness key must verify, or the whole note is refused
(``CosignatureError``). A cosignature that verifies but is dated more than ``max_skew`` seconds in
the future, or dated 0, is not counted (the witness's clock, or a witness omitting the timestamp),
and the quorum error says so.

**Witness policies** are c2sp.org/tlog-policy files, as transparency-dev's Tessera reads them
(``NewWitnessGroupFromPolicy``: the URL on witness lines required there, so kvgraft writes one)::

    # comments (to the end of a line) and blank lines are ignored; items are separated by spaces or tabs
    log <log vkey> [<url>]                  optional: the checkpoint's log key must be one of these
    witness <name> <witness vkey> [<url>]   a witness, named for the lines below; <url>: its base URL
    group <name> <k|any|all> <member>...    witnessed when k of its members are (witnesses or groups)
    quorum <name|none>                      exactly one: what a checkpoint needs

A witness vkey is type 0x04 or 0x01 (the same Ed25519 key; ``parse_witness_vkey``). No name may
be a keyword (``witness``, ``group``, ``quorum``, ``log``, ``any``, ``all``, ``none``).

A group or the quorum names only witnesses and groups defined on earlier lines (so no cycle); a
name is a member of at most one group, once (so groups are disjoint trees and each witness counts
towards the quorum in one way only); names are shared by witnesses and groups; one key is one
witness (a key under two names would count twice). Where Tessera is laxer (a key or a member
listed twice, a threshold of 0, a second quorum line, a URL of any scheme) kvgraft refuses. "K of N" is
``group g K w1 ... wN`` then ``quorum g``. Limits (a stranger may hand you a policy): 64 KiB,
64 logs, 64 witnesses, 64 groups, 64 members per group, lines of 4096 characters. The file must be
UTF-8 (the spec treats non-ASCII octets as opaque; kvgraft's names are signed-note key names,
which are UTF-8).

Pure Python over ``cryptography``: no registry, no HTTP.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import CosignatureError, LogProofError, MalformedInputError, WitnessPolicyError, WitnessQuorumError
from .files import read_input
from .keys import SigningKey, raw_public_key, require_ed25519
from .tlog import (
    Checkpoint,
    NoteSignature,
    check_key_name,
    note_key_id,
    parse_checkpoint,
    parse_signed_note,
    parse_vkey,
    strict_b64decode,
    verify_checkpoint,
)

#: The c2sp.org/signed-note signature type byte of timestamped Ed25519 checkpoint cosignatures.
COSIGNATURE_TYPE = 0x04
#: The signed-note type byte of an Ed25519 note signer key, which a witness vkey may also be given as.
_NOTE_ED25519_TYPE = 0x01
#: The first line of every cosignature/v1 signed message (domain separation).
COSIGNATURE_HEADER = b"cosignature/v1\n"
#: Bytes of a cosignature after its key ID: the 8-byte timestamp and the 64-byte Ed25519 signature.
COSIGNATURE_BYTES = 8 + 64
#: The latest timestamp a cosignature may carry (the spec's bound: it is a signed 64-bit number).
MAX_TIMESTAMP = (1 << 63) - 1
#: How far in the future (seconds) a cosignature's timestamp may be and still count: clocks drift.
DEFAULT_MAX_SKEW = 300

#: Limits of a policy file (c2sp.org/tlog-policy asks implementations to support at least 32 of each).
MAX_POLICY_BYTES = 64 * 1024
MAX_POLICY_LINE = 4096
MAX_POLICY_LOGS = 64
MAX_POLICY_WITNESSES = 64
MAX_POLICY_GROUPS = 64
MAX_GROUP_MEMBERS = 64

_KEY_ID_HEX = re.compile(r"[0-9a-f]{8}", re.ASCII)
_THRESHOLD = re.compile(r"[1-9][0-9]{0,3}", re.ASCII)
_SEPARATORS = re.compile(r"[ \t]+")
#: A witness line's URL: the witness's base URL (its add-checkpoint is ``<URL>/add-checkpoint``).
_URL = re.compile(r"https?://[^\s#]+", re.ASCII)
#: The words no witness or group may be named (transparency-dev's parser refuses them too).
_KEYWORDS = frozenset({"witness", "group", "quorum", "log", "any", "all", "none"})
#: How parse_witness_policy words an error of line N: (N, what is wrong, how to fix it).
_Fail = Callable[[int, str, str], WitnessPolicyError]


# --- witness keys ------------------------------------------------------------------------------


def witness_key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    """The 4-byte cosignature key ID: ``SHA-256(name || "\\n" || 0x04 || 32-byte public key)[:4]``."""
    check_key_name(name, what="witness name")
    material = bytes([COSIGNATURE_TYPE]) + raw_public_key(public_key)
    return hashlib.sha256(name.encode("utf-8") + b"\n" + material).digest()[:4]


@dataclass(frozen=True)
class WitnessKey:
    """A witness's key name and Ed25519 public key (its cosignature verifier key)."""

    name: str
    public_key: Ed25519PublicKey

    def __post_init__(self) -> None:
        check_key_name(self.name, what="witness name")

    @property
    def key_id(self) -> bytes:
        """The 4-byte key ID its cosignature lines carry."""
        return witness_key_id(self.name, self.public_key)

    @property
    def vkey(self) -> str:
        """``<name>+<hex key ID>+base64(0x04 || public key)``."""
        material = bytes([COSIGNATURE_TYPE]) + raw_public_key(self.public_key)
        return f"{self.name}+{self.key_id.hex()}+{base64.b64encode(material).decode('ascii')}"

    def policy_line(self, url: str) -> str:
        """``witness <name> <vkey> <url>``: this witness's line of a witness policy, in the form
        transparency-dev's parser requires (the URL given: its base URL, under which
        ``add-checkpoint`` is), named by its key name. Checked by ``parse_witness_policy``, the
        one rule (``WitnessPolicyError`` for a URL it refuses)."""
        line = f"witness {self.name} {self.vkey} {url}"
        parse_witness_policy(f"{line}\nquorum {self.name}\n".encode(), source=f"the policy line of witness {self.name}")
        return line

    def same_key(self, other: WitnessKey) -> bool:
        """True when both wrap the same public key (whatever their names)."""
        return raw_public_key(self.public_key) == raw_public_key(other.public_key)


def format_witness_vkey(name: str, public_key: Ed25519PublicKey) -> str:
    """The witness verifier key ``<name>+<hex key ID>+base64(0x04 || public key)``."""
    return WitnessKey(name, public_key).vkey


def parse_witness_vkey(vkey: str, *, note_key_ok: bool = False) -> WitnessKey:
    """Parse a witness verifier key: Ed25519, signature type 0x04 (its cosignature key), or, with
    ``note_key_ok``, type 0x01 (the same Ed25519 key as a note signer, as witnesses publish it:
    transparency-dev's ``NewVerifierForCosignatureV1`` takes both, and policies in its format
    name witnesses by either). Either way cosignatures are checked as type 0x04
    (``WitnessKey.key_id``); the key ID in the vkey must match the type it states.

    Raises ``MalformedInputError`` naming the fault: not three ``+``-separated parts, a bad name,
    a key ID that is not 8 lowercase hex digits or does not match, another signature type (without
    ``note_key_ok``, a type-0x01 key: where a log's key is at hand, it is the likelier mistake).
    """
    if not isinstance(vkey, str):
        raise MalformedInputError(f"a witness verifier key must be a string, got {type(vkey).__name__}")
    # The base64 part may itself contain '+', so split at most twice.
    parts = vkey.strip().split("+", 2)
    if len(parts) != 3:
        raise MalformedInputError(
            f"witness key {vkey[:60]!r} is not <name>+<8 hex digits>+<base64 key>",
            hint="pass the witness vkey 'kvgraft witness key' prints",
        )
    name, key_id, encoded = parts
    check_key_name(name, what="witness name")
    if not _KEY_ID_HEX.fullmatch(key_id):
        raise MalformedInputError(f"witness key {name!r}: key ID {key_id!r} is not 8 lowercase hex digits")
    material = strict_b64decode(encoded, f"witness key {name!r}")
    if len(material) == 33 and material[0] == _NOTE_ED25519_TYPE and not note_key_ok:
        raise MalformedInputError(
            f"witness key {name!r} is a note signing key (type 0x01, a log's key), not a cosignature key (type 0x04)",
            hint="pass the witness's cosignature vkey, which 'kvgraft witness key' prints",
        )
    if len(material) != 33 or material[0] not in (COSIGNATURE_TYPE, _NOTE_ED25519_TYPE):
        raise MalformedInputError(
            f"witness key {name!r} is not an Ed25519 witness key (type 0x04, or 0x01, and 32 bytes)",
            hint="only Ed25519 cosignatures (c2sp.org/tlog-cosignature, type 0x04) are supported",
        )
    key = WitnessKey(name, Ed25519PublicKey.from_public_bytes(material[1:]))
    stated = key.key_id if material[0] == COSIGNATURE_TYPE else note_key_id(name, key.public_key)
    if stated.hex() != key_id:
        raise MalformedInputError(f"witness key {name!r}: key ID {key_id} does not match its name and key")
    return key


# --- cosigning ---------------------------------------------------------------------------------


def cosignature_message(checkpoint_text: bytes, timestamp: int) -> bytes:
    """The bytes a cosignature/v1 signs: ``cosignature/v1\\ntime <timestamp>\\n`` + the note text."""
    return COSIGNATURE_HEADER + b"time %d\n" % timestamp + checkpoint_text


def cosign(checkpoint_text: bytes, name: str, signing_key: SigningKey, *, timestamp: int | None = None) -> bytes:
    """The cosignature line (``— <name> <base64>\\n``) of ``checkpoint_text`` by the witness key.

    ``checkpoint_text`` is the checkpoint's note text (every line, final newline, no signatures);
    it must parse as a checkpoint. ``timestamp`` defaults to now (POSIX seconds); it must be
    between 1 and 2^63-1. The key must be Ed25519 (``KeyFileError`` otherwise).
    """
    parse_checkpoint(checkpoint_text)
    public_key = require_ed25519(signing_key.public_key, "the witness key")
    ts = int(time.time()) if timestamp is None else timestamp
    if isinstance(ts, bool) or not isinstance(ts, int) or not 1 <= ts <= MAX_TIMESTAMP:
        raise ValueError(f"a cosignature timestamp must be an int from 1 to 2^63-1, got {ts!r}")
    signature = signing_key.sign(cosignature_message(checkpoint_text, ts))
    return NoteSignature(name, witness_key_id(name, public_key), struct.pack(">Q", ts) + signature).line()


@dataclass(frozen=True)
class Cosignature:
    """A cosignature that verified: by whom, when, and its line exactly as it can be re-served."""

    witness: WitnessKey
    timestamp: int
    line: bytes


@dataclass(frozen=True)
class Cosignatures:
    """What ``open_cosignatures`` found: the valid ones, and the known witnesses' lines not counted."""

    valid: tuple[Cosignature, ...]
    #: (witness key, why its verified cosignature does not count): a future or zero timestamp.
    skipped: tuple[tuple[WitnessKey, str], ...] = ()

    def by(self, key: WitnessKey) -> Cosignature | None:
        """The newest valid cosignature by ``key`` (its name and key ID), or None."""
        mine = [c for c in self.valid if (c.witness.name, c.witness.key_id) == (key.name, key.key_id)]
        return max(mine, key=lambda c: c.timestamp) if mine else None


def open_cosignatures(
    note: bytes, witnesses: Iterable[WitnessKey], *, now: float | None = None, max_skew: float = DEFAULT_MAX_SKEW
) -> Cosignatures:
    """Verify the cosignatures of ``note`` by ``witnesses``; ignore every other signature line.

    A line whose name and key ID are a known witness's must verify over cosignature/v1 of the
    note's text, or ``CosignatureError`` (the note was altered: signed-note says reject it). A
    verified one dated 0 or more than ``max_skew`` seconds after ``now`` (default: the clock) is
    skipped, with the reason. Raises ``MalformedInputError`` when the note itself is malformed.
    """
    parsed = parse_signed_note(note)
    known = {(w.name, w.key_id): w for w in witnesses}
    latest = (time.time() if now is None else now) + max_skew
    valid: list[Cosignature] = []
    skipped: list[tuple[WitnessKey, str]] = []
    for sig in parsed.signatures:
        witness = known.get((sig.name, sig.key_id))
        if witness is None:
            continue
        where = f"the cosignature by witness {sig.name}+{sig.key_id.hex()}"
        if len(sig.signature) != COSIGNATURE_BYTES:
            raise CosignatureError(
                f"{where} is {len(sig.signature)} bytes after its key ID, not {COSIGNATURE_BYTES} "
                "(an 8-byte timestamp and a 64-byte Ed25519 signature)"
            )
        (timestamp,) = struct.unpack(">Q", sig.signature[:8])
        try:
            witness.public_key.verify(sig.signature[8:], cosignature_message(parsed.text, timestamp))
        except InvalidSignature as e:
            raise CosignatureError(
                f"{where} (time {timestamp}) does not verify over the checkpoint: the note was altered after it was cosigned"
            ) from e
        if timestamp == 0 or timestamp > MAX_TIMESTAMP:
            skipped.append((witness, f"its timestamp {timestamp} is not a time (0 or past 2^63-1)"))
        elif timestamp > latest:
            ahead = timestamp - (latest - max_skew)
            skipped.append((witness, f"it is dated {ahead:.0f} s in the future (more than the {max_skew:g} s allowed)"))
        else:
            valid.append(Cosignature(witness, timestamp, sig.line()))
    return Cosignatures(tuple(valid), tuple(skipped))


# --- policies (c2sp.org/tlog-policy) -----------------------------------------------------------


@dataclass(frozen=True)
class PolicyGroup:
    """A group of a policy: witnessed when ``threshold`` of its ``members`` are."""

    name: str
    threshold: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class WitnessPolicy:
    """Which logs and witnesses a client trusts, and which cosignatures a checkpoint needs.

    ``quorum`` is a witness name, a group name, or ``none`` (no cosignature needed). Built by
    ``parse_witness_policy``, which checks every rule of the format; ``satisfied`` and
    ``min_cosignatures`` evaluate it.
    """

    witnesses: Mapping[str, WitnessKey]
    groups: Mapping[str, PolicyGroup]
    quorum: str
    #: (origin, public key) of the accepted logs; empty: the log is known from elsewhere.
    logs: tuple[tuple[str, Ed25519PublicKey], ...] = ()
    source: str = field(default="the witness policy", compare=False)

    def satisfied(self, cosigned: set[str]) -> bool:
        """True when the witnesses named in ``cosigned`` (policy names) meet the quorum."""
        return self._witnessed(self.quorum, cosigned)

    def _witnessed(self, name: str, cosigned: set[str]) -> bool:
        if name == "none":
            return True
        group = self.groups.get(name)
        if group is None:
            return name in cosigned
        return sum(self._witnessed(m, cosigned) for m in group.members) >= group.threshold

    def min_cosignatures(self) -> int:
        """The fewest distinct witnesses whose cosignatures can meet the quorum (0 for ``none``)."""
        return self._minimum(self.quorum)

    def _minimum(self, name: str) -> int:
        if name == "none":
            return 0
        group = self.groups.get(name)
        if group is None:
            return 1
        # Members are disjoint subtrees (each name is a member of one group, once: the parser
        # enforces it), so the cheapest way to reach the threshold takes the cheapest members.
        return sum(sorted(self._minimum(m) for m in group.members)[: group.threshold])

    def describe(self, name: str | None = None) -> str:
        """The quorum (or the rule named ``name``) in words: ``honest = 1 of (w1, w2)``."""
        name = self.quorum if name is None else name
        if name == "none":
            return "none (no cosignature needed)"
        group = self.groups.get(name)
        if group is None:
            return f"witness {name}"
        k = "all" if group.threshold == len(group.members) and len(group.members) > 1 else str(group.threshold)
        inner = ", ".join(m if m not in self.groups else f"[{self.describe(m)}]" for m in group.members)
        return f"group {name} = {k} of ({inner})"

    def keys(self) -> list[WitnessKey]:
        """The witness keys, in policy order."""
        return list(self.witnesses.values())


def _policy_error(source: str, lineno: int, problem: str, fix: str) -> WitnessPolicyError:
    return WitnessPolicyError(f"{source} line {lineno}: {problem}", hint=fix)


def parse_witness_policy(data: bytes, *, source: str = "the witness policy") -> WitnessPolicy:
    """Parse a c2sp.org/tlog-policy file (see the module docstring); ``source`` names it in errors.

    Raises ``WitnessPolicyError`` naming the line, what is wrong and how to fix it: an unknown
    keyword, a bad vkey, a duplicate name or key, a name used before it is defined, a threshold
    out of range, no quorum line or two, a file or line past the limits.
    """
    if not isinstance(data, bytes):
        raise WitnessPolicyError(f"{source} must be bytes, got {type(data).__name__}")
    if len(data) > MAX_POLICY_BYTES:
        raise WitnessPolicyError(f"{source} is {len(data)} bytes, more than the {MAX_POLICY_BYTES} a policy can be")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WitnessPolicyError(f"{source} is not UTF-8 (byte {e.start})", hint="save the policy as UTF-8 text") from e
    witnesses: dict[str, WitnessKey] = {}
    groups: dict[str, PolicyGroup] = {}
    member_of: dict[str, str] = {}  # each name is a member of one group at most (tlog-policy)
    logs: list[tuple[str, Ed25519PublicKey]] = []
    urls: dict[str, str] = {}  # a witness base URL -> the key name first listed at it
    quorum: tuple[int, str] | None = None

    def fail(lineno: int, problem: str, fix: str) -> WitnessPolicyError:
        return _policy_error(source, lineno, problem, fix)

    for lineno, raw in enumerate(text.split("\n"), start=1):
        if len(raw) > MAX_POLICY_LINE:
            raise fail(lineno, f"the line is {len(raw)} characters long", f"keep lines under {MAX_POLICY_LINE} characters")
        bad = next((ch for ch in raw if (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F), None)
        if bad is not None:
            raise fail(lineno, f"the control character U+{ord(bad):04X}", "use only spaces and tabs between items, \\n line ends")
        # A comment runs from '#' to the end of the line, on a line of its own or after the items
        # (transparency-dev's parser strips it so; no vkey, name or http(s) base URL holds '#').
        line = raw.partition("#")[0].strip(" \t")
        if not line:
            continue
        keyword, *items = _SEPARATORS.split(line)
        if keyword == "log":
            if len(items) not in (1, 2):
                raise fail(lineno, f"'log' takes a vkey and an optional URL, got {len(items)} item(s)", "write: log <vkey> [<url>]")
            try:
                origin, log_key = parse_vkey(items[0])
            except MalformedInputError as e:
                raise fail(lineno, e.message, "use the log's note vkey, e.g. the vkey of GET /v1/log/key") from e
            if any(raw_public_key(log_key) == raw_public_key(k) for _, k in logs):
                raise fail(lineno, f"log {origin!r} repeats a log key listed above", "list each log once")
            if any(raw_public_key(log_key) == raw_public_key(w.public_key) for w in witnesses.values()):
                raise fail(lineno, f"log {origin!r} has the key of a witness listed above", "a log does not witness itself: "
                           "list the log's own vkey")
            if len(logs) == MAX_POLICY_LOGS:
                raise fail(lineno, f"more than {MAX_POLICY_LOGS} logs", f"list at most {MAX_POLICY_LOGS} logs")
            logs.append((origin, log_key))
        elif keyword == "witness":
            if len(items) not in (2, 3):
                raise fail(
                    lineno, f"'witness' takes a name, a vkey and an optional URL, got {len(items)} item(s)",
                    "write: witness <name> <vkey> [<url>]",
                )
            name = items[0]
            _check_new_name(name, lineno, witnesses, groups, fail)
            if len(items) == 3 and not _URL.fullmatch(items[2]):
                raise fail(lineno, f"witness {name!r} URL {items[2][:80]!r} is not an http:// or https:// URL",
                           "write the witness's base URL, the one its add-checkpoint is below (http[s]://host[:port][/path])")
            try:
                key = parse_witness_vkey(items[1], note_key_ok=True)
            except MalformedInputError as e:
                raise fail(lineno, e.message, "use the witness's vkey, as 'kvgraft witness key' prints it") from e
            if len(items) == 3:
                # One base URL is one witness (transparency-dev refuses two key names at one URL too).
                other = urls.setdefault(items[2], key.name)
                if other != key.name:
                    raise fail(lineno, f"witness {name!r} has the URL of witness key {other!r}, another key name",
                               "give each witness its own URL")
            if any(raw_public_key(key.public_key) == raw_public_key(k) for _, k in logs):
                raise fail(lineno, f"witness {name!r} has the key of a log listed above", "a log does not witness itself: "
                           "use the witness's own vkey")
            twin = next((n for n, w in witnesses.items() if w.same_key(key)), None)
            if twin is not None:
                raise fail(lineno, f"witness {name!r} has the same key as witness {twin!r}", "list each witness key once")
            if len(witnesses) == MAX_POLICY_WITNESSES:
                raise fail(lineno, f"more than {MAX_POLICY_WITNESSES} witnesses", f"list at most {MAX_POLICY_WITNESSES}")
            witnesses[name] = key
        elif keyword == "group":
            if len(items) < 3:
                raise fail(
                    lineno, "'group' needs a name, a threshold and at least one member",
                    "write: group <name> <k|any|all> <member>...",
                )
            name, k, members = items[0], items[1], items[2:]
            _check_new_name(name, lineno, witnesses, groups, fail)
            if len(members) > MAX_GROUP_MEMBERS:
                raise fail(lineno, f"group {name!r} has {len(members)} members", f"a group has at most {MAX_GROUP_MEMBERS}")
            for i, member in enumerate(members):
                if member == "none":
                    raise fail(lineno, "'none' cannot be a group member", "name witnesses and groups defined above")
                if member not in witnesses and member not in groups:
                    raise fail(
                        lineno, f"group {name!r} names {member!r}, which no earlier line defines",
                        "define each witness or group on a line above the group that uses it",
                    )
                if member in members[:i]:
                    raise fail(lineno, f"group {name!r} lists {member!r} twice", "list each member once")
                if member in member_of:
                    # tlog-policy: "each defined name can be listed as a group member at most once",
                    # so a witness counts towards the quorum in one way only.
                    raise fail(
                        lineno, f"{member!r} is already a member of group {member_of[member]!r}",
                        "list each witness or group in one group only; nest groups to reuse one",
                    )
            if k == "any":
                threshold = 1
            elif k == "all":
                threshold = len(members)
            elif _THRESHOLD.fullmatch(k) and int(k) <= len(members):
                threshold = int(k)
            else:
                raise fail(
                    lineno, f"group {name!r} threshold {k!r} is not 'any', 'all' or a number from 1 to {len(members)}",
                    "write the threshold as any, all, or k with 1 <= k <= the number of members",
                )
            if len(groups) == MAX_POLICY_GROUPS:
                raise fail(lineno, f"more than {MAX_POLICY_GROUPS} groups", f"define at most {MAX_POLICY_GROUPS}")
            groups[name] = PolicyGroup(name, threshold, tuple(members))
            member_of.update(dict.fromkeys(members, name))
        elif keyword == "quorum":
            if len(items) != 1:
                raise fail(lineno, f"'quorum' takes one name, got {len(items)}", "write: quorum <witness or group name | none>")
            if quorum is not None:
                raise fail(lineno, f"a second quorum line (the first is line {quorum[0]})", "keep exactly one quorum line")
            name = items[0]
            if name != "none" and name not in witnesses and name not in groups:
                raise fail(
                    lineno, f"the quorum names {name!r}, which no earlier line defines",
                    "define the witness or group above the quorum line, or write: quorum none",
                )
            quorum = (lineno, name)
        else:
            raise fail(
                lineno, f"unknown keyword {keyword[:40]!r}",
                "each line starts with log, witness, group or quorum (or # for a comment)",
            )
    if quorum is None:
        raise WitnessPolicyError(
            f"{source} has no quorum line", hint="end the policy with: quorum <witness or group name> (or: quorum none)"
        )
    return WitnessPolicy(witnesses=witnesses, groups=groups, quorum=quorum[1], logs=tuple(logs), source=source)


def _check_new_name(
    name: str, lineno: int, witnesses: Mapping[str, WitnessKey], groups: Mapping[str, PolicyGroup], fail: _Fail
) -> None:
    if name in _KEYWORDS:
        raise fail(lineno, f"{name!r} is a keyword of the policy format", "name the witness or group something else")
    if name in witnesses or name in groups:
        raise fail(lineno, f"the name {name!r} is already defined above", "give every witness and group its own name")


def load_witness_policy(path: Path) -> WitnessPolicy:
    """Read and parse the policy file ``path`` (at most ``MAX_POLICY_BYTES``); ``WitnessPolicyError`` otherwise."""
    data = read_input(path, "witness policy", limit=MAX_POLICY_BYTES, error=WitnessPolicyError)
    return parse_witness_policy(data, source=f"witness policy {path}")


# --- witnessed checkpoints ---------------------------------------------------------------------


@dataclass(frozen=True)
class WitnessedCheckpoint:
    """A checkpoint signed by its log and cosigned by witnesses meeting a policy's quorum."""

    checkpoint: Checkpoint
    #: The valid cosignatures by the policy's witnesses, keyed by their policy names.
    cosigners: Mapping[str, Cosignature]

    def describe(self) -> str:
        """``witnessed by w1, w2`` (or ``no witness needed``)."""
        return "witnessed by " + ", ".join(sorted(self.cosigners)) if self.cosigners else "no witness cosignature needed"


def verify_witnessed(
    note: bytes,
    log_name: str,
    log_key: Ed25519PublicKey,
    policy: WitnessPolicy,
    *,
    now: float | None = None,
    max_skew: float = DEFAULT_MAX_SKEW,
) -> WitnessedCheckpoint:
    """Verify the log's signature on ``note`` and that its cosignatures meet ``policy``'s quorum.

    The log signature is checked as ``verify_checkpoint`` checks it (key name ``log_name``; other
    lines ignored); when the policy lists logs, ``(log_name, log_key)`` must be one of them. Then
    each policy witness's cosignature lines are verified (``open_cosignatures``: a bad one from a
    known key refuses the note, ``CosignatureError``). Raises ``WitnessQuorumError`` naming the
    witnesses whose valid cosignatures were found, those missing or not counted, and what the
    quorum needs.
    """
    checkpoint = verify_checkpoint(note, log_name, log_key)
    if policy.logs and not any(
        name == log_name and raw_public_key(key) == raw_public_key(log_key) for name, key in policy.logs
    ):
        listed = ", ".join(f"{n}+{note_key_id(n, k).hex()}" for n, k in policy.logs)
        raise LogProofError(
            f"the checkpoint's log key {log_name}+{note_key_id(log_name, log_key).hex()} is not one of the logs "
            f"{policy.source} accepts ({listed})",
            hint="pass the registry key the policy names, or add the log's vkey to the policy",
        )
    found = open_cosignatures(note, policy.witnesses.values(), now=now, max_skew=max_skew)
    cosigners: dict[str, Cosignature] = {}
    for name, key in policy.witnesses.items():
        mine = found.by(key)
        if mine is not None:
            cosigners[name] = mine
    if policy.satisfied(set(cosigners)):
        return WitnessedCheckpoint(checkpoint, cosigners)
    raise WitnessQuorumError(_quorum_message(checkpoint, policy, cosigners, found))


def _quorum_message(
    checkpoint: Checkpoint, policy: WitnessPolicy, cosigners: Mapping[str, Cosignature], found: Cosignatures
) -> str:
    have = ", ".join(cosigners) if cosigners else "none"
    why = {(k.name, k.key_id): reason for k, reason in found.skipped}
    skipped = {n: why[(w.name, w.key_id)] for n, w in policy.witnesses.items() if (w.name, w.key_id) in why}
    missing = [n for n in policy.witnesses if n not in cosigners]
    parts = [f"{n}: {skipped[n]}" if n in skipped else f"{n}: no cosignature" for n in missing]
    return (
        f"the checkpoint of {checkpoint.origin} at tree size {checkpoint.size} has valid cosignatures from "
        f"{len(cosigners)} of the {len(policy.witnesses)} witnesses of {policy.source} ({have}); its quorum, "
        f"{policy.describe()}, needs at least {policy.min_cosignatures()}"
        + (f" [{'; '.join(parts)}]" if parts else "")
    )

