"""Which keys an artifact must be signed by before the engine uses it.

Every command and API path that loads an artifact or a library verifies its DSSE signature
against trusted keys by default. The keys come from, in this order (the first that is set wins):

1. ``--trusted-keys FILE`` (``trusted_keys=`` here);
2. the environment variable ``KVGRAFT_TRUSTED_KEYS`` naming a file;
3. ``$KVGRAFT_HOME/trusted-keys.json`` when it exists (``kvgraft keys trust --file`` writes it).

The local key that ``capture`` makes under ``$KVGRAFT_HOME/keys`` is trusted only when the user
says so: ``--trust-local-key`` adds its public half to the keys above (or is the only key), or
the user adds it to a trusted-keys file with ``kvgraft keys trust``. With no key from any of
these, loading is refused (``NoTrustedKeysError``) naming every way to give keys.
``--insecure-skip-verify`` (``Trust.skipped()``) is the only way not to check, and it cannot be
combined with keys: the caller must choose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import TRUSTED_KEYS_FILE, kvgraft_home
from kvgraft.verifier import TrustedKeys, load_public_key, load_trusted_keys, open_signing_key, trusted_key

from .errors import NoTrustedKeysError, TrustOptionsError

#: Environment variable naming a trusted-keys file (used when no ``--trusted-keys`` is given).
TRUSTED_KEYS_ENV = "KVGRAFT_TRUSTED_KEYS"
#: ``TRUSTED_KEYS_FILE`` (kvgraft.schemas) under ``$KVGRAFT_HOME`` is used when neither the option nor the
#: variable is set.
#: What a skipped check reports as the artifact's signature (``--json`` prints it).
SKIPPED = "skipped (--insecure-skip-verify)"
#: The stderr warning ``--insecure-skip-verify`` prints once per command.
SKIP_WARNING = (
    "WARNING: --insecure-skip-verify: artifact signatures are NOT checked; whoever could write these "
    "files decides what the model computes. Drop the flag and pass --trusted-keys FILE."
)
#: How to give keys, for refusals (one line).
HOW_TO_TRUST = (
    f"pass --trusted-keys FILE, set {TRUSTED_KEYS_ENV}=FILE, or write $KVGRAFT_HOME/{TRUSTED_KEYS_FILE} "
    "with 'kvgraft keys trust'; --trust-local-key trusts this machine's own key; "
    "--insecure-skip-verify skips the check (not recommended)"
)


@dataclass(frozen=True)
class Trust:
    """The keys artifacts are verified against, where they came from, or an explicit skip.

    Invariant: ``keys is None`` exactly when the user opted out with ``--insecure-skip-verify``.
    """

    keys: TrustedKeys | None
    source: str

    @property
    def skip(self) -> bool:
        """True when signatures are not checked (the user asked for it)."""
        return self.keys is None

    @classmethod
    def skipped(cls) -> Trust:
        """No signature check, as ``--insecure-skip-verify`` asks."""
        return cls(None, "--insecure-skip-verify")


def home_trusted_keys_path() -> Path:
    """``$KVGRAFT_HOME/trusted-keys.json``."""
    return kvgraft_home() / TRUSTED_KEYS_FILE


def local_key_path() -> Path:
    """The local signing key made once under ``$KVGRAFT_HOME`` for users who pass no ``--key``."""
    return kvgraft_home() / "keys" / "local.pem"


def local_public_key_path() -> Path:
    """The public half of the local signing key (``$KVGRAFT_HOME/keys/local.pem.pub``)."""
    return local_key_path().with_name("local.pem.pub")


def _merge(base: TrustedKeys | None, extra: TrustedKeys) -> TrustedKeys:
    if base is None:
        return extra
    known = {k.keyid for k in base.keys}
    added = tuple(k for k in extra.keys if k.keyid not in known)
    return TrustedKeys((*base.keys, *added), base.threshold, base.thresholds, base.payload_types)


def resolve_trust(
    trusted_keys: Path | None = None, *, trust_local_key: bool = False, insecure_skip_verify: bool = False
) -> Trust:
    """The keys to verify artifacts against, from the option, the environment, ``$KVGRAFT_HOME``
    and the local key (see the module docstring); refuses when there are none."""
    if insecure_skip_verify:
        if trusted_keys is not None or trust_local_key:
            raise TrustOptionsError(
                "--insecure-skip-verify cannot be combined with --trusted-keys or --trust-local-key",
                hint="either verify against keys or skip the check, not both",
            )
        return Trust.skipped()
    keys: TrustedKeys | None = None
    source = ""
    env = os.environ.get(TRUSTED_KEYS_ENV, "").strip()
    if trusted_keys is not None:
        keys, source = load_trusted_keys(trusted_keys), f"--trusted-keys {trusted_keys}"
    elif env:
        keys, source = load_trusted_keys(Path(env)), f"{TRUSTED_KEYS_ENV}={env}"
    elif home_trusted_keys_path().is_file():
        keys, source = load_trusted_keys(home_trusted_keys_path()), str(home_trusted_keys_path())
    if trust_local_key:
        pub = local_public_key_path()
        if not pub.is_file():
            raise NoTrustedKeysError(f"--trust-local-key: there is no local key yet ({pub} is missing)",
                                     hint="capture something without --key first, or pass --trusted-keys FILE")
        keys = _merge(keys, TrustedKeys((trusted_key("local", load_public_key(pub)),)))
        source = f"{source} + the local key" if source else f"the local key {pub}"
    if keys is None:
        raise NoTrustedKeysError("no trusted keys to verify artifact signatures against", hint=HOW_TO_TRUST)
    return Trust(keys, source)


def trust_signer(key: Path, passphrase: bytes | None = None, *, name: str = "signer") -> TrustedKeys:
    """Trust exactly the public half of the private key at ``key`` (for reading back what this
    process itself just signed with it)."""
    with open_signing_key(key, passphrase) as signer:
        return TrustedKeys((trusted_key(name, signer.public_key),))
