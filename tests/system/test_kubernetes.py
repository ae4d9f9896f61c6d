"""The Kubernetes manifests (deploy/kubernetes): each overlay renders with ``kubectl kustomize`` and says what
edgepath needs -- an edge Deployment with its UDP and TCP ports and probes, slot servers as a StatefulSet behind a
headless Service whose DNS name (or, on one node, whose socket directory) is what the edges are told to follow, one
quota ledger (a StatefulSet of one, its words on a volume) that every edge counts in, disruption budgets, resource
requests, the model from a volume; every pod "restricted" under the Pod Security Standards but for the one capability
RDMA needs, NetworkPolicies that let only edges reach the slot servers and the ledger, no key shipped -- and every
command line in them is one edgepath parses, every $(VAR) one the container defines.  Nothing is deployed here
(docs/DEPLOY.md, "Kubernetes")."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from containers.make_secrets import make as make_secrets
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


WORKLOADS = (("Deployment", "edgepath-edge"), ("StatefulSet", "edgepath-slots"), ("StatefulSet", "edgepath-ledger"))


def pod_spec(objects: dict, kind: str, name: str) -> dict[str, Any]:
    return objects[kind, name]["spec"]["template"]["spec"]


def test_each_overlay_has_the_objects_edgepath_needs(overlay: tuple[str, dict]) -> None:
    name, objects = overlay
    kinds = {kind for kind, _ in objects}
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "StatefulSet", "PodDisruptionBudget"} <= kinds
    assert {n for k, n in objects if k == "Service"} == {"edgepath-edge", "edgepath-slots", "edgepath-ledger"}
    assert {n for k, n in objects if k == "StatefulSet"} == {"edgepath-slots", "edgepath-ledger"}
    assert "Secret" not in kinds  # no key shipped: the API keys and tenants are the user's Secrets
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
    assert ("PersistentVolumeClaim", "edgepath-models") in objects
    if name != "gpu-rdma":  # the models are a directory of the node, a PersistentVolume bound to that claim
        volume = objects["PersistentVolume", objects["PersistentVolumeClaim", "edgepath-models"]["spec"]["volumeName"]]
        assert volume["spec"]["hostPath"]["path"] == "/var/lib/edgepath/models"


def test_every_pod_is_restricted_but_for_the_one_capability_rdma_needs(overlay: tuple[str, dict]) -> None:
    """The Pod Security Standards' "restricted" profile, field by field, for every pod; gpu-rdma's add IPC_LOCK
    (memory registration) and nothing else; one-node's namespace enforces "restricted"."""
    name, objects = overlay
    for kind, workload in WORKLOADS:
        spec = pod_spec(objects, kind, workload)
        assert spec["automountServiceAccountToken"] is False
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] >= 10000
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        for volume in spec["volumes"]:  # restricted allows these kinds of volume only
            assert set(volume) - {"name"} <= {"configMap", "secret", "emptyDir", "persistentVolumeClaim"}, volume
        for container in (*spec.get("initContainers", ()), *spec["containers"]):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            added = set(context["capabilities"].get("add", ()))
            assert added == ({"IPC_LOCK"} if name == "gpu-rdma" else set()), (workload, container["name"], added)
            assert "privileged" not in context and "runAsUser" not in context
            if context.get("readOnlyRootFilesystem"):  # somewhere to write: /tmp, a volume of the pod
                assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), container["name"]
    labels = objects["Namespace", "edgepath"]["metadata"].get("labels", {})
    if name == "gpu-rdma":  # IPC_LOCK is beyond "baseline": enforced "privileged", "restricted" warned and audited
        assert labels["pod-security.kubernetes.io/warn"] == labels["pod-security.kubernetes.io/audit"] == "restricted"
    else:
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return policy["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()


def test_network_policies_let_only_edges_reach_the_slot_servers_and_the_ledger(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    policies = [doc for (kind, _), doc in objects.items() if kind == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]  # nothing reaches a pod no policy lets in
    labels = {w: objects[k, w]["spec"]["template"]["metadata"]["labels"] for k, w in WORKLOADS}
    for workload in ("edgepath-slots", "edgepath-ledger"):
        rules = [rule for p in policies if selects(p, labels[workload]) for rule in p["spec"].get("ingress", ())]
        assert rules, workload
        for rule in rules:  # every way in is from an edge's pod
            assert rule["from"] and all(selects({"spec": {"podSelector": f["podSelector"]}}, labels["edgepath-edge"])
                                        and set(f) == {"podSelector"} for f in rule["from"]), rule  # fmt: skip
    edge_rules = [r for p in policies if selects(p, labels["edgepath-edge"]) for r in p["spec"].get("ingress", ())]
    open_ports = {
        (port["port"], port["protocol"]) for rule in edge_rules if "from" not in rule for port in rule["ports"]
    }
    service = objects["Service", "edgepath-edge"]["spec"]["ports"]
    assert open_ports == {(p["targetPort"], p["protocol"]) for p in service}  # clients reach the client ports only
    edge = containers(objects, "Deployment", "edgepath-edge").values()
    ops_ports = {p["containerPort"] for c in edge for p in c["ports"] if p["name"].startswith("ops")}
    for rule in edge_rules:  # the ops listeners: from namespaces labelled for it only
        if {port["port"] for port in rule["ports"]} & ops_ports:
            assert [set(f) for f in rule["from"]] == [{"namespaceSelector"}], rule


def test_the_edge_listens_on_udp_for_http3_and_tcp_for_http_with_its_probes(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    service = {p["name"]: p for p in objects["Service", "edgepath-edge"]["spec"]["ports"]}
    assert (service["http3"]["protocol"], service["http3"]["targetPort"]) == ("UDP", 4433)
    assert (service["http"]["protocol"], service["http"]["targetPort"]) == ("TCP", 8080)
    edge = containers(objects, "Deployment", "edgepath-edge")
    exposed = {p["targetPort"] for p in service.values()}
    for name, transport, protocol in (("http", "tcp", "TCP"), ("http3", "quic", "UDP")):
        container = edge[name]
        port, ops = container["ports"]
        assert arg(container, "--transport") == transport and port["protocol"] == protocol
        assert int(arg(container, "--port")) == port["containerPort"] == service[name]["targetPort"]
        # the ops listener: its own port, HTTP/1.1, in no Service; both edges' probes go there (a kubelet speaks
        # no HTTP/3), never to the clients' port
        assert arg(container, "--ops-listen") == f"0.0.0.0:{ops['containerPort']}" and ops["protocol"] == "TCP"
        assert ops["containerPort"] not in exposed
        assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": ops["name"]}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": ops["name"]}
        assert container["startupProbe"]["httpGet"] == {"path": "/health/live", "port": ops["name"]}
    annotations = objects["Deployment", "edgepath-edge"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == edge["http"]["ports"][1]["containerPort"]  # scraped there


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
            claims = {claim_at(objects, kind, workload, directory) for kind, workload in WORKLOADS}
            (claim,) = claims  # one directory of the node, shared by the edges, the slot servers and the ledger
            volume = objects["PersistentVolume", objects["PersistentVolumeClaim", claim]["spec"]["volumeName"]]
            assert volume["spec"]["hostPath"] == {"path": directory, "type": "Directory"}
    if name == "gpu-rdma":
        limits = server["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1" and any(k.startswith("rdma/") for k in limits)


def claim_at(objects: dict, kind: str, workload: str, directory: str) -> str:
    """The claim that the first container of ``workload``'s pods has mounted at ``directory``."""
    spec = pod_spec(objects, kind, workload)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == directory]
    return str(volumes[mount["name"]]["persistentVolumeClaim"]["claimName"])


def test_every_command_line_is_one_edgepath_parses_and_every_variable_is_defined(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    parser = build_parser()
    commands = {a.dest: a for a in parser._actions if a.dest == "command"}
    subparsers = next(iter(commands.values())).choices  # type: ignore[attr-defined]
    config = {key for (kind, _), doc in objects.items() if kind == "ConfigMap" for key in doc.get("data", {})}
    for kind, workload in WORKLOADS:
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


def test_the_edges_read_keys_and_tenants_from_secrets_and_count_quotas_in_the_one_ledger(
    overlay: tuple[str, dict],
) -> None:
    """Both edges of every pod read the API keys and the tenants as files of Secrets (never variables), and give as
    their --quota-home where the ledger StatefulSet's one pod listens, over the same transport, waiting for it at
    start; the ledger keeps its words in a file on its own volume."""
    name, objects = overlay
    spec = pod_spec(objects, "Deployment", "edgepath-edge")
    edges = containers(objects, "Deployment", "edgepath-edge")
    for flag, secret in (("--tenants-file", "edgepath-tenants"), ("--api-keys-file", "edgepath-api-keys")):
        (path,) = {arg(edge, flag) for edge in edges.values()}  # the same file in both edges
        assert {mounted_at(spec, edge, path)["secret"]["secretName"] for edge in edges.values()} == {secret}
    assert not [e for edge in edges.values() for e in edge.get("env", ()) if "secretKeyRef" in e.get("valueFrom", {})]
    ledger_set = objects["StatefulSet", "edgepath-ledger"]
    assert ledger_set["spec"]["replicas"] == 1  # two would be two ledgers, each counting a part
    (keeper,) = containers(objects, "StatefulSet", "edgepath-ledger").values()
    listen = arg(keeper, "--listen")
    (home,) = {arg(edge, "--quota-home") for edge in edges.values()}
    assert all(float(arg(edge, "--quota-wait")) >= 60 for edge in edges.values())
    if name == "gpu-rdma":
        (port,) = objects["Service", "edgepath-ledger"]["spec"]["ports"]
        assert ledger_set["spec"]["serviceName"] == "edgepath-ledger"
        assert home == f"edgepath-ledger-0.edgepath-ledger.$(POD_NAMESPACE).svc.cluster.local:{port['port']}"
        assert listen == f"$(POD_IP):{port['port']}" and arg(keeper, "--data-path") == "verbs"
        assert all(arg(edge, "--data-path") == "verbs" for edge in edges.values())
    else:
        assert home == listen and not listen.endswith(".sock")  # the edges follow *.sock there as slot servers
        directory = str(Path(listen).parent)
        assert claim_at(objects, "StatefulSet", "edgepath-ledger", directory) == claim_at(
            objects, "Deployment", "edgepath-edge", directory
        )
    state = arg(keeper, "--state")
    (template,) = ledger_set["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in keeper["volumeMounts"] if m["mountPath"] == str(Path(state).parent)]
    assert mount["name"] == template["metadata"]["name"]  # its words on a volume of its own
    for kind in ("livenessProbe", "readinessProbe"):  # probed where it listens, as an edge connects
        command = keeper[kind]["exec"]["command"]
        line = command[2] if command[:2] == ["sh", "-c"] else shlex.join(command)
        argv = shlex.split(line.removeprefix("exec "))
        assert argv[:3] == ["edgepath", "probe", "--ledger"]
        assert argv[-1] == listen.replace("$(POD_IP)", "$POD_IP")


def test_every_edge_slot_server_and_ledger_finds_the_peer_secret_in_a_secret(overlay: tuple[str, dict]) -> None:
    """Slot servers and the ledger admit only peers that prove they hold the peer secret, and every container (and
    its probes) finds it where it is told: a file of a mounted Secret, the user's to create -- no overlay ships it."""
    _, objects = overlay
    for kind, workload in WORKLOADS:
        spec = pod_spec(objects, kind, workload)
        for container in containers(objects, kind, workload).values():
            env = {var["name"]: var.get("value") for var in container.get("env", ())}
            path = env["EDGEPATH_PEER_SECRET_FILE"]
            assert mounted_at(spec, container, path)["secret"]["secretName"] == "edgepath-peer-secret", workload
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(path).parent))
            assert mount["readOnly"] is True


def test_the_secrets_the_lane_makes_are_keys_and_tenants_edgepath_reads(tmp_path: Path) -> None:
    """tests/containers/make_secrets.py: fresh keys at test time, each a tenant edgepath's own loader finds."""
    keys = make_secrets(tmp_path)
    docs = {d["metadata"]["name"]: secret_data(d) for d in yaml.safe_load_all((tmp_path / "secrets.yaml").read_text())}
    (tmp_path / "keys").write_text(docs["edgepath-api-keys"]["keys"])
    (tmp_path / "tenants.toml").write_text(docs["edgepath-tenants"]["tenants.toml"])
    loaded = load_keys(str(tmp_path / "keys"), environ={}, tenants_file=str(tmp_path / "tenants.toml"))
    assert loaded is not None
    for key, tenant in ((keys["KEY_A"], "team-a"), (keys["KEY_B"], "team-b")):
        named = loaded.identify(key.encode())
        assert named is not None and named.name == tenant and named.tokens_per_minute > 0
    assert loaded.identify(keys["KEY"].encode()) is not None  # the flat key, a tenant of its own
    assert len(docs["edgepath-peer-secret"]["secret"]) >= 32  # the peer secret the pods prove they hold
    assert keys != make_secrets(tmp_path)  # fresh every time
    assert oct((tmp_path / "keys.env").stat().st_mode & 0o777) == "0o600"


def test_the_edges_carry_the_engine_type_an_inference_pool_reads_their_metrics_by(overlay: tuple[str, dict]) -> None:
    _, objects = overlay
    labels = objects["Deployment", "edgepath-edge"]["spec"]["template"]["metadata"]["labels"]
    # /metrics carries vLLM's names (edge/metrics.py): the Gateway API Inference Extension's label and llm-d's
    assert labels["inference.networking.k8s.io/engine-type"] == "vllm"
    assert labels["llm-d.ai/engine-type"] == "vllm"


def test_the_podman_overlay_publishes_the_edge_on_the_hosts_loopback_address() -> None:
    edge = containers(render("podman"), "Deployment", "edgepath-edge")
    ports = {
        (p["containerPort"], p["protocol"]): (p["hostIP"], p["hostPort"])
        for c in edge.values()
        for p in c["ports"]
        if "hostPort" in p
    }
    assert ports == {
        (8080, "TCP"): ("127.0.0.1", 18080),
        (4433, "UDP"): ("127.0.0.1", 14433),
        (9090, "TCP"): ("127.0.0.1", 19090),  # the HTTP/1.1 edge's ops listener: /health and /metrics for the lane
    }


def test_podman_gets_the_pods_the_controllers_would_make_with_their_command_lines_expanded(tmp_path: Path) -> None:
    make_secrets(tmp_path)
    objects = render("podman")
    docs = [*objects.values(), *yaml.safe_load_all((tmp_path / "secrets.yaml").read_text())]
    objects |= {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pods = {d["metadata"]["name"]: d for d in to_podman(docs) if d["kind"] == "Pod"}
    # two edges, two slot servers, the ledger
    assert set(pods) == {
        "edgepath-edge-0",
        "edgepath-edge-1",
        "edgepath-slots-0",
        "edgepath-slots-1",
        "edgepath-ledger-0",
    }
    published = {
        n: [p.get("hostPort") for c in pod["spec"]["containers"] for p in c.get("ports", ())] for n, pod in pods.items()
    }
    assert published["edgepath-edge-0"] == [18080, 19090, 14433]  # a host port is one pod's
    assert published["edgepath-edge-1"] == []  # reached at its pod address
    for pod in pods.values():  # a probe's named port by its number, as a kubelet resolves it (the port may be gone)
        for container in pod["spec"]["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if "httpGet" in container.get(kind, {}):
                    assert container[kind]["httpGet"]["port"] in (9090, 9091), (pod["metadata"]["name"], kind)
    kinds = {d["kind"] for d in to_podman(docs)}
    assert kinds == {"ConfigMap", "Pod"}  # what podman kube play runs; Services, budgets, Secrets, volumes left out
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
        if pod["spec"].get("initContainers"):
            assert pod["metadata"]["annotations"][INIT_TYPE] == "always"
        for volume in pod["spec"]["volumes"]:
            assert "secret" not in volume  # podman 4.3 reads those from podman secrets (and crashes on a missing one)
            assert "persistentVolumeClaim" not in volume  # bound to its PersistentVolume's directory, as a kubelet
    host = {v["name"]: v["hostPath"]["path"] for p in pods.values() for v in p["spec"]["volumes"] if "hostPath" in v}
    assert host == {
        "sockets": "/run/edgepath/slots",
        "models": "/var/lib/edgepath/models",
        "state": "/var/lib/edgepath/ledger",  # the ledger's claim state-edgepath-ledger-0, made from its template
    }
    # the tenants Secret mounted as a ConfigMap of the same name and data
    edge = pods["edgepath-edge-0"]["spec"]
    (tenants,) = [v["configMap"]["name"] for v in edge["volumes"] if v["name"] == "tenants"]
    made = next(d for d in to_podman(docs) if d["metadata"]["name"] == tenants)
    assert made["kind"] == "ConfigMap" and made["data"] == secret_data(objects["Secret", tenants])


def test_variables_expand_as_a_kubelet_expands_them() -> None:
    # defined: replaced; $$: a literal $ (so $$(A) stays as written); undefined: left as it is
    assert expand("$(A)-$$(A)-$(B)-$$", {"A": "x"}) == "x-$(A)-$(B)-$"


def test_what_podman_cannot_be_given_is_refused_naming_it() -> None:
    objects = render("gpu-rdma")
    config = [doc for (kind, _), doc in objects.items() if kind == "ConfigMap"]
    with pytest.raises(ValueError, match=r"POD_IP.*status\.podIP"):  # rdma_cm listens on $(POD_IP): none before
        to_podman([*config, objects["StatefulSet", "edgepath-slots"]])
    one_node = render("one-node")
    without = [doc for (kind, _), doc in one_node.items() if kind != "PersistentVolume"]
    with pytest.raises(
        ValueError, match="volume sockets: no PersistentVolume among the manifests is bound to claim edgepath-sockets"
    ):
        to_podman(without)  # podman provisions no volume
    with pytest.raises(ValueError, match="volume tenants: no Secret edgepath-tenants among the manifests"):
        to_podman(list(one_node.values()))  # the Secrets are the user's to create (the lane makes them)


def test_every_check_a_manifest_skips_names_its_reason(overlay: tuple[str, dict]) -> None:
    """scripts/check-manifests fails on every checkov check that fails; one a manifest fails on purpose is skipped
    by an annotation beside it, which must say why (checkov takes ``CHECK=reason``, the reason optional)."""
    _, objects = overlay
    skips = {
        (kind, name, value)
        for (kind, name), doc in objects.items()
        for key, value in doc["metadata"].get("annotations", {}).items()
        if key.startswith("checkov.io/skip")
    }
    assert skips  # the image checks, at least (no registry: docs/DEPLOY.md, "Hardening")
    for kind, name, value in skips:
        check, _, reason = value.partition("=")
        assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason.split()) >= 4, (kind, name, value)
