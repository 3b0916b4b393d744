"""Models named `hf://org/name[@revision]`: downloaded once per revision into a model folder, then
loaded from there.

The folder is `<root>/<org>/<name>/<revision>` (the revision URL-quoted, `main` when none is given),
under `$CBSERVE_MODEL_DIR`, else `<cbserve cache>/models`. A download resolves the revision to its
commit first and fetches that commit's files (`huggingface_hub.snapshot_download`; `HF_TOKEN`,
`HF_ENDPOINT` as usual), then writes `.cbserve-download.json` last: a folder with it is complete and
is used without asking the Hub again; one without it (an interrupted download) is resumed. With
`HF_HUB_OFFLINE` set, only a complete folder is accepted. A branch or tag is thus fetched once per
folder and not refreshed: pin a commit id to know what is served.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from engine.cache import cache_dir

SCHEME = "hf://"
MODEL_DIR_ENV = "CBSERVE_MODEL_DIR"
MARKER = ".cbserve-download.json"
DEFAULT_REVISION = "main"
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_URI = re.compile(rf"^hf://(?P<repo>{_SEGMENT}/{_SEGMENT})(@(?P<revision>{_SEGMENT}(/{_SEGMENT})*))?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class DownloadError(RuntimeError):
    """The Hub refused or failed a download; the message names the model and the Hub's answer."""


@dataclass(frozen=True)
class HubModel:
    repo: str  # org/name
    revision: str | None  # a commit id, tag or branch; None: the default branch

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.repo}" + (f"@{self.revision}" if self.revision else "")

    def folder(self, root: Path) -> Path:
        org, name = self.repo.split("/")
        return root / org / name / quote(self.revision or DEFAULT_REVISION, safe="")


def is_hub_uri(name: str | None) -> bool:
    return bool(name) and name.startswith(SCHEME)  # type: ignore[union-attr]


def parse_hub_uri(uri: str) -> HubModel:
    """`hf://org/name` or `hf://org/name@revision`; ValueError says what is accepted."""
    m = _URI.match(uri)
    if not m:
        raise ValueError(f"{uri!r} is not hf://org/name or hf://org/name@revision (letters, digits, '.', '_', '-'; "
                         "a revision may have '/' between such parts)")
    return HubModel(m["repo"], m["revision"])


def model_root() -> Path:
    """Where hf:// models are kept: `$CBSERVE_MODEL_DIR`, else `<cbserve cache>/models`."""
    return Path(os.environ.get(MODEL_DIR_ENV) or cache_dir() / "models")


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def completed(folder: Path) -> dict | None:
    """The record of a complete download in `folder` (repo, revision, commit), else None."""
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def locate(model: HubModel, root: Path | None = None) -> Path:
    """The model's folder, downloading it first unless it is complete; FileNotFoundError when it is
    not complete and HF_HUB_OFFLINE forbids asking the Hub."""
    folder = model.folder(root or model_root())
    if completed(folder) is not None:
        return folder
    if offline():
        raise FileNotFoundError(f"{model.uri} is not in {folder} (no complete download there) and HF_HUB_OFFLINE "
                                "is set: download it first (cbserve download) or unset HF_HUB_OFFLINE")
    return download(model, root)


def download(model: HubModel, root: Path | None = None) -> Path:
    """Resolve the revision to a commit, fetch that commit's files into the model's folder, then mark
    it complete. Files already there from an interrupted run are not fetched again."""
    from huggingface_hub import HfApi, snapshot_download

    folder = model.folder(root or model_root())
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
    try:
        info = HfApi(endpoint=endpoint).model_info(model.repo, revision=model.revision or DEFAULT_REVISION)
        snapshot_download(model.repo, revision=info.sha, local_dir=folder, endpoint=endpoint)
    except Exception as exc:  # the Hub's refusals, network and disk errors: one line for the Job's status
        text = str(exc).strip()
        first_line = text.splitlines()[0] if text else ""
        raise DownloadError(f"downloading {model.uri} failed: {type(exc).__name__}: {first_line}") from exc
    record = {"uri": model.uri, "repo": model.repo, "revision": model.revision or DEFAULT_REVISION,
              "commit": info.sha}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)  # a repo with no files has no folder yet
    partial = folder / (MARKER + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, folder / MARKER)
    return folder
