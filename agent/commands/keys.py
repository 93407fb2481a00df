"""``ridgeline keys``: make a CURVE key pair the way zmq does, as zmq's certificate files.

``zmq.auth.create_certificates`` (a ``zmq.curve_keypair()`` written as Z85 certificates):
``NAME.key`` holds the public key (give it to the other side: for a client, copy it into
the agent's ``publisher.curve_allowed_clients_dir``), ``NAME.key_secret`` holds both keys
and stays with its owner (mode 0600; the agent's ``publisher.curve_secret_key_file`` for a
server, ``--client-key`` of ``tail``/``top``/``record`` for a client). Existing files are
never overwritten; a missing folder is created (mode 0700).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ridgeline.agent.commands import description
from ridgeline.probes.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("keys", help="make a CURVE key pair (zmq certificate files) for the stream",
                       description=description(__doc__))
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="folder to write the two files into")
    p.add_argument("--name", default="client", help="file name stem: NAME.key and NAME.key_secret "
                                                    "(default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    import zmq.auth
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", args.name):
        raise InputError(f"--name {args.name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    out = Path(args.output)
    if not out.is_dir():
        # A missing folder is made (0700: it will hold a secret key), as `mkdir -p` would.
        try:
            out.mkdir(mode=0o700, parents=True)
        except OSError as exc:
            raise InputError(f"{out}: cannot create the folder ({exc.strerror or exc})") from None
    public, secret = out / f"{args.name}.key", out / f"{args.name}.key_secret"
    for f in (public, secret):
        if f.exists():
            raise InputError(f"{f} exists; not overwriting a key (choose another --name or folder)")
    # The secret file is created 0600 from the start (umask), not narrowed afterwards.
    old = os.umask(0o077)
    try:
        pub_file, sec_file = zmq.auth.create_certificates(str(out), args.name)
    except OSError as exc:
        raise InputError(f"{out}: cannot write the key files ({exc.strerror or exc})") from None
    finally:
        os.umask(old)
    os.chmod(pub_file, 0o644)
    key, _ = zmq.auth.load_certificate(pub_file)
    print(f"public key  {pub_file}\nsecret key  {sec_file}  (keep it; mode 0600)\nZ85 public  {key.decode()}")
    return 0
