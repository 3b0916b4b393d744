"""hf:// models for real: `cbserve download` and the loader against a fake Hub (tests/hub/fake_hub.py)
that serves a tiny model saved by engine/testing.py, through huggingface_hub's own snapshot_download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import hub
from engine.loader import load_model
from engine.testing import save_test_model

from .fake_hub import FakeHub

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_test_model(tmp_path_factory.mktemp("source") / "tiny", "llama")


@pytest.fixture
def fake_hub(source: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        h.add("acme/tiny", source)
        yield h


def hub_env(fake_hub: FakeHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CBSERVE_MODEL_DIR", "TRANSFORMERS_"))}
    return {**env, "HF_ENDPOINT": fake_hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": TOKEN,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}  # fmt: skip


def cbserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.relative_to(folder).as_posix().startswith(".")}  # fmt: skip


def test_download_fetches_the_pinned_revision_once_and_the_loader_serves_it_offline(
        fake_hub: FakeHub, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    root, env = tmp_path / "models", hub_env(fake_hub, tmp_path)
    commit = fake_hub.repos["acme/tiny"].branches["main"]
    done = cbserve("download", f"hf://acme/tiny@{commit}", "--to", str(root), env=env)
    assert done.returncode == 0, done.stderr
    folder = root / "acme" / "tiny" / commit
    assert done.stdout.strip() == f"hf://acme/tiny@{commit} (commit {commit}) is in {folder}"
    assert files(folder) == files(source)  # every file, byte for byte
    assert json.loads((folder / hub.MARKER).read_text()) == {
        "uri": f"hf://acme/tiny@{commit}", "repo": "acme/tiny", "revision": commit, "commit": commit}
    assert fake_hub.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in fake_hub.requests)  # HF_TOKEN sent

    # A complete folder is not fetched again: no request reaches the Hub.
    seen = len(fake_hub.requests)
    again = cbserve("download", f"hf://acme/tiny@{commit}", "--to", str(root), env=env)
    assert again.returncode == 0, again.stderr
    assert len(fake_hub.requests) == seen

    # The loader takes the same name and finds the folder, with HF_HUB_OFFLINE set and no network.
    monkeypatch.setenv(hub.MODEL_DIR_ENV, str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    loaded = load_model(f"hf://acme/tiny@{commit}", dtype="float32")
    assert loaded.name == "acme/tiny" and len(fake_hub.requests) == seen
    want = load_model(str(source), dtype="float32").model.state_dict()
    got = loaded.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_loader_downloads_a_branch_resolved_to_its_commit(fake_hub: FakeHub, source: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    for key, value in hub_env(fake_hub, tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(hub.MODEL_DIR_ENV, str(tmp_path / "models"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    loaded = load_model("hf://acme/tiny@main", dtype="float32")
    folder = tmp_path / "models" / "acme" / "tiny" / "main"
    assert loaded.name == "acme/tiny" and files(folder) == files(source)
    record = hub.completed(folder)
    assert record is not None and record["commit"] == fake_hub.repos["acme/tiny"].branches["main"]
    # the files were fetched by commit id, not by the branch name (which could move mid-download)
    assert all(f"/resolve/{record['commit']}/" in path for _, path, _ in fake_hub.requests if "/resolve/" in path)


def test_an_interrupted_download_resumes_without_fetching_again(fake_hub: FakeHub, tmp_path: Path) -> None:
    root, env = tmp_path / "models", hub_env(fake_hub, tmp_path)
    fake_hub.missing.add("model.safetensors")
    failed = cbserve("download", "hf://acme/tiny@main", "--to", str(root), env=env)
    assert failed.returncode == 1
    assert failed.stderr.startswith("cbserve: error: downloading hf://acme/tiny@main failed: "), failed.stderr
    folder = root / "acme" / "tiny" / "main"
    assert hub.completed(folder) is None  # not marked complete: the loader would not take it
    assert fake_hub.gets("/config.json") == 1
    fake_hub.missing.clear()
    done = cbserve("download", "hf://acme/tiny@main", "--to", str(root), env=env)
    assert done.returncode == 0, done.stderr
    assert hub.completed(folder) is not None
    assert fake_hub.gets("/config.json") == 1 and fake_hub.gets("/model.safetensors") == 1  # the rest only


def test_a_wrong_token_fails_with_the_hubs_answer(fake_hub: FakeHub, tmp_path: Path) -> None:
    env = hub_env(fake_hub, tmp_path, HF_TOKEN="hf_wrong")
    failed = cbserve("download", "hf://acme/tiny@main", "--to", str(tmp_path / "models"), env=env)
    assert failed.returncode == 1
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("cbserve: error: downloading hf://acme/tiny@main failed: ") and "401" in line, line
    assert not (tmp_path / "models" / "acme" / "tiny" / "main" / hub.MARKER).exists()


def test_unknown_revision_and_offline_are_clear_errors(fake_hub: FakeHub, tmp_path: Path) -> None:
    root, env = tmp_path / "models", hub_env(fake_hub, tmp_path)
    unknown = cbserve("download", "hf://acme/tiny@v9", "--to", str(root), env=env)
    assert unknown.returncode == 1 and "RevisionNotFoundError" in unknown.stderr, unknown.stderr
    seen = len(fake_hub.requests)
    offline = cbserve("download", "hf://acme/tiny@main", "--to", str(root), env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and len(fake_hub.requests) == seen
    assert offline.stderr.strip() == (f"cbserve: error: hf://acme/tiny@main is not in {root / 'acme/tiny/main'} "
                                      "(no complete download there) and HF_HUB_OFFLINE is set: download it first "
                                      "(cbserve download) or unset HF_HUB_OFFLINE")  # fmt: skip


def test_an_unpinned_model_is_fetched_as_main_with_a_warning(fake_hub: FakeHub, tmp_path: Path) -> None:
    done = cbserve("download", "hf://acme/tiny", "--to", str(tmp_path / "models"), env=hub_env(fake_hub, tmp_path))
    assert done.returncode == 0, done.stderr
    assert "hf://acme/tiny names no revision: fetching main as it is now" in done.stderr
    assert hub.completed(tmp_path / "models" / "acme" / "tiny" / "main") is not None


@pytest.mark.parametrize("uri", ["hf://noslash", "hf://a/b/c", "hf://acme/tiny@", "hf://acme/tiny@../x",
                                 "hf://acme/tiny@a/../b", "hf://.hidden/x", "acme/tiny", "s3://acme/tiny"])
def test_bad_hub_uris_say_what_is_accepted(uri: str) -> None:
    with pytest.raises(ValueError, match=r"is not hf://org/name or hf://org/name@revision"):
        hub.parse_hub_uri(uri)


def test_hub_uris_and_their_folders(tmp_path: Path) -> None:
    pinned = hub.parse_hub_uri("hf://Org.x/Name_1-b@refs/pr/1")
    assert (pinned.repo, pinned.revision, pinned.uri) == ("Org.x/Name_1-b", "refs/pr/1", "hf://Org.x/Name_1-b@refs/pr/1")
    assert pinned.folder(tmp_path) == tmp_path / "Org.x" / "Name_1-b" / "refs%2Fpr%2F1"  # one folder per revision
    assert hub.parse_hub_uri("hf://org/name").folder(tmp_path) == tmp_path / "org" / "name" / "main"


def test_the_download_command_refuses_a_bad_uri(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "download", "hf://noslash", "--to", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("cbserve: error: 'hf://noslash' is not hf://org/name")


def test_a_bad_uri_is_refused_before_torch_or_transformers_load() -> None:
    """The command answers without the 4-5 s of importing the model stack."""
    code = ("import sys\nfrom engine.cli import main\nstatus = main(['download', 'hf://noslash'])\n"
            "print(status, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split("\n")[0] == "2 []", r.stdout + r.stderr
