"""``kvgraft oms sign``: an OpenSSF model signing signature (``model.sig``) for a directory.

``kvgraft oms sign --key KEY DIR`` signs every file of DIR (an artifact, a record, a library
entry, any directory of regular files) as ``model_signing sign key`` does, and writes
``DIR/model.sig`` atomically, so that ``model_signing verify key DIR --signature DIR/model.sig
--public_key KEY.pub`` and ``kvgraft-verify oms DIR --public-key KEY.pub`` accept it
(docs/model-signing.md). The key is ECDSA P-256 or P-384: model_signing verifies no other.
Needs only ``kvgraft.schemas`` and ``kvgraft.verifier``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvgraft.schemas import MODEL_SIG_FILE
from kvgraft.verifier import key_type_label, open_signing_key, sign_model_directory, write_atomic

from ._common import CliError, add_command, passphrase


def _cmd_oms_sign(args: argparse.Namespace) -> dict[str, Any]:
    directory: Path = args.directory
    target = directory / MODEL_SIG_FILE
    if target.is_dir() and not target.is_symlink():
        raise CliError(f"{target} is a directory", hint=f"move it away: {MODEL_SIG_FILE} is the signature's file name")
    if (target.exists() or target.is_symlink()) and not args.force:
        raise CliError(f"{target} already exists", hint="pass --force to replace it with a new signature")
    with open_signing_key(args.key, passphrase(args.passphrase_env)) as signer:
        signed = sign_model_directory(directory, signer, ignore_git_paths=not args.no_ignore_git_paths)
        keyid = signer.keyid
    # Renamed into place: a reader sees the old signature or the new one, never a part (an
    # existing link is replaced, not written through).
    try:
        write_atomic(target, signed.bundle, 0o644)
    except OSError as e:
        raise CliError(f"cannot write {target}: {e.strerror or e}", hint="sign a directory you can write to") from e
    git = " --no-ignore-git-paths" if args.no_ignore_git_paths else ""
    return {
        "signature": str(target),
        "directory": str(directory),
        "files": list(signed.files),
        "root_digest": signed.root_digest,
        "key_type": signed.key_type,
        "keyid": keyid,
        "summary": f"wrote {target}: {len(signed.files)} file(s) signed with {key_type_label(signed.key_type)} key {keyid[:16]}; "
        f"check it with 'model_signing verify key {directory}{git} --signature {target} --public_key KEY.pub' "
        f"or 'kvgraft-verify oms {directory}{git} --public-key KEY.pub'",
    }


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``oms`` (``sign``) to ``kvgraft``'s subcommands."""
    oms = sub.add_parser("oms", help="OpenSSF model signing: sign a directory as model_signing does (model.sig)")
    osub = oms.add_subparsers(dest="oms_command", required=True, metavar="ACTION")
    sign = add_command(osub, "sign", _cmd_oms_sign, help=f"write DIR/{MODEL_SIG_FILE} signing every file of DIR")
    sign.add_argument("directory", type=Path, metavar="DIR", help="the directory to sign (an artifact, record or entry)")
    sign.add_argument("--key", type=Path, required=True,
                      help="ECDSA P-256 or P-384 private key (PEM; 'kvgraft keys generate --type p256')")
    sign.add_argument("--passphrase-env", metavar="VAR", help="the key's passphrase is in this environment variable")
    sign.add_argument("--force", action="store_true", help=f"replace an existing {MODEL_SIG_FILE}")
    sign.add_argument("--no-ignore-git-paths", action="store_true",
                      help="sign the top-level .git, .gitattributes, .github and .gitignore too (model_signing's "
                      "option; ignored by default, as model_signing does); verify with the same option")
