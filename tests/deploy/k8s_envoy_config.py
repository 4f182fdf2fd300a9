"""The Envoy config of the Kubernetes envoy-picker component, generated from the ONE template
(deploy/envoy/picker/envoy.yaml): `python -m tests.deploy.k8s_envoy_config` rewrites the component's
ConfigMap and the config's hash in its Deployment after the template changed; the tests fail until
it is run (tests/deploy/test_k8s_envoy_picker.py).

Rule 1: the ConfigMap holds the template with every `${NAME}` placeholder filled from VALUES, by
        name; a placeholder without a value (one a later change added to the template) is an error
        naming it, never an empty string.
Rule 2: the Deployment's pod template carries the SHA-256 of that text (CONFIG_HASH_ANNOTATION), so
        a changed config rolls the pods (Envoy reads its bootstrap file once, at start).
Why a generated copy: `kubectl apply -k` refuses files outside the kustomization's folder, so a
configMapGenerator cannot read the template from deploy/envoy/picker.
"""

from __future__ import annotations

import hashlib
import re
import string
import sys
from typing import Final

from tests.deploy.processes import REPO

__all__ = [
    "COMPONENT",
    "CONFIG_HASH_ANNOTATION",
    "CONFIG_MAP",
    "DEPLOYMENT",
    "TEMPLATE",
    "VALUES",
    "config_hash",
    "config_map_text",
    "main",
    "placeholders",
    "rendered_config",
]

TEMPLATE: Final = REPO / "deploy" / "envoy" / "picker" / "envoy.yaml"
COMPONENT: Final = REPO / "deploy" / "k8s" / "components" / "envoy-picker"
CONFIG_MAP: Final = COMPONENT / "envoy-config.yaml"
DEPLOYMENT: Final = COMPONENT / "envoy-picker.yaml"
CONFIG_HASH_ANNOTATION: Final = "ppd-router/envoy-config-sha256"

#: The component's value of each placeholder: Envoy's client port (the container's `http` port),
#: its admin port (127.0.0.1 inside the pod: the probes and preStop hook use it), the picker
#: sidecar's gRPC port (`ppd-gateway picker --grpc-port`), fail closed, and the workers: every
#: overlay's headless Services `vllm-decode` (port 8200, priority 0) and `vllm-prefill` (8100,
#: priority 1), which Envoy resolves to every pod's IP (STRICT_DNS), the IPs the picker names them by.
#: The tests check each against the manifests.
VALUES: Final = {
    "LISTEN_PORT": "8080",
    "ADMIN_PORT": "9901",
    "PICKER_PORT": "9002",
    "FAILURE_MODE_ALLOW": "false",
    "WORKER_ENDPOINTS": (
        "[{priority: 0, lb_endpoints: [{endpoint: {address: {socket_address: "
        "{address: vllm-decode, port_value: 8200}}}}]}, "
        "{priority: 1, lb_endpoints: [{endpoint: {address: {socket_address: "
        "{address: vllm-prefill, port_value: 8100}}}}]}]"
    ),
}

_HEADER: Final = """\
# GENERATED from deploy/envoy/picker/envoy.yaml (the one template; its comments explain every
# setting) with LISTEN_PORT={LISTEN_PORT}, ADMIN_PORT={ADMIN_PORT}, PICKER_PORT={PICKER_PORT},
# FAILURE_MODE_ALLOW={FAILURE_MODE_ALLOW} and WORKER_ENDPOINTS the Services vllm-decode and vllm-prefill.
# Do not edit: run `python -m tests.deploy.k8s_envoy_config` after changing the template (the
# tests fail until this copy equals the rendered template).
apiVersion: v1
kind: ConfigMap
metadata:
  name: ppd-envoy-picker
  labels:
    app.kubernetes.io/name: ppd-envoy
    app.kubernetes.io/component: envoy-picker
    app.kubernetes.io/part-of: ppd-router
data:
  envoy.yaml: |
"""


def placeholders(template: str) -> set[str]:
    """Every `${NAME}` (and `$NAME`) the template uses."""
    found = set()
    for match in string.Template.pattern.finditer(template):
        name = match.group("named") or match.group("braced")
        if name:
            found.add(name)
    return found


def rendered_config(template: str | None = None) -> str:
    """Rule 1: the template with every placeholder filled from VALUES."""
    text = TEMPLATE.read_text(encoding="utf-8") if template is None else template
    missing = placeholders(text) - set(VALUES)
    if missing:
        raise KeyError(
            f"{TEMPLATE.relative_to(REPO)} has placeholder(s) {sorted(missing)} without a Kubernetes value: "
            "add them to VALUES in tests/deploy/k8s_envoy_config.py (and to the manifests)"
        )
    return string.Template(text).substitute(VALUES)


def config_map_text(config: str) -> str:
    body = "".join(f"    {line}\n" if line else "\n" for line in config.splitlines())
    return _HEADER.format(**VALUES) + body


def config_hash(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()


def main() -> int:
    config = rendered_config()
    CONFIG_MAP.write_text(config_map_text(config), encoding="utf-8")
    deployment = DEPLOYMENT.read_text(encoding="utf-8")
    pattern = re.compile(rf"^(\s*{re.escape(CONFIG_HASH_ANNOTATION)}: )\"?[0-9a-f]*\"?$", re.MULTILINE)
    updated, count = pattern.subn(rf'\g<1>"{config_hash(config)}"', deployment)
    if count != 1:
        print(
            f"{DEPLOYMENT}: expected one {CONFIG_HASH_ANNOTATION} annotation, found {count}", file=sys.stderr
        )
        return 1
    DEPLOYMENT.write_text(updated, encoding="utf-8")
    print(f"wrote {CONFIG_MAP.relative_to(REPO)} and the hash in {DEPLOYMENT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
