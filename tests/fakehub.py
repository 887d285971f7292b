"""A fake Hugging Face hub on 127.0.0.1 for tests (point HF_ENDPOINT at `hub.url`).

It serves what huggingface_hub asks for: model search (`/api/models`), model info with file
metadata (`/api/models/{repo}[/revision/{rev}]?blobs=true`), refs (`/api/models/{repo}/refs`),
tree listings (`/api/models/{repo}/tree/{rev}[/{path}]`) and files
(`HEAD|GET /{repo}/resolve/{rev}/{path}`) with Range requests, ETag, X-Repo-Commit, sizes, LFS
sha256 and git blob ids computed from the real bytes. `cut_after` makes file transfers stop
mid-body by closing the connection, like a dropped network; `throttle_s` slows transfers
so a test can kill the downloader mid-file; `requests` records what was asked.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional, Union
from urllib.parse import parse_qs, unquote, urlsplit

LFS_MIN_BYTES = 1024  # files this size or larger (and every .safetensors) are "LFS" files


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    id: str
    branches: dict[str, dict[str, bytes]] = field(default_factory=dict)  # branch -> {path: bytes}
    tags: dict[str, str] = field(default_factory=dict)                   # tag -> branch
    config: dict = field(default_factory=dict)
    hub_tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    parameters: Optional[int] = None

    def commit(self, branch: str) -> str:
        h = hashlib.sha1(f"{self.id}@{branch}".encode())
        for path in sorted(self.branches[branch]):
            h.update(path.encode() + hashlib.sha256(self.branches[branch][path]).digest())
        return h.hexdigest()

    def resolve(self, rev: str) -> Optional[str]:
        """Branch name for a branch, tag or commit hash."""
        if rev in self.branches:
            return rev
        if rev in self.tags:
            return self.tags[rev]
        for branch in self.branches:
            if self.commit(branch) == rev:
                return branch
        return None


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(".safetensors") or len(data) >= LFS_MIN_BYTES


def file_entry(path: str, data: bytes) -> dict:
    entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
    if is_lfs(path, data):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        # cut_after(path, start_offset) -> number of body bytes to send before dropping the
        # connection, or None to send everything. An int applies to every transfer.
        self.cut_after: Union[None, int, Callable[[str, int], Optional[int]]] = None
        self.requests: list[tuple[str, str, Optional[str]]] = []  # (method, path, Range header)
        self.throttle_s = 0.0  # pause after each 16 KiB of a file body: a slow link, for kill tests
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fakehub", daemon=True)

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def add_repo(self, repo_id: str, branches: dict[str, dict[str, bytes]], **kw) -> FakeRepo:
        repo = FakeRepo(id=repo_id, branches=branches, **kw)
        self.repos[repo_id] = repo
        return repo

    @staticmethod
    def read_folder(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)).replace("\\", "/"): p.read_bytes()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    def log(self, method: str, path: str, range_header: Optional[str]) -> None:
        with self._lock:
            self.requests.append((method, path, range_header))


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # keep test output quiet
        pass

    # -------------------------------------------------------------- plumbing

    def _send_json(self, obj, status: int = 200, headers: Optional[dict] = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send_json({"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message})

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self) -> None:
        split = urlsplit(self.path)
        path, query = unquote(split.path), parse_qs(split.query)
        self.hub.log(self.command, path, self.headers.get("Range"))
        try:
            if path == "/api/models":
                return self._search(query)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
            if m:
                return self._model_info(m.group(1), m.group(2) or "main", query)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/refs", path)
            if m:
                return self._refs(m.group(1))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(m.group(1), m.group(2), m.group(3) or "", query)
            # Resolve paths are matched on the raw path: a file name may itself hold "%2F..".
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", split.path)
            if m:
                return self._resolve(unquote(m.group(1)), unquote(m.group(2)), unquote(m.group(3)))
            self._error(404, "NotFound", f"no route for {path}")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _repo_and_branch(self, repo_id: str, rev: str):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None, None
        branch = repo.resolve(rev)
        if branch is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo, None
        return repo, branch

    # -------------------------------------------------------------- API

    def _summary(self, repo: FakeRepo, full: bool) -> dict:
        out = {"id": repo.id, "modelId": repo.id, "author": repo.id.split("/")[0], "downloads": repo.downloads,
               "likes": repo.likes, "tags": repo.hub_tags, "sha": repo.commit("main") if "main" in repo.branches
               else None, "lastModified": "2026-01-01T00:00:00.000Z", "private": False, "library_name": "exllamav3"
               if "exl3" in repo.hub_tags else "transformers"}
        if full:
            out["config"] = repo.config
            if repo.parameters is not None:
                out["safetensors"] = {"parameters": {"BF16": repo.parameters}, "total": repo.parameters}
            if "main" in repo.branches:
                out["siblings"] = [{"rfilename": p} for p in sorted(repo.branches["main"])]
        return out

    def _search(self, query: dict) -> None:
        search = (query.get("search") or [""])[0].lower()
        author = (query.get("author") or [None])[0]
        filters = query.get("filter") or []
        limit = int((query.get("limit") or ["1000"])[0])
        full = any(k in query for k in ("full", "config"))
        hits = [r for r in self.hub.repos.values()
                if search in r.id.lower() and (author is None or r.id.split("/")[0] == author)
                and all(f in r.hub_tags for f in filters)]
        hits.sort(key=lambda r: -r.downloads)
        self._send_json([self._summary(r, full) for r in hits[:limit]])

    def _model_info(self, repo_id: str, rev: str, query: dict) -> None:
        repo, branch = self._repo_and_branch(repo_id, rev)
        if branch is None:
            return
        files = repo.branches[branch]
        out = self._summary(repo, True)
        out["sha"] = repo.commit(branch)
        blobs = (query.get("blobs") or ["false"])[0].lower() == "true"
        siblings = []
        for path in sorted(files):
            s = {"rfilename": path}
            if blobs:
                entry = file_entry(path, files[path])
                s.update(size=entry["size"], blobId=entry["oid"])
                if "lfs" in entry:
                    s["lfs"] = {"sha256": entry["lfs"]["oid"], "size": entry["size"], "pointerSize": 134}
            siblings.append(s)
        out["siblings"] = siblings
        self._send_json(out)

    def _refs(self, repo_id: str) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": repo.commit(b)} for b in repo.branches]
        tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": repo.commit(b)} for t, b in repo.tags.items()]
        self._send_json({"branches": branches, "converts": [], "tags": tags, "pullRequests": []})

    def _tree(self, repo_id: str, rev: str, prefix: str, query: dict) -> None:
        repo, branch = self._repo_and_branch(repo_id, rev)
        if branch is None:
            return
        recursive = (query.get("recursive") or ["false"])[0].lower() == "true"
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        entries, folders = [], set()
        for path, data in sorted(repo.branches[branch].items()):
            if not path.startswith(base):
                continue
            rest = path[len(base):]
            if "/" in rest and not recursive:
                folders.add(base + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                for i in range(len(parts)):
                    folders.add(base + "/".join(parts[:i + 1]))
            entries.append(file_entry(path, data))
        dirs = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                for f in sorted(folders)]
        self._send_json(dirs + entries)

    # -------------------------------------------------------------- files

    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        repo, branch = self._repo_and_branch(repo_id, rev)
        if branch is None:
            return
        data = repo.branches[branch].get(path)
        if data is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        entry = file_entry(path, data)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        size = len(data)
        start, end, status = 0, size - 1, 200
        range_header = self.headers.get("Range")
        if range_header:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", range_header.strip())
            if not m:
                return self._error(400, "BadRange", f"unsupported Range {range_header}")
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        body = data[start:end + 1]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.commit(branch))
        if "lfs" in entry:
            self.send_header("X-Linked-Size", str(size))
            self.send_header("X-Linked-Etag", f'"{etag}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = self.hub.cut_after(path, start) if callable(self.hub.cut_after) else self.hub.cut_after
        if cut is not None and cut < len(body):
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if self.hub.throttle_s:
            for i in range(0, len(body), 16384):
                self.wfile.write(body[i:i + 16384])
                self.wfile.flush()
                time.sleep(self.hub.throttle_s)
            return
        self.wfile.write(body)
