"""Hard-link an installed distribution, and what it requires, from one Python environment into another.

    python scripts/link_dist.py .venv/bin/python .gpu-image-venv/bin/python torch==2.13.0

`make gpu-image` uses it so that `.gpu-image-venv/` gets the torch `.venv/` already has (the same
wheel: both come from scripts/install_torch.py on this machine), with sympy, networkx and the rest of
what torch requires at the versions `.venv/` has, in a second or two instead of the half minute or
more that pip spends unpacking and byte-compiling them. Every file in each distribution's RECORD is
linked (copied where a link cannot be made) to the same place under the target's site-packages;
console scripts are copied with their first line naming the target's Python. A requirement the
source lacks, or the target has at any version, is left to pip, which the caller runs next. Exit
status 1, with nothing linked, when the source lacks that exact version of the distribution; the
caller then installs it the ordinary way.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# run by the source Python: the distribution and, recursively, what it requires (no extras), as
# "name<TAB>version<TAB>dist-info folder" lines; a requirement its environment lacks is left to pip
PROBE = """
import importlib.metadata as m, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # not installed yet (make runs this beside the pip install that brings it): pip's own copy
    from pip._vendor.packaging.requirements import Requirement
todo, seen = [sys.argv[1]], set()
while todo:
    try:
        d = m.distribution(todo.pop())
    except m.PackageNotFoundError:
        continue
    name = d.metadata["Name"].lower().replace("_", "-")
    if name in seen:
        continue
    seen.add(name)
    print(name, d.version, d._path, sep="\t")
    for r in map(Requirement, d.requires or []):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
"""


def installed(python: str, name: str) -> list[tuple[str, str, Path]]:
    """(name, version, dist-info folder) of `name` and what it requires, in `python`'s environment."""
    out = subprocess.run([str(Path(python).absolute()), "-c", PROBE, name], capture_output=True, text=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    if out.returncode != 0:
        return []
    return [(n, v, Path(p)) for n, v, p in (line.split("\t") for line in out.stdout.splitlines())]


def present(site: Path) -> set[str]:
    """The distributions already in `site` (any version), by normalised name."""
    return {normalize(d.name.split("-", 1)[0]) for d in site.glob("*.dist-info")}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def site_packages(python: str) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def link_tree(files: list[Path], src_site: Path, dst_site: Path, dst_python: str) -> None:
    for rel in files:
        src, dst = src_site / rel, Path(os.path.normpath(dst_site / rel))
        if not src.is_file():  # RECORD may name .pyc files that were never written
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        if rel.parts[0] == "..":  # outside site-packages: a console script, whose shebang names its Python
            text = src.read_bytes()
            first, _, rest = text.partition(b"\n")
            if first.startswith(b"#!") and b"python" in first:
                text = b"#!" + os.fsencode(dst_python) + b"\n" + rest
            dst.write_bytes(text)
            shutil.copymode(src, dst)
            continue
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="the Python whose environment has the distribution")
    p.add_argument("target", help="the Python whose environment gets it")
    p.add_argument("requirement", help="NAME==VERSION")
    args = p.parse_args(argv)
    name, _, version = args.requirement.partition("==")
    found = installed(args.source, name) if Path(args.source).exists() else []
    if not found or found[0][1].split("+")[0] != version:
        have = found[0][1] if found else "nothing"
        print(f"link_dist: {args.source} has {have} for {args.requirement}; not linking", file=sys.stderr)
        return 1
    dst_site, dst_python = site_packages(args.target), str(Path(args.target).absolute())
    there = present(dst_site)
    found = [f for f in found if normalize(f[0]) not in there]  # pip upgrades what the target has
    for _, _, dist_info in found:
        record = (dist_info / "RECORD").read_text().splitlines()
        files = [Path(line.rsplit(",", 2)[0]) for line in record if line.strip()]
        link_tree(files, dist_info.parent, dst_site, dst_python)
    print(f"link_dist: linked {', '.join(f'{n} {v}' for n, v, _ in found) or 'nothing'} from {args.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
