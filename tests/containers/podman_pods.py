"""What a Kubernetes control plane does before a kubelet runs a pod, for ``podman kube play`` (podman 4.3), which
runs Pods and Deployments but has no controllers and no ``$(VAR)`` expansion:

* a StatefulSet becomes its pods, ``NAME-0`` .. ``NAME-(replicas-1)`` (the names a StatefulSet gives them, which
  the one-node overlay's slot servers use for their socket paths), a Deployment its pods ``NAME-0`` ..; a host port
  can be published by one pod only, so a Deployment's pods after the first publish none (there is no Service in
  front of them: the host reaches them at their pod addresses); a port without a host port is left out (podman 4.3
  publishes it on the host at its own number -- the second pod with it fails, "address already in use" -- and the
  pod's address reaches it without), so a probe that names a port is given its number, as a kubelet resolves it;
* every ``env`` value becomes a literal: a Secret's or ConfigMap's key, the pod's name or namespace (podman 4.3
  reads ``secretKeyRef`` from a podman secret of its own format instead, and knows no ``metadata.namespace``);
  one known only once the pod runs (``status.podIP``) is an error;
* ``$(VAR)`` in ``command`` and ``args`` is expanded as the kubelet does (Kubernetes' "dependent environment
  variables": the container's ``env`` and the ConfigMaps of its ``envFrom``, ``metadata.name`` and
  ``metadata.namespace`` field references; ``$$`` is a literal ``$``; an undefined one stays as written);
* a Secret mounted as a volume becomes a ConfigMap of the same name and data, mounted as one (podman 4.3 reads a
  ``secret`` volume from a podman secret of its own, and crashes on one it does not find);
* a PersistentVolumeClaim mounted (a pod's own, or one a StatefulSet's ``volumeClaimTemplates`` make for it,
  ``TEMPLATE-NAME-ORDINAL``) becomes the ``hostPath`` of the PersistentVolume bound to it (its ``volumeName``, or a
  PersistentVolume whose ``claimRef`` names it), as the control plane binds it and the kubelet mounts it (podman
  would make a named volume of its own for the claim instead); a claim no PersistentVolume among the manifests is
  bound to is an error (podman has no provisioner);
* init containers are of podman's kind "always" (see ``INIT_TYPE``);
* what podman does not run (Namespace, Service, PodDisruptionBudget, Secret, NetworkPolicy, PersistentVolume and
  PersistentVolumeClaim) is left out; ConfigMaps stay (podman reads ``envFrom`` and ``configMap`` volumes from them).

    python tests/containers/podman_pods.py < rendered.yaml > pods.yaml
"""

from __future__ import annotations

import base64
import copy
import re
import sys
from typing import Any

import yaml

CONTROLLERS = ("StatefulSet", "Deployment")
#: podman's init-container kind: "always" runs them at every start of the pod, as a kubelet does; podman 4.3's
#: default, "once", fails kube play when it removes one that has just run ("container state improper")
INIT_TYPE = "io.podman.annotations.init.container.type"
_VARIABLE = re.compile(r"\$\$|\$\((\w+)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """``text`` with each ``$(VAR)`` defined in ``env`` replaced, ``$$`` made ``$`` (the kubelet's rule)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VARIABLE.sub(one, text)


def resolve_env(
    container: dict[str, Any],
    fields: dict[str, str],
    config_maps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
) -> dict[str, str]:
    """Make every ``env`` entry of ``container`` a literal value as the kubelet hands it over -- a Secret's or
    ConfigMap's key, a field reference of ``fields`` (podman 4.3 knows no ``metadata.namespace``), ``$(VAR)``s of
    the entries before it expanded -- and return the variables its command line may name: its ``envFrom``
    ConfigMaps' keys, then its ``env`` in order."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", ()):
        ref = source.get("configMapRef")
        if ref is not None:
            env.update(config_maps.get(ref["name"], {}))
    for var in container.get("env", ()):
        source = var.pop("valueFrom", None)
        if source is None:
            value = expand(str(var.get("value", "")), env)
        elif "secretKeyRef" in source:
            value = _key(secrets, "Secret", source["secretKeyRef"], var["name"])
        elif "configMapKeyRef" in source:
            value = _key(config_maps, "ConfigMap", source["configMapKeyRef"], var["name"])
        elif source.get("fieldRef", {}).get("fieldPath") in fields:
            value = fields[source["fieldRef"]["fieldPath"]]
        else:
            raise ValueError(f"env {var['name']}: {source} is not known before the pod runs (podman cannot give it)")
        var["value"] = env[var["name"]] = value
    return env


def _key(objects: dict[str, dict[str, str]], kind: str, ref: dict[str, str], var: str) -> str:
    """The value of key ``ref["key"]`` of the ``kind`` named ``ref["name"]`` among the manifests."""
    try:
        return objects[ref["name"]][ref["key"]]
    except KeyError:
        raise ValueError(f"env {var}: no {kind} {ref['name']} with key {ref['key']} among the manifests") from None


def pods_of(
    controller: dict[str, Any],
    config_maps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    bound: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The pods a StatefulSet or Deployment would make, their command lines expanded; ``bound``: each claim's
    PersistentVolume (:func:`bindings`)."""
    name = controller["metadata"]["name"]
    namespace = controller["metadata"].get("namespace", "default")
    template = controller["spec"]["template"]
    pods = []
    for ordinal in range(int(controller["spec"].get("replicas", 1))):
        pod_name = f"{name}-{ordinal}"
        spec = copy.deepcopy(template["spec"])
        spec.setdefault("restartPolicy", "Always")
        for container in spec["containers"]:
            named = {p["name"]: p["containerPort"] for p in container.get("ports", ()) if "name" in p}
            for probe in (container.get(kind) for kind in ("startupProbe", "livenessProbe", "readinessProbe")):
                http = (probe or {}).get("httpGet")
                if http is not None and isinstance(http.get("port"), str):  # by its number, as a kubelet resolves it
                    http["port"] = named[http["port"]]
            published = [p for p in container.get("ports", ()) if "hostPort" in p]
            if ordinal and controller["kind"] == "Deployment":
                published = []
            if "ports" in container:
                container["ports"] = published
        spec.setdefault("hostname", pod_name)
        for container in (*spec.get("initContainers", ()), *spec["containers"]):
            fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
            env = resolve_env(container, fields, config_maps, secrets)
            for key in ("command", "args"):
                if key in container:
                    container[key] = [expand(str(part), env) for part in container[key]]
        for template_claim in controller["spec"].get("volumeClaimTemplates", ()):
            claim = template_claim["metadata"]["name"]
            spec.setdefault("volumes", []).append(
                {"name": claim, "persistentVolumeClaim": {"claimName": f"{claim}-{pod_name}"}}
            )
        for volume in spec.get("volumes", ()):
            if "persistentVolumeClaim" in volume:
                claim = volume.pop("persistentVolumeClaim")["claimName"]
                if claim not in (bound or {}):
                    raise ValueError(
                        f"volume {volume['name']}: no PersistentVolume among the manifests is bound to claim {claim} "
                        "(podman provisions none)"
                    )
                volume["hostPath"] = copy.deepcopy((bound or {})[claim]["spec"]["hostPath"])
            if "secret" in volume:
                source = volume.pop("secret")
                secret = source.pop("secretName")
                if secret not in secrets:
                    raise ValueError(f"volume {volume['name']}: no Secret {secret} among the manifests")
                volume["configMap"] = {"name": secret, **source}  # items, defaultMode, optional: the same fields
        metadata = {**copy.deepcopy(template.get("metadata", {})), "name": pod_name, "namespace": namespace}
        if spec.get("initContainers"):
            metadata.setdefault("annotations", {})[INIT_TYPE] = "always"
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    return pods


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A Secret's keys and values: ``data`` base64-decoded, ``stringData`` as is."""
    values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return {**values, **secret.get("stringData", {})}


def bindings(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each claim's hostPath PersistentVolume among ``docs``: the one a PersistentVolumeClaim names (``volumeName``),
    or the one whose ``claimRef`` names the claim (how a StatefulSet's claims are bound to volumes made for them)."""
    volumes = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolume" and "hostPath" in d["spec"]}
    bound = {v["spec"]["claimRef"]["name"]: v for v in volumes.values() if "claimRef" in v["spec"]}
    for claim in (d for d in docs if d["kind"] == "PersistentVolumeClaim"):
        name = claim["spec"].get("volumeName")
        if name in volumes:
            bound[claim["metadata"]["name"]] = volumes[name]
    return bound


def to_podman(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ConfigMaps and pods of rendered manifests ``docs``, as podman kube play runs them."""
    config_maps = {d["metadata"]["name"]: dict(d.get("data", {})) for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: secret_data(d) for d in docs if d["kind"] == "Secret"}
    bound = bindings(docs)
    out = [d for d in docs if d["kind"] == "ConfigMap"]
    pods = [pod for doc in docs if doc["kind"] in CONTROLLERS for pod in pods_of(doc, config_maps, secrets, bound)]
    mounted = sorted({v["configMap"]["name"] for p in pods for v in p["spec"].get("volumes", ()) if "configMap" in v})
    for name in mounted:  # the Secrets mounted as volumes, as the ConfigMaps podman mounts instead
        if name in secrets and name not in config_maps:
            out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": secrets[name]})
    return out + pods


def main() -> None:
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    yaml.safe_dump_all(to_podman(docs), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
