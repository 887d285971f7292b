"""Finding and downloading models on the Hugging Face hub. Torch-free (the app imports it).

Metadata comes through huggingface_hub (`HfApi`): search, a repo's refs, and one
`model_info(files_metadata=True)` call that pins a revision to its commit and lists every file
with its size and checksum (LFS sha256, or the git blob id for small files). The transfer itself
is ours, because what we need is not what huggingface_hub's downloader does:
- resume across process restarts: bytes go to `<local_dir>/.trellis-download/<file>.<checksum>.part`
  and a new process continues with an HTTP Range request (huggingface_hub discards partial
  files when its process ends);
- checksum verification of every file before it is moved into place (sha256 for LFS files,
  git's blob sha1 otherwise), so an interrupted, corrupted or swapped transfer never leaves a
  file that looks complete;
- refusing file names that would escape the target folder (absolute paths, `..`), checked for
  the whole listing before the first byte is written;
- cancel and progress callbacks for the app.
The hub address is `HF_ENDPOINT` (read at call time, so tests point it at a fake hub).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Optional
from urllib.parse import quote

from engine.errors import TrellisError

DEFAULT_ENDPOINT = "https://huggingface.co"
PARTIAL_DIR = ".trellis-download"
CHUNK_BYTES = 1 << 20
ProgressFn = Callable[[Optional[float], str], None]


class HubError(TrellisError):
    """A hub operation failed; the message says what and what to do."""


class HubOffline(HubError):
    pass


class RepoNotFound(HubError):
    pass


class UnsafePath(HubError):
    pass


class ChecksumMismatch(HubError):
    pass


class DownloadCancelled(HubError):
    pass


@dataclass
class RepoSummary:
    id: str
    author: str = ""
    downloads: int = 0
    likes: int = 0
    tags: list[str] = field(default_factory=list)
    architecture: str = ""
    parameters: Optional[int] = None
    is_exl3: bool = False
    last_modified: str = ""


@dataclass
class Revision:
    """A branch or tag. EXL3 repos publish one branch per bitrate ("4.0bpw", "6_5bpw", "h6-4bpw"...);
    `bits` is that bitrate when the name says it."""

    name: str
    commit: str
    kind: str                      # "branch" | "tag"
    bits: Optional[float] = None


@dataclass
class RepoDetails:
    """What the hub says about one revision of a repo: what a model card shows besides its README."""

    id: str
    commit: str                    # the revision pinned to its commit ("" if the hub did not say)
    tags: list[str] = field(default_factory=list)
    downloads: int = 0
    likes: int = 0
    config: dict = field(default_factory=dict)   # the hub's copy of config.json (a subset of keys)
    architecture: str = ""
    parameters: Optional[int] = None
    is_exl3: bool = False


@dataclass
class RepoFileInfo:
    path: str
    size: int
    sha256: Optional[str] = None   # LFS files
    blob_id: Optional[str] = None  # git blob sha1 (the checksum of non-LFS files)


# ---------------------------------------------------------------------------- metadata

def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _api():
    from huggingface_hub import HfApi
    return HfApi(endpoint=endpoint(), token=os.environ.get("HF_TOKEN") or False)


def _translate(error: Exception, what: str) -> HubError:
    """huggingface_hub / httpx errors -> one-line messages."""
    from huggingface_hub import errors as hf_errors
    try:
        import httpx2 as httpx
    except ImportError:  # older huggingface_hub versions use httpx or requests
        import httpx  # type: ignore
    if isinstance(error, HubError):
        return error
    if isinstance(error, hf_errors.OfflineModeIsEnabled):
        return HubOffline(f"cannot {what}: offline mode is on (HF_HUB_OFFLINE); turn it off to use the hub")
    if isinstance(error, hf_errors.RevisionNotFoundError):
        return RepoNotFound(f"cannot {what}: that revision does not exist")
    if isinstance(error, hf_errors.RepositoryNotFoundError):
        return RepoNotFound(f"cannot {what}: the repository does not exist (or is private or gated)")
    if isinstance(error, hf_errors.HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", "?")
        return HubError(f"cannot {what}: the hub answered HTTP {status}")
    if isinstance(error, (httpx.TransportError, ConnectionError, TimeoutError)):
        return HubOffline(f"cannot {what}: the hub at {endpoint()} cannot be reached "
                          f"({type(error).__name__}); check the network connection")
    return HubError(f"cannot {what}: {type(error).__name__}: {error}")


def search_models(query: str = "", architecture: Optional[str] = None, min_params: Optional[int] = None,
                  max_params: Optional[int] = None, limit: int = 50) -> list[RepoSummary]:
    """Models matching `query`, EXL3 repos first (then by downloads). `architecture` matches the
    config's `architectures[0]` or `model_type` (case-insensitive); sizes are parameter counts."""
    # One request to /api/models (what HfApi.list_models sends) instead of list_models itself:
    # its pagination retries connection errors with back-off for ~25 s, and an offline user
    # should hear so at once.
    from huggingface_hub.hf_api import ModelInfo
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    params = {"limit": max(limit * 4, limit), "full": "True", "config": "True"}
    if query:
        params["search"] = query
    try:
        response = get_session().get(f"{endpoint()}/api/models", params=params, timeout=30,
                                     headers=build_hf_headers(token=os.environ.get("HF_TOKEN") or False))
        hf_raise_for_status(response)
        found = [ModelInfo(**item) for item in response.json()]
    except Exception as e:
        raise _translate(e, "search the hub") from None
    results = []
    for m in found:
        config = m.config or {}
        archs = config.get("architectures") or [""]
        arch = archs[0] if archs else ""
        params = getattr(getattr(m, "safetensors", None), "total", None)
        tags = list(m.tags or [])
        summary = RepoSummary(id=m.id, author=m.author or m.id.split("/")[0], downloads=m.downloads or 0,
                              likes=m.likes or 0, tags=tags, architecture=arch, parameters=params,
                              is_exl3=looks_exl3(m.id, tags, config),
                              last_modified=m.last_modified.isoformat() if m.last_modified else "")
        if architecture and architecture.lower() not in (arch.lower(), str(config.get("model_type", "")).lower()):
            continue
        if min_params is not None and (params is None or params < min_params):
            continue
        if max_params is not None and (params is None or params > max_params):
            continue
        results.append(summary)
    results.sort(key=lambda r: (not r.is_exl3, -r.downloads))
    return results[:limit]


def looks_exl3(repo_id: str, tags: list[str], config: dict) -> bool:
    """Whether a repo holds an EXL3 model, judged from what a listing shows without downloading:
    its config's quant_method, an "exl3" tag, or "exl3" in its name (how such repos are named)."""
    quant = (config or {}).get("quantization_config") or {}
    return (isinstance(quant, dict) and quant.get("quant_method") == "exl3") or "exl3" in repo_id.lower() \
        or any(t.lower() == "exl3" for t in tags or ())


_BITS_RE = re.compile(r"(\d+(?:[._]\d+)?)\s*-?bpw", re.IGNORECASE)


def bits_from_name(name: str) -> Optional[float]:
    m = _BITS_RE.search(name)
    return float(m.group(1).replace("_", ".")) if m else None


def repo_details(repo: str, revision: Optional[str] = None) -> RepoDetails:
    """Tags, counts, config and parameter count of a repo's revision (None: the default branch),
    in one request.
    RepoNotFound when the repo or revision does not exist; HubOffline when the hub cannot be reached."""
    try:
        info = _api().model_info(repo, revision=revision)
    except Exception as e:
        raise _translate(e, f"open {repo}") from None
    config = info.config if isinstance(info.config, dict) else {}
    archs = config.get("architectures") or [""]
    tags = list(info.tags or [])
    return RepoDetails(id=info.id or repo, commit=info.sha or "", tags=tags, downloads=info.downloads or 0,
                       likes=info.likes or 0, config=config, architecture=archs[0] if archs else "",
                       parameters=getattr(getattr(info, "safetensors", None), "total", None),
                       is_exl3=looks_exl3(repo, tags, config))


def read_text(repo: str, commit: str, path: str, limit: int = 4 << 20) -> Optional[str]:
    """The first `limit` bytes of one file of a revision, decoded as UTF-8 (bad bytes replaced), or
    None when the revision has no such file. For small text files (config.json, README.md) that
    are read to be shown or planned with, not kept; `download` is for files that are kept."""
    from huggingface_hub.utils import build_hf_headers, get_session
    try:
        r = get_session().get(file_url(repo, commit, path), timeout=30, follow_redirects=True,
                              headers=build_hf_headers(token=os.environ.get("HF_TOKEN") or False))
    except Exception as e:
        raise _translate(e, f"read {path} of {repo}") from None
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise HubError(f"cannot read {path} of {repo}: the hub answered HTTP {r.status_code}")
    return r.content[:limit].decode("utf-8", "replace")


def list_revisions(repo: str) -> list[Revision]:
    """Branches (main first, then by bitrate) and tags."""
    try:
        refs = _api().list_repo_refs(repo)
    except Exception as e:
        raise _translate(e, f"list the revisions of {repo}") from None
    branches = [Revision(b.name, b.target_commit, "branch", bits_from_name(b.name)) for b in refs.branches]
    branches.sort(key=lambda r: (r.name != "main", r.bits if r.bits is not None else float("inf"), r.name))
    tags = [Revision(t.name, t.target_commit, "tag", bits_from_name(t.name)) for t in refs.tags]
    return branches + tags


def repo_files(repo: str, revision: str = "main") -> tuple[str, list[RepoFileInfo]]:
    """(commit, files with sizes and checksums) of a revision, in one request."""
    try:
        info = _api().model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:
        raise _translate(e, f"list the files of {repo}@{revision}") from None
    files = []
    for s in info.siblings or []:
        lfs = s.lfs
        files.append(RepoFileInfo(path=s.rfilename, size=int(lfs.size if lfs else (s.size or 0)),
                                  sha256=lfs.sha256 if lfs else None, blob_id=s.blob_id))
    if not info.sha:
        raise HubError(f"the hub did not say which commit {repo}@{revision} is")
    return info.sha, files


def list_files(repo: str, revision: str = "main") -> list[RepoFileInfo]:
    return repo_files(repo, revision)[1]


# ---------------------------------------------------------------------------- paths

def safe_relative_path(name: str) -> PurePosixPath:
    """A hub file name as a relative path that stays inside the target folder, or UnsafePath."""
    bad = (not name or "\x00" in name or "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name))
    parts = name.split("/") if not bad else []
    if bad or any(part in ("..", ".", "") for part in parts) or parts[0] == PARTIAL_DIR:
        raise UnsafePath(f"refusing the file name {name!r} from the hub: it would be written outside the "
                         "model folder")
    return PurePosixPath(*parts)


def models_dir() -> Path:
    """Where the engine puts models it fetches or imports: $TRELLIS_MODELS_DIR, or a per-user default."""
    return Path(os.environ.get("TRELLIS_MODELS_DIR") or Path.home() / ".local" / "share" / "trellis" / "models")


def default_local_dir(repo: str, revision: str) -> Path:
    name = repo.replace("/", "--") + ("" if revision == "main" else f"--{revision.replace('/', '-')}")
    return models_dir() / name


# ---------------------------------------------------------------------------- download

class _Hasher:
    """sha256 of the content and git's blob sha1 (sha1 over "blob <size>\\0" + content)."""

    def __init__(self, size: int):
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(f"blob {size}\0".encode())

    def update(self, data: bytes) -> None:
        self.sha256.update(data)
        self.git.update(data)

    def matches(self, f: RepoFileInfo) -> bool:
        if f.sha256:
            return self.sha256.hexdigest() == f.sha256.lower()
        if f.blob_id:
            return self.git.hexdigest() == f.blob_id.lower()
        return True  # the hub gave no checksum: size is all that can be checked


def _hash_file(path: Path, size: int, hasher: Optional[_Hasher] = None) -> _Hasher:
    hasher = hasher or _Hasher(size)
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher


def _verified_marker(local_dir: Path, rel: PurePosixPath) -> Path:
    return local_dir / PARTIAL_DIR / (str(rel) + ".verified")


def _already_done(local_dir: Path, rel: PurePosixPath, f: RepoFileInfo) -> bool:
    """A finished file is skipped when its marker (checksum, size, mtime) still describes it,
    so a restart does not re-hash gigabytes; otherwise it is hashed once."""
    dest = local_dir / rel
    if not dest.is_file() or dest.stat().st_size != f.size:
        return False
    checksum = f.sha256 or f.blob_id or ""
    marker = _verified_marker(local_dir, rel)
    stat = dest.stat()
    try:
        saved = json.loads(marker.read_text())
        if saved == {"checksum": checksum, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if not _hash_file(dest, f.size).matches(f):
        return False
    _write_marker(local_dir, rel, f)
    return True


def _write_marker(local_dir: Path, rel: PurePosixPath, f: RepoFileInfo) -> None:
    dest = local_dir / rel
    marker = _verified_marker(local_dir, rel)
    marker.parent.mkdir(parents=True, exist_ok=True)
    stat = dest.stat()
    marker.write_text(json.dumps({"checksum": f.sha256 or f.blob_id or "", "size": stat.st_size,
                                  "mtime_ns": stat.st_mtime_ns}))


def file_url(repo: str, commit: str, path: str) -> str:
    return f"{endpoint()}/{repo}/resolve/{quote(commit, safe='')}/{quote(path)}"


def download(repo: str, revision: str = "main", files: Optional[Iterable[str]] = None,
             local_dir: Optional[str | Path] = None, progress: Optional[ProgressFn] = None,
             cancel: Optional[threading.Event] = None) -> Path:
    """Download `files` (None: all) of `repo` at `revision` into `local_dir`; returns the folder.
    Safe to interrupt at any point (kill included) and to call again: finished files are kept,
    a partial file continues where it stopped, and every file is checked against the hub's checksum."""
    progress = progress or (lambda fraction, message: None)
    commit, listing = repo_files(repo, revision)
    by_path = {f.path: f for f in listing}
    # Every name is checked before anything is written.
    planned = [(safe_relative_path(f.path), f) for f in listing]
    if files is not None:
        wanted = list(files)
        missing = [name for name in wanted if name not in by_path]
        if missing:
            raise HubError(f"{repo}@{revision} has no file {missing[0]!r}")
        planned = [(safe_relative_path(name), by_path[name]) for name in wanted]
    local_dir = Path(local_dir) if local_dir else default_local_dir(repo, revision)
    local_dir.mkdir(parents=True, exist_ok=True)

    total = sum(f.size for _, f in planned) or 1
    done_bytes = 0
    for rel, f in planned:
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled("download cancelled")
        if _already_done(local_dir, rel, f):
            done_bytes += f.size
            progress(done_bytes / total, f"{rel} already complete")
            continue
        base = done_bytes

        def on_bytes(n: int, rel=rel, base=base) -> None:
            progress(min(1.0, (base + n) / total), f"downloading {rel}")
        _download_one(repo, commit, local_dir, rel, f, on_bytes, cancel)
        done_bytes += f.size
    progress(1.0, f"downloaded {repo}@{revision}")
    return local_dir


def _download_one(repo: str, commit: str, local_dir: Path, rel: PurePosixPath, f: RepoFileInfo,
                  on_bytes: Callable[[int], None], cancel: Optional[threading.Event]) -> None:
    from huggingface_hub.utils import build_hf_headers, get_session

    checksum = (f.sha256 or f.blob_id or "nochecksum")[:16]
    part = local_dir / PARTIAL_DIR / f"{rel}.{checksum}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    dest = local_dir / rel
    # Hash what is already there, then continue hashing as bytes arrive: one pass over the data.
    have = part.stat().st_size if part.exists() else 0
    if have > f.size:
        part.unlink()
        have = 0
    hasher = _hash_file(part, f.size) if have else _Hasher(f.size)
    on_bytes(have)
    if have < f.size:
        headers = build_hf_headers(token=os.environ.get("HF_TOKEN") or False)
        headers["Accept-Encoding"] = "identity"
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with get_session().stream("GET", file_url(repo, commit, str(rel)), headers=headers,
                                      follow_redirects=True, timeout=30) as response:
                if response.status_code == 416 and have:
                    pass  # nothing left to send: the part is complete; verified below
                elif response.status_code not in (200, 206):
                    raise HubError(f"cannot download {rel}: the hub answered HTTP {response.status_code}")
                else:
                    mode = "ab"
                    if have and response.status_code == 200:  # the server ignored Range: start over
                        mode, have, hasher = "wb", 0, _Hasher(f.size)
                    with open(part, mode) as out:
                        for chunk in response.iter_bytes():  # as received: a drop loses little
                            if cancel is not None and cancel.is_set():
                                raise DownloadCancelled("download cancelled")
                            if have + len(chunk) > f.size:
                                raise HubError(f"cannot download {rel}: the hub sent more bytes than its "
                                               f"listing says ({f.size})")
                            out.write(chunk)
                            hasher.update(chunk)
                            have += len(chunk)
                            on_bytes(have)
        except HubError:
            raise
        except Exception as e:
            raise _translate(e, f"download {rel} ({have} of {f.size} bytes kept; run again to resume)") from None
    if have != f.size:
        raise HubError(f"cannot download {rel}: the transfer ended at {have} of {f.size} bytes; run again to resume")
    if not hasher.matches(f):
        part.unlink()
        raise ChecksumMismatch(f"{rel}: the downloaded file does not match the hub's checksum; "
                               "it was deleted, run the download again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)
    _write_marker(local_dir, rel, f)

