#!/usr/bin/env python
"""The wheels scripts/gpu_check.sh needs beyond the GPU machine's image, made here and installed there.

    python scripts/gpu_bundle.py build --dest gpu-bundle            # here, with PyPI (`make gpu-bundle`)
    python scripts/gpu_bundle.py install gpu-bundle /tmp/site        # there, offline (gpu_check.sh does it)

The image has Python 3.12, torch, transformers (and what they require), numpy, safetensors,
prometheus-client, httpx, ninja, triton and uvloop. What cbserve's engine, `cbserve serve` and the
checks import at module level beyond that is `PACKAGES`, at the versions pyproject.toml allows; `build`
downloads them and everything they require as CPython 3.12 manylinux x86_64 wheels (binary only, so
nothing is compiled there). `install` puts into a target folder, with `pip install --no-deps
--no-index` (or unzipped, when that Python has no pip), only the wheels whose distribution the running
Python does not already have: the image's own packages (pyyaml, click, anyio...) are never shadowed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# imported at module level by engine/, engine/server/ and `cbserve serve` (psutil, xxhash, starlette,
# uvicorn), or required by transformers and so in the image but listed in case it is not (pyyaml, tqdm)
PACKAGES = ("psutil", "xxhash", "starlette", "uvicorn", "pyyaml", "tqdm")
PLATFORM = "manylinux2014_x86_64"
LIMIT_BYTES = 16 << 20  # the whole working tree travels in 64 MiB


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`PACKAGES` as pyproject.toml's dependencies spell them (with their version ranges)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    by_name = {normalize(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]): d for d in deps}
    missing = [p for p in PACKAGES if normalize(p) not in by_name]
    if missing:
        raise SystemExit(f"pyproject.toml does not list {', '.join(missing)}")
    return [by_name[normalize(p)] for p in PACKAGES]


def wheel_name(path: Path) -> str:
    """The distribution a wheel file installs (its name's first field)."""
    return normalize(path.name.split("-", 1)[0])


def build(dest: Path, python_version: str) -> list[Path]:
    """Download the bundle's wheels into `dest` (emptied first)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "--platform", PLATFORM,
           "--dest", str(dest), *requirements()]  # fmt: skip
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if size > LIMIT_BYTES:
        raise SystemExit(f"the bundle is {size / (1 << 20):.1f} MiB, over {LIMIT_BYTES >> 20} MiB")
    (dest / "README.txt").write_text(
        f"Made by `python scripts/gpu_bundle.py build` for CPython {python_version} on {PLATFORM}: "
        f"{', '.join(PACKAGES)} and what they require. Installed by scripts/gpu_check.sh.\n"
    )
    print(f"{len(wheels)} wheels, {size / (1 << 20):.1f} MiB in {dest}: {', '.join(w.name for w in wheels)}")
    return wheels


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install(bundle: Path, target: Path) -> list[str]:
    """Install into `target` the bundle's wheels this Python lacks: offline, without resolving anything."""
    wheels = sorted(bundle.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {bundle}: run `make gpu-bundle` on the development machine and carry "
                         f"{bundle.name}/ with the working tree")  # fmt: skip
    needed = [w for w in wheels if not installed(wheel_name(w))]
    target.mkdir(parents=True, exist_ok=True)
    if needed:
        if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-index", "--target", str(target), *map(str, needed)], check=True)  # fmt: skip
        else:  # no pip in this Python: a wheel is a zip of the files a target folder holds
            for wheel in needed:
                unpack(wheel, target)
    names = [wheel_name(w) for w in needed]
    present = [wheel_name(w) for w in wheels if w not in needed]
    print(f"installed into {target}: {', '.join(names) or 'nothing'}; already here: {', '.join(present) or 'none'}")
    return names


def unpack(wheel: Path, target: Path) -> None:
    """A wheel's files into `target`, its `.data/purelib` and `.data/platlib` folded into the root."""
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            parts = member.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers: not needed on the path
                parts = parts[2:]
            out = target.joinpath(*parts)
            if member.endswith("/"):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(member))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bundle.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels (needs PyPI)")
    b.add_argument("--dest", type=Path, default=ROOT / "gpu-bundle")
    b.add_argument("--python-version", default="3.12", help="the CPython the wheels are for (the image's: 3.12)")
    i = sub.add_parser("install", help="install the wheels this Python lacks into a folder, offline")
    i.add_argument("bundle", type=Path)
    i.add_argument("target", type=Path)
    args = p.parse_args(argv)
    if args.command == "build":
        build(args.dest, args.python_version)
    else:
        install(args.bundle, args.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
