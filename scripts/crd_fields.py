"""Print the CBDeployment field table of docs/kubernetes.md from the CRD itself.

    python scripts/crd_fields.py            # the Markdown table
    python scripts/crd_fields.py --check    # exit 1 if docs/kubernetes.md holds another one

One row per field of `spec` (objects are walked; lists and maps are one field): its type, default,
and every validation the API server applies to it (enum, bounds, pattern, length, the CEL rules
on it or on its parent naming it). tests/k8s/test_crd.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "charts" / "cbserve" / "crds" / "cbdeployments.cbserve.io.yaml"
DOCS = REPO / "docs" / "kubernetes.md"
BEGIN, END = "<!-- crd-fields:begin -->", "<!-- crd-fields:end -->"


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "object")
    if kind == "array":
        return f"list of {_type(node.get('items') or {})}"
    if kind == "object" and "additionalProperties" in node:
        return f"map of {_type(node['additionalProperties'])}"
    return str(kind)


def _checks(node: dict[str, Any]) -> list[str]:
    out = []
    if "enum" in node:
        out.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None:
        out.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {low}")
    if high is not None:
        out.append(f"{'<' if node.get('exclusiveMaximum') else '<='} {high}")
    if "pattern" in node:
        out.append(f"matches `{node['pattern']}`")
    for key, words in (("maxLength", "at most {} characters"), ("maxItems", "at most {} items")):
        if key in node:
            out.append(words.format(node[key]))
    for rule in node.get("x-kubernetes-validations") or []:
        out.append(rule.get("message") or f"`{rule['rule']}`")
    return out


def rows(schema: dict[str, Any], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, validations) for every field under `schema`'s properties."""
    out = []
    for name, node in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        walk = node.get("type") == "object" and node.get("properties") and "additionalProperties" not in node
        default = node.get("default")
        shown = "" if default is None or default == {} else f"`{json.dumps(default)}`"
        if walk:
            checks = _checks(node)
            if checks:  # rules on an object concern its fields together
                out.append((path, "object", shown, "; ".join(checks)))
            out += rows(node, f"{path}.")
        else:
            out.append((path, _type(node), shown, "; ".join(_checks(node))))
    return out


def table(schema: dict[str, Any] | None = None) -> str:
    """The Markdown table of `schema` (default: the CRD file's openAPIV3Schema)."""
    if schema is None:
        schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    lines = ["| field | type | default | validation (the API server refuses anything else) |", "|---|---|---|---|"]
    root = "; ".join(_checks(schema))
    if root:
        lines.append(f"| `metadata.name` | string | | {root} |")
    spec = schema["properties"]["spec"]
    if _checks(spec):  # rules over several sections of the spec
        lines.append(f"| `spec` | object | | {'; '.join(_checks(spec))} |")
    for path, kind, default, checks in rows(spec):
        lines.append(f"| `{path}` | {kind} | {default} | {checks.replace('|', '&#124;')} |")
    return "\n".join(lines)


def documented() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/kubernetes.md")
    args = parser.parse_args()
    if args.check:
        if documented() != table():
            print("docs/kubernetes.md's CRD field table differs from the CRD: run scripts/crd_fields.py", file=sys.stderr)
            return 1
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
