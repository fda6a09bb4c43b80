"""Fresh bearer tokens for a radixkv deployment: one token per model replica, bound to the worker id
it registers as, and every token file each server needs, one directory per server.

    python -m scripts.make_tokens DIR [--replica NAME[=WORKER] ...] [--tenant NAME ...]
                                      [--k8s] [--if-missing] [--owner UID:GID]

Writes (directories 0700, files 0600)::

    DIR/cache/server-tokens          the cache manager's --auth-token-file: an admin token
                                     (reader,admin), one `replica worker=WORKER` token per replica,
                                     the routers' `reader,router` token
    DIR/NAME/server-tokens           replica NAME's --auth-token-file: the routers' `client` token,
                                     the other replicas' tokens as `replica` (KV pulls, KvTransfer)
    DIR/NAME/cache-token             replica NAME's --cache-token-file: its own replica token
    DIR/router/server-tokens         the router's --auth-token-file: one `client` token per tenant
    DIR/router/cache-token           the router's --cache-token-file (reader,router)
    DIR/router/replica-token         the router's --replica-token-file (client at the replicas)
    DIR/clients/TENANT.token, admin.token   what to hand to the tenants and the operators
    DIR/secrets.yaml                 with --k8s: the Secrets deploy/k8s mounts (radixkv-cache-tokens,
                                     radixkv-router-tokens, and NAME-tokens per replica)

The file names are what deploy/docker-entrypoint.sh wires when RADIXKV_TOKEN_DIR names a server's
directory (server-tokens -> --auth-token-file, cache-token -> --cache-token-file, replica-token ->
--replica-token-file). A replica's token registers pools only as WORKER (an fnmatch pattern; in
deploy/k8s a replica is a one-pod StatefulSet NAME, its pod and worker id NAME-0, the default
WORKER for --k8s), so a stolen replica token cannot take over another replica's pool. Default
replicas: radixkv-model-0 and radixkv-model-1 (deploy/k8s); default tenant: "default".
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.auth import parse_tokens
from common.private_files import make_private_dir, open_private

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?$")  # a DNS label: a Secret, a directory, a service
WORKER = re.compile(r"^[!-~]+$")  # printable ASCII without spaces or `|` (the token file's separator)
K8S_REPLICAS = ("radixkv-model-0", "radixkv-model-1")
RESERVED = {"cache", "router", "clients"}


def new_token() -> str:
    """256 random bits, URL-safe; the prefix lets secret scanners and people recognise it."""
    return "rkv_" + secrets.token_urlsafe(32)


@dataclass(slots=True)
class Replica:
    name: str  # its directory and, with --k8s, its Secret NAME-tokens
    worker: str  # the worker id (or fnmatch pattern) its token may register as
    token: str = field(default_factory=new_token)


@dataclass(slots=True)
class TokenSet:
    """Every token of one deployment and the file each server reads."""

    replicas: list[Replica]
    tenants: dict[str, str]  # tenant -> its client token at the router
    admin: str = field(default_factory=new_token)
    router_cache: str = field(default_factory=new_token)
    router_replica: str = field(default_factory=new_token)

    def files(self) -> dict[str, str]:
        """relative path -> content."""
        cache = ["# the cache manager's --auth-token-file (scripts/make_tokens.py)",
                 "# operators: Stats, Match, Evict, Clear", f"{self.admin} reader,admin"]
        for r in self.replicas:
            cache += [f"# replica {r.name}: RegisterPool, Step, Heartbeat, only as worker {r.worker}",
                      f"{r.token} replica worker={r.worker}"]
        cache += ["# the routers: Route (records decisions, pins prefixes), Stats",
                  f"{self.router_cache} reader,router"]
        out = {"cache/server-tokens": "\n".join(cache) + "\n"}
        for r in self.replicas:
            peers = [f"# replica {p.name} pulls KV from it (--kv-pulls; KvTransfer)\n{p.token} replica\n"
                     for p in self.replicas if p is not r]
            out[f"{r.name}/server-tokens"] = f"# replica {r.name}'s --auth-token-file: the routers\n" \
                                             f"{self.router_replica} client\n" + "".join(peers)
            out[f"{r.name}/cache-token"] = r.token + "\n"
        tenants = ["# the router's --auth-token-file: one client token per tenant"]
        for tenant, token in self.tenants.items():
            tenants += [f"# tenant {tenant}", f"{token} client"]
        out["router/server-tokens"] = "\n".join(tenants) + "\n"
        out["router/cache-token"] = self.router_cache + "\n"
        out["router/replica-token"] = self.router_replica + "\n"
        for tenant, token in self.tenants.items():
            out[f"clients/{tenant}.token"] = token + "\n"
        out["clients/admin.token"] = self.admin + "\n"
        return out

    def k8s_secrets(self, files: dict[str, str]) -> str:
        """The Secrets deploy/k8s mounts, as one YAML stream (data base64: no quoting issues)."""

        def secret(name: str, folder: str) -> str:
            keys = sorted(p.split("/", 1)[1] for p in files if p.split("/", 1)[0] == folder)
            data = "".join(f"  {key}: {base64.b64encode(files[f'{folder}/{key}'].encode()).decode()}\n"
                           for key in keys)
            return (f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n"
                    f"  labels:\n    app.kubernetes.io/part-of: radixkv\ntype: Opaque\ndata:\n{data}")

        docs = [secret("radixkv-cache-tokens", "cache"), secret("radixkv-router-tokens", "router")]
        docs += [secret(f"{r.name}-tokens", r.name) for r in self.replicas]
        return "# kubectl apply -f secrets.yaml   (scripts/make_tokens.py --k8s)\n" + "---\n".join(docs)


def parse_replica(text: str, k8s: bool) -> Replica:
    name, sep, worker = text.partition("=")
    if not NAME.match(name) or name in RESERVED:
        raise argparse.ArgumentTypeError(f"replica name {name!r}: lowercase letters, digits and '-' "
                                         f"(not {', '.join(sorted(RESERVED))})")
    worker = worker if sep else (f"{name}-0" if k8s else name)
    if not WORKER.match(worker) or "|" in worker:
        raise argparse.ArgumentTypeError(f"worker {worker!r}: printable ASCII without spaces or '|'")
    return Replica(name, worker)


def write(out: Path, files: dict[str, str], owner: tuple[int, int] | None) -> None:
    make_private_dir(str(out))
    for rel, content in files.items():
        path = out / rel
        make_private_dir(str(path.parent))
        fd = open_private(str(path), os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(content)
        if owner is not None:
            os.chown(path, *owner)
            os.chown(path.parent, *owner)
    if owner is not None:
        os.chown(out, *owner)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.make_tokens",
                                     description="fresh bearer tokens for a radixkv deployment (see the module "
                                                 "docstring for the files)")
    parser.add_argument("out", type=Path, help="directory to write (created 0700)")
    parser.add_argument("--replica", action="append", default=[], metavar="NAME[=WORKER]",
                        help="a model replica: its directory / Secret name and the worker id (or fnmatch "
                             "pattern) its token registers as (default WORKER: NAME-0 with --k8s, else NAME); "
                             f"repeatable; default {' '.join(K8S_REPLICAS)} (deploy/k8s)")
    parser.add_argument("--tenant", action="append", default=[], metavar="NAME",
                        help="a tenant given a client token at the router (repeatable; default: default)")
    parser.add_argument("--k8s", action="store_true", help="also write DIR/secrets.yaml (kubectl apply -f)")
    parser.add_argument("--if-missing", action="store_true",
                        help="leave DIR as it is when it already holds a complete token set (refuse a partial one)")
    parser.add_argument("--owner", default=None, metavar="UID:GID",
                        help="chown what is written (when run as root for a server running as UID)")
    args = parser.parse_args(argv)
    try:
        # the default replicas are deploy/k8s's, whose worker ids are their pods' names (NAME-0)
        replicas = [parse_replica(r, args.k8s or not args.replica) for r in (args.replica or K8S_REPLICAS)]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    tenants = args.tenant or ["default"]
    for tenant in tenants:
        if not NAME.match(tenant):
            parser.error(f"tenant {tenant!r}: lowercase letters, digits and '-'")
    for what, names in (("replica", [r.name for r in replicas]), ("tenant", tenants)):
        if len(set(names)) != len(names):
            parser.error(f"a {what} is named twice")
    owner = None
    if args.owner is not None:
        uid, _, gid = args.owner.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            parser.error("--owner takes UID:GID (numbers)")
        owner = (int(uid), int(gid))
    tokens = TokenSet(replicas, {tenant: new_token() for tenant in tenants})
    files = tokens.files()
    if args.k8s:
        files["secrets.yaml"] = tokens.k8s_secrets(files)
    if args.out.exists():  # never chmod, or write into, a directory that holds other things
        if not args.out.is_dir():
            parser.error(f"{args.out} is not a directory")
        others = sorted(set(os.listdir(args.out)) - {rel.split("/", 1)[0] for rel in files})
        if others:
            print(f"make_tokens: {args.out} holds other things ({', '.join(others[:5])}); give a new or empty "
                  "directory", file=sys.stderr, flush=True)
            return 1
    present = [rel for rel in files if (args.out / rel).exists()]
    if present and args.if_missing:
        if len(present) == len(files):
            print(f"make_tokens: {args.out} already holds the tokens; kept", flush=True)
            return 0
        missing = sorted(set(files) - set(present))
        print(f"make_tokens: {args.out} holds a partial token set (missing {', '.join(missing)}); remove it "
              "(docker compose down -v) to make a new one", file=sys.stderr, flush=True)
        return 1
    if present and not args.if_missing:
        print(f"make_tokens: {args.out} already holds token files ({present[0]} ...): remove them first, or pass "
              "--if-missing to keep them", file=sys.stderr, flush=True)
        return 1
    for rel, content in files.items():  # what the servers will parse, parsed once here
        if rel.endswith("server-tokens"):
            parse_tokens(content, rel)
    write(args.out, files, owner)
    print(f"make_tokens: wrote {len(files)} files to {args.out} ({len(replicas)} replicas, {len(tenants)} tenants)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
