"""A fake Hugging Face Hub on 127.0.0.1 (Starlette under uvicorn, in a thread): the routes that
huggingface_hub's `snapshot_download` calls, serving model folders saved by engine/testing.py.

- `GET /api/models/{org}/{name}/revision/{revision}`: model info with `sha` and `siblings`;
- `GET /api/models/{org}/{name}/tree/{revision}`: the commit's files (`type`, `path`, `size`, `oid`);
- `HEAD`/`GET /{org}/{name}/resolve/{revision}/{file}`: the file, with the headers huggingface_hub
  requires (`X-Repo-Commit`, `ETag`, `Content-Length`).

Unknown repositories and revisions get the Hub's `X-Error-Code` answers; with `token` set, a request
without `Authorization: Bearer <token>` gets 401. Every request is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        return self.commits.get(self.branches.get(revision, revision))


class FakeHub:
    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self.missing: set[str] = set()  # file paths answered 404 EntryNotFound, as if removed mid-download
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def add(self, repo: str, folder: Path, branch: str = "main") -> str:
        """Publish every file under `folder` as a commit of `repo` on `branch`; returns the commit id."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for path, data in files.items():
            digest.update(path.encode() + b"\0" + hashlib.sha1(data).digest())
        sha = digest.hexdigest()
        entry = self.repos.setdefault(repo, Repo())
        entry.commits[sha] = Commit(sha, files)
        entry.branches[branch] = sha
        return sha

    def gets(self, suffix: str) -> int:
        """How many times a file was downloaded (GET of a resolve URL ending with `suffix`)."""
        return sum(1 for method, path, _ in self.requests if method == "GET" and "/resolve/" in path
                   and path.endswith(suffix))  # fmt: skip

    # --- the routes ---

    def _refused(self, request: Request) -> Response | None:
        self.requests.append((request.method, request.url.path, request.headers.get("authorization")))
        if self.token and request.headers.get("authorization") != f"Bearer {self.token}":
            return JSONResponse({"error": "Invalid credentials in Authorization header"}, status_code=401)
        return None

    def _commit(self, request: Request) -> Commit | Response:
        repo = self.repos.get(f"{request.path_params['org']}/{request.path_params['name']}")
        if repo is None:
            return JSONResponse({"error": "Repository not found"}, status_code=404,
                                headers={"X-Error-Code": "RepoNotFound"})  # fmt: skip
        commit = repo.resolve(request.path_params["revision"])
        if commit is None:
            return JSONResponse({"error": "Invalid rev id"}, status_code=404,
                                headers={"X-Error-Code": "RevisionNotFound"})  # fmt: skip
        return commit

    async def model_info(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        commit = self._commit(request)
        if isinstance(commit, Response):
            return commit
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        return JSONResponse({"id": repo, "modelId": repo, "sha": commit.sha, "private": False,
                             "siblings": [{"rfilename": path} for path in commit.files]})  # fmt: skip

    async def tree(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        commit = self._commit(request)
        if isinstance(commit, Response):
            return commit
        return JSONResponse([{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                             for path, data in commit.files.items()])  # fmt: skip

    async def resolve(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        commit = self._commit(request)
        if isinstance(commit, Response):
            return commit
        path = request.path_params["file"]
        if path not in commit.files or path in self.missing:
            return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit.sha})
        data = commit.files[path]
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data))}  # fmt: skip
        return Response(b"" if request.method == "HEAD" else data, headers=headers,
                        media_type="application/octet-stream")  # fmt: skip

    # --- running it ---

    def __enter__(self) -> "FakeHub":
        app = Starlette(routes=[
            Route("/api/models/{org}/{name}/revision/{revision:path}", self.model_info),
            Route("/api/models/{org}/{name}/tree/{revision}", self.tree),
            Route("/{org}/{name}/resolve/{revision}/{file:path}", self.resolve, methods=["GET", "HEAD"]),
        ])  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                     lifespan="off"))  # fmt: skip
        self._thread = threading.Thread(target=self._server.run, name="fake-hub", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:  # uvicorn sets it once the socket listens
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the fake Hub did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=30)
