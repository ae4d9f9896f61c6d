"""The Kubernetes manifests (deploy/kubernetes): each overlay renders with ``kubectl kustomize`` and says what
edgepath needs -- an edge Deployment with its UDP and TCP ports and probes, slot servers as a StatefulSet behind a
headless Service whose DNS name (or, on one node, whose socket directory) is what the edges are told to follow,
disruption budgets, resource requests, the model from a volume -- and every command line in them is one edgepath
parses, every $(VAR) one the container defines.  Nothing is deployed here (docs/DEPLOY.md, "Kubernetes")."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from containers.podman_pods import INIT_TYPE, expand, secret_data, to_podman

from edgepath.cli import build_parser
from edgepath.edge.tenancy.auth import load_keys
from edgepath.transports.base import DEFAULT_HANG_TIMEOUT

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("one-node", "gpu-rdma", "podman")
pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed: the overlays are rendered with kubectl kustomize"
)


def render(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def containers(objects: dict, kind: str, name: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in objects[kind, name]["spec"]["template"]["spec"]["containers"]}


def arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    assert args.count(flag) == 1, (container["name"], flag, args)
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param, render(request.param)


def test_each_overlay_has_the_objects_edgepath_needs(overlay: tuple[str, dict]) -> None:
    name, objects = overlay
    kinds = {kind for kind, _ in objects}
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget"} <= kinds
    assert {n for k, n in objects if k == "Service"} == {"edgepath-edge", "edgepath-slots"}
    assert {n for k, n in objects if k == "PodDisruptionBudget"} == {"edgepath-edge", "edgepath-slots"}
    assert all(doc["metadata"].get("namespace", "edgepath") == "edgepath" for doc in objects.values())
    for kind, workload in (("Deployment", "edgepath-edge"), ("StatefulSet", "edgepath-slots")):
        pod = objects[kind, workload]["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert objects[kind, workload]["spec"]["selector"]["matchLabels"].items() <= labels.items()
        budget = objects["PodDisruptionBudget", workload]["spec"]["selector"]["matchLabels"]
        assert budget.items() <= labels.items()  # each budget covers its pods
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for container in pod["spec"]["containers"]:
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
            assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
            grace = float(arg(container, "--grace-period"))
            assert grace < pod["spec"]["terminationGracePeriodSeconds"]  # it drains before the SIGKILL
    if name == "gpu-rdma":
        assert ("PersistentVolumeClaim", "edgepath-models") in objects
    else:
        assert any(kind == "Secret" for kind, _ in objects)  # a key to try it with, generated
        assert ("PersistentVolumeClaim", "edgepath-models") not in objects  # the models are a host directory


def test_the_edge_listens_on_udp_for_http3_and_tcp_for_http_with_its_probes(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    service = {p["name"]: p for p in objects["Service", "edgepath-edge"]["spec"]["ports"]}
    assert (service["http3"]["protocol"], service["http3"]["targetPort"]) == ("UDP", 4433)
    assert (service["http"]["protocol"], service["http"]["targetPort"]) == ("TCP", 8080)
    edge = containers(objects, "Deployment", "edgepath-edge")
    for name, transport, protocol in (("http", "tcp", "TCP"), ("http3", "quic", "UDP")):
        container = edge[name]
        (port,) = container["ports"]
        assert arg(container, "--transport") == transport and port["protocol"] == protocol
        assert int(arg(container, "--port")) == port["containerPort"] == service[name]["targetPort"]
    http = edge["http"]
    assert http["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert http["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert http["startupProbe"]["httpGet"]["path"] == "/health/live"


def test_the_edges_follow_the_slot_servers_where_the_statefulset_puts_them(overlay: tuple[str, dict]) -> None:
    name, objects = overlay
    headless = objects["Service", "edgepath-slots"]["spec"]
    slots = objects["StatefulSet", "edgepath-slots"]
    assert headless["clusterIP"] == "None" and slots["spec"]["serviceName"] == "edgepath-slots"
    assert headless["selector"].items() <= slots["spec"]["template"]["metadata"]["labels"].items()
    (server,) = containers(objects, "StatefulSet", "edgepath-slots").values()
    listen = arg(server, "--listen")
    for edge in containers(objects, "Deployment", "edgepath-edge").values():
        source = arg(edge, "--slot-servers-from")
        if name == "gpu-rdma":
            (port,) = headless["ports"]
            assert source == f"dns:edgepath-slots.$(POD_NAMESPACE).svc.cluster.local:{port['port']}"
            assert listen == f"$(POD_IP):{port['port']}"
            namespace = next(e for e in edge["env"] if e["name"] == "POD_NAMESPACE")
            assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
            for container in (edge, server):
                assert arg(container, "--data-path") == "verbs"
        else:
            directory = source.removeprefix("dir:")
            assert listen == f"{directory}/$(POD_NAME).sock"  # the dir source lists *.sock
            host = {}
            for kind, workload in (("Deployment", "edgepath-edge"), ("StatefulSet", "edgepath-slots")):
                spec = objects[kind, workload]["spec"]["template"]["spec"]
                volumes = {v["name"]: v for v in spec["volumes"]}
                (mount,) = [m for c in spec["containers"][:1] for m in c["volumeMounts"] if m["mountPath"] == directory]
                host[kind] = volumes[mount["name"]]["hostPath"]["path"]
            assert host["Deployment"] == host["StatefulSet"]  # one directory of the node, shared
    if name == "gpu-rdma":
        limits = server["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1" and any(k.startswith("rdma/") for k in limits)


def test_every_command_line_is_one_edgepath_parses_and_every_variable_is_defined(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    parser = build_parser()
    commands = {a.dest: a for a in parser._actions if a.dest == "command"}
    subparsers = next(iter(commands.values())).choices  # type: ignore[attr-defined]
    config = {key for (kind, _), doc in objects.items() if kind == "ConfigMap" for key in doc.get("data", {})}
    for kind, workload in (("Deployment", "edgepath-edge"), ("StatefulSet", "edgepath-slots")):
        for container in containers(objects, kind, workload).values():
            command, *args = container["args"]
            known = subparsers[command]._option_string_actions
            flags = [a for a in args if a.startswith("--")]
            assert flags and all(flag in known for flag in flags), (container["name"], flags)
            defined = {e["name"] for e in container.get("env", ())} | config
            used = {v for a in args for v in re.findall(r"\$\((\w+)\)", a)}
            assert used <= defined, (container["name"], used - defined)


def test_the_slot_servers_are_probed_where_they_listen_as_their_agents_judge_them(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    (server,) = containers(objects, "StatefulSet", "edgepath-slots").values()
    env = {key: value for (k, _), doc in objects.items() if k == "ConfigMap" for key, value in doc["data"].items()}
    env |= {"POD_NAME": "edgepath-slots-0", "POD_IP": "10.1.2.3"}  # what the pod's field references give
    assert {e["name"] for e in server["env"]} >= {n for n in ("POD_NAME", "POD_IP") if f"$({n})" in str(server)}

    def expand(text: str, pattern: str) -> str:
        return re.sub(pattern, lambda m: env[m.group(1)], text)  # KeyError: a variable the pod does not define

    parser = build_parser()
    served = parser.parse_args([expand(a, r"\$\((\w+)\)") for a in server["args"]])
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = server[kind]
        shell, dash_c, line = probe["exec"]["command"]
        assert (shell, dash_c) == ("sh", "-c")  # an exec probe's command expands no $(VAR): the shell does
        exec_, program, *argv = shlex.split(expand(line, r"\$(\w+)"))
        assert (exec_, program) == ("exec", "edgepath")
        settings = parser.parse_args(argv)
        assert settings.command == "probe"
        assert settings.address == served.listen  # where the slot server listens, over its data path
        assert (settings.data_path, settings.device, settings.gid_index) == (
            served.data_path,
            served.device,
            served.gid_index,
        )
        assert settings.ready == (kind == "readinessProbe")  # a draining server is alive, not ready
        assert probe["timeoutSeconds"] > DEFAULT_HANG_TIMEOUT  # the probe may wait a hang timeout for a heartbeat
    assert server["startupProbe"]["periodSeconds"] * server["startupProbe"]["failureThreshold"] >= 300  # model load


def mounted_at(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume of pod ``spec`` that ``container`` has mounted at the directory holding ``path``."""
    (mount,) = [m for m in container["volumeMounts"] if str(Path(path).parent) == m["mountPath"]]
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])


def test_the_edges_read_their_tenants_from_a_secret_and_count_quotas_in_one_ledger_per_pod(
    overlay: tuple[str, dict], tmp_path: Path
) -> None:
    name, objects = overlay
    spec = objects["Deployment", "edgepath-edge"]["spec"]["template"]["spec"]
    edges = containers(objects, "Deployment", "edgepath-edge")
    files = {arg(edge, "--tenants-file") for edge in edges.values()}
    (tenants_file,) = files  # the same tenants in both edges
    secrets = {mounted_at(spec, edge, tenants_file)["secret"]["secretName"] for edge in edges.values()}
    (secret,) = secrets  # a Secret: the file holds the keys' digests
    # one edge of the pod keeps the ledger, the other counts in it: one quota for the pod (docs/DEPLOY.md)
    homes = {n: arg(e, "--quota-listen") for n, e in edges.items() if "--quota-listen" in e["args"]}
    ((keeper, ledger),) = homes.items()
    for edge_name, edge in edges.items():
        assert "emptyDir" in mounted_at(spec, edge, ledger)  # the pod's own directory, shared by its containers
        if edge_name != keeper:
            assert arg(edge, "--quota-home") == ledger
    if name == "gpu-rdma":
        assert secret == "edgepath-tenants"  # the user's to create, as the API keys and TLS Secrets
        return
    # the one-node overlay's own: a tenants file edgepath reads, beside the flat test key
    path = tmp_path / Path(tenants_file).name
    path.write_text(secret_data(objects["Secret", secret])[path.name])
    flat = secret_data(objects["Secret", next(n for k, n in objects if k == "Secret" and "api-keys" in n)])["keys"]
    keys = load_keys(None, environ={"EDGEPATH_API_KEYS": flat}, tenants_file=str(path))
    assert keys is not None
    for key, tenant in ((b"edgepath-one-node-key-a", "team-a"), (b"edgepath-one-node-key-b", "team-b")):
        named = keys.identify(key)
        assert named is not None and named.name == tenant and named.tokens_per_minute > 0
    assert keys.identify(flat.encode()) is not None  # the flat key is a tenant of its own still


def test_the_edge_that_counts_in_the_pods_ledger_waits_for_it_then_runs_edgepath_with_its_args(
    tmp_path: Path,
) -> None:
    edges = containers(render("one-node"), "Deployment", "edgepath-edge")
    (waiter,) = [e for e in edges.values() if "--quota-home" in e["args"]]
    ledger = arg(waiter, "--quota-home")
    shell, dash_c, script, zero = waiter["command"]
    assert (shell, dash_c, zero) == ("sh", "-c", "edgepath")  # $0; the args are "$@"
    socket_path = tmp_path / "ledger.sock"
    fake = tmp_path / "bin" / "edgepath"  # what the image's edgepath would be given
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    started = subprocess.Popen(
        ["sh", "-c", script.replace(ledger, str(socket_path)), zero, *waiter["args"]],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    with pytest.raises(subprocess.TimeoutExpired):
        started.wait(timeout=0.5)  # no ledger yet: it waits
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listening:
        listening.bind(str(socket_path))
        out, _ = started.communicate(timeout=10)
    assert started.returncode == 0 and out.splitlines() == waiter["args"]  # every arg as given, none split


def test_the_edges_carry_the_engine_type_an_inference_pool_reads_their_metrics_by(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    labels = objects["Deployment", "edgepath-edge"]["spec"]["template"]["metadata"]["labels"]
    # /metrics carries vLLM's names (edge/metrics.py): the Gateway API Inference Extension's label and llm-d's
    assert labels["inference.networking.k8s.io/engine-type"] == "vllm"
    assert labels["llm-d.ai/engine-type"] == "vllm"


def test_the_podman_overlay_publishes_the_edge_on_the_hosts_loopback_address() -> None:
    edge = containers(render("podman"), "Deployment", "edgepath-edge")
    ports = {
        (p["containerPort"], p["protocol"]): (p["hostIP"], p["hostPort"]) for c in edge.values() for p in c["ports"]
    }
    assert ports == {(8080, "TCP"): ("127.0.0.1", 18080), (4433, "UDP"): ("127.0.0.1", 14433)}


def test_podman_gets_the_pods_the_controllers_would_make_with_their_command_lines_expanded() -> None:
    objects = render("podman")
    pods = {d["metadata"]["name"]: d for d in to_podman(list(objects.values())) if d["kind"] == "Pod"}
    assert set(pods) == {"edgepath-edge-0", "edgepath-slots-0", "edgepath-slots-1"}  # one edge, two slot servers
    kinds = {d["kind"] for d in to_podman(list(objects.values()))}
    assert kinds == {"ConfigMap", "Pod"}  # what podman kube play runs; Services, budgets, Secrets left out
    config = objects["ConfigMap", next(n for k, n in objects if k == "ConfigMap")]["data"]
    for name, pod in pods.items():
        assert pod["spec"]["restartPolicy"] == "Always" and pod["spec"]["hostname"] == name
        for container in pod["spec"]["containers"]:
            assert not any("$(" in part for part in container["args"])  # every $(VAR) expanded, as a kubelet does
            for var in container.get("env", ()):
                assert "value" in var and "valueFrom" not in var  # Secret keys and field references resolved
            if name.startswith("edgepath-slots"):
                assert arg(container, "--listen") == f"/run/edgepath/slots/{name}.sock"
                assert f"model=/models/{config['EDGEPATH_MODEL']}" in container["args"]
            else:
                assert {"name": "EDGEPATH_API_KEYS", "value": "edgepath-one-node-test-key"} in container["env"]
        if pod["spec"].get("initContainers"):
            assert pod["metadata"]["annotations"][INIT_TYPE] == "always"
        for volume in pod["spec"]["volumes"]:
            assert "secret" not in volume  # podman 4.3 reads those from podman secrets (and crashes on a missing one)
    # the tenants Secret mounted as a ConfigMap of the same name and data
    edge = pods["edgepath-edge-0"]["spec"]
    (tenants,) = [v["configMap"]["name"] for v in edge["volumes"] if v["name"] == "tenants"]
    made = next(d for d in to_podman(list(objects.values())) if d["metadata"]["name"] == tenants)
    assert made["kind"] == "ConfigMap" and made["data"] == secret_data(objects["Secret", tenants])


def test_variables_expand_as_a_kubelet_expands_them() -> None:
    # defined: replaced; $$: a literal $ (so $$(A) stays as written); undefined: left as it is
    assert expand("$(A)-$$(A)-$(B)-$$", {"A": "x"}) == "x-$(A)-$(B)-$"


def test_what_podman_cannot_be_given_is_refused_naming_it() -> None:
    objects = render("gpu-rdma")
    config = [doc for (kind, _), doc in objects.items() if kind == "ConfigMap"]
    with pytest.raises(ValueError, match=r"POD_IP.*status\.podIP"):  # rdma_cm listens on $(POD_IP): none before
        to_podman([*config, objects["StatefulSet", "edgepath-slots"]])
    with pytest.raises(ValueError, match="EDGEPATH_API_KEYS: no Secret edgepath-api-keys with key keys"):
        to_podman([*config, objects["Deployment", "edgepath-edge"]])  # gpu-rdma's Secrets are the user's to create
    one_node = render("one-node")
    without = [doc for (kind, name), doc in one_node.items() if not (kind == "Secret" and "tenants" in name)]
    with pytest.raises(ValueError, match="volume tenants: no Secret edgepath-tenants-"):
        to_podman(without)
