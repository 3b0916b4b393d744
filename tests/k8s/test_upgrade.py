"""An operator upgrade with a new default server image restarts no model server until its own spec
changes: the image the default gave is recorded on the CBDeployment (status.defaultImage)."""

from __future__ import annotations

import json

import pytest

from .conftest import Cluster, operator_running, wait_for
from .test_operator import EXAMPLE, apply, cbd, reconciled

OLD, NEW = "registry.example.com/cbserve:0.1.0", "registry.example.com/cbserve:0.2.0"


def _deployment(c: Cluster, ns: str) -> dict:
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    assert dep is not None
    return dep


def _image(dep: dict) -> str:
    return dep["spec"]["template"]["spec"]["containers"][0]["image"]


def test_an_operator_with_a_new_default_image_restarts_nothing_until_the_spec_changes(
        crd_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    c, ns = crd_cluster, "upgrade"
    monkeypatch.setenv("CBSERVE_SERVER_IMAGE", OLD)
    with operator_running(c):
        apply(c, ns, EXAMPLE)  # no spec.image: the operator's default
        first = reconciled(c, ns)
        assert _image(_deployment(c, ns)) == OLD
        assert first["status"]["defaultImage"]["image"] == OLD

    before = _deployment(c, ns)
    monkeypatch.setenv("CBSERVE_SERVER_IMAGE", NEW)  # the upgraded operator's default
    mark = c.server.mark()
    with operator_running(c):
        # resume re-applies every child; the Deployment's pod template stays as it was
        wait_for(lambda: c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/services/smollm2\b"),
                 what="the resumed reconcile")  # fmt: skip
        after = _deployment(c, ns)
        assert _image(after) == OLD
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"]["template"] == before["spec"]["template"]

        # an autoscaler's replicas (the scale subresource bumps the generation) change no image either
        c.kubectl("scale", "cbd", "smollm2", "-n", ns, "--replicas=2")
        wait_for(lambda: _deployment(c, ns)["spec"]["replicas"] == 2, what="2 replicas")
        reconciled(c, ns)
        assert _image(_deployment(c, ns)) == OLD
        assert cbd(c, ns)["status"]["defaultImage"]["image"] == OLD

        # the spec's own change takes the default of today
        c.kubectl("patch", "cbd", "smollm2", "-n", ns, "--type", "merge", "-p",
                  json.dumps({"spec": {"engine": {"blockSize": 512}}}))
        wait_for(lambda: _image(_deployment(c, ns)) == NEW, what="the new default image")
        assert reconciled(c, ns)["status"]["defaultImage"]["image"] == NEW

        # an image the spec names is the spec's, and nothing is recorded
        c.kubectl("patch", "cbd", "smollm2", "-n", ns, "--type", "merge", "-p",
                  json.dumps({"spec": {"image": "registry.example.com/mine:1"}}))
        wait_for(lambda: _image(_deployment(c, ns)) == "registry.example.com/mine:1", what="the spec's image")
        assert "defaultImage" not in reconciled(c, ns)["status"]


def test_an_operator_that_renders_differently_restarts_nothing_until_the_spec_changes(
        crd_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The Deployment records the pod template it was applied with, and the spec revision it was for
    (annotations on the Deployment, not its pods). An upgraded operator whose rendering differs (here:
    one more env variable) keeps it until the spec changes, repairs drift back to it, and a change of
    replicas alone keeps it too."""
    from cbserve_operator import workload

    c, ns = crd_cluster, "upgrade-render"
    with operator_running(c):
        apply(c, ns, EXAMPLE)
        reconciled(c, ns)
    before = _deployment(c, ns)["spec"]["template"]

    rendered = workload.server_env
    monkeypatch.setattr(workload, "server_env", lambda spec, api_key=True: [
        *rendered(spec, api_key), {"name": "CBSERVE_NEW_SETTING", "value": "1"}])  # the next release's rendering

    def env() -> set[str]:
        return {e["name"] for e in _deployment(c, ns)["spec"]["template"]["spec"]["containers"][0]["env"]}

    mark = c.server.mark()
    with operator_running(c):
        wait_for(lambda: c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/services/smollm2\b"),
                 what="the resumed reconcile")  # fmt: skip
        assert _deployment(c, ns)["spec"]["template"] == before

        c.kubectl("set", "env", "deployment/smollm2", "-n", ns, "FOO=bar")  # drift: back to the kept template
        wait_for(lambda: _deployment(c, ns)["spec"]["template"] == before, what="the kept template restored")

        c.kubectl("scale", "cbd", "smollm2", "-n", ns, "--replicas=2")
        wait_for(lambda: _deployment(c, ns)["spec"]["replicas"] == 2, what="2 replicas")
        reconciled(c, ns)
        assert _deployment(c, ns)["spec"]["template"] == before

        c.kubectl("patch", "cbd", "smollm2", "-n", ns, "--type", "merge", "-p",
                  json.dumps({"spec": {"engine": {"blockSize": 512}}}))
        wait_for(lambda: "CBSERVE_NEW_SETTING" in env(), what="the new rendering, at the spec's change")
        assert "FOO" not in env()
