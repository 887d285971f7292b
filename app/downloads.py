"""Hub downloads as the app sees them: start, pause, resume (also after a restart), cancel, verify.

The bytes move in the engine process (the worker's `download` command runs engine.hub.download,
which keeps partial files under `<folder>/.trellis-download` and checks every file's checksum),
so this object only keeps the list, sends commands and turns the answers into states. The list
is saved to `downloads.json` in the Trellis home on every state change: an app that was closed
mid-download shows the download as paused, and Resume continues where the bytes stopped.

Pause is the worker's cancel (the partial bytes stay); Cancel also deletes the folder. Before a
download starts or resumes the free disk space is checked, so a full disk is reported before
any byte is written; a disk that fills up during the transfer is reported in plain words too.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from PySide6.QtCore import QObject, Signal

from app import settings
from app.models.library import human_bytes
from engine.worker import protocol as P

PARTIAL_DIR = ".trellis-download"   # engine.hub.PARTIAL_DIR (not imported: keeps this module light)
DISK_MARGIN = 1 << 20


@dataclass
class DownloadItem:
    repo: str
    revision: str
    local_dir: str
    total_bytes: int = 0
    state: str = "paused"          # "downloading" | "paused" | "done" | "failed" | "verifying"
    fraction: float = 0.0
    message: str = ""
    verified: bool = False
    detail: str = field(default="", compare=False)   # the engine's own words, for the tooltip
    eta_s: Optional[float] = field(default=None, compare=False)
    command_id: Optional[str] = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.repo}@{self.revision}"

    @property
    def active(self) -> bool:
        return self.state in ("downloading", "verifying")


def local_dir_for(repo: str, revision: str) -> Path:
    """`<first library folder>/<owner>--<name>[--<revision>]`: lands in the library, one folder
    per revision so two bitrates of one model sit side by side."""
    name = repo.replace("/", "--") + ("" if revision == "main" else f"--{revision.replace('/', '-')}")
    return Path(settings.model_folders()[0]) / name


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def bytes_on_disk(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".verified"))


def is_disk_full(message: str) -> bool:
    m = message.lower()
    return "no space left" in m or "errno 28" in m or "disk quota exceeded" in m


class DownloadManager(QObject):
    added = Signal(object)          # DownloadItem
    changed = Signal(object)        # DownloadItem (state, progress or message)
    removed = Signal(object)
    finished = Signal(object)       # a download completed and was verified

    def __init__(self, client, registry: Optional[Path] = None, parent=None):
        super().__init__(parent)
        self.client = client
        self.registry = Path(registry) if registry else settings.home() / "downloads.json"
        self.items: list[DownloadItem] = []
        self._cancelling: dict[str, DownloadItem] = {}   # command id -> item removed while running
        self._load()
        client.progress.connect(self._on_progress)
        client.result.connect(self._on_result)
        client.error.connect(self._on_error)
        client.died.connect(self._on_died)

    # ------------------------------------------------------------------ persistence
    def _load(self) -> None:
        try:
            raw = json.loads(self.registry.read_text())
        except (OSError, ValueError):
            return
        for d in raw if isinstance(raw, list) else []:
            try:
                item = DownloadItem(**{k: d[k] for k in ("repo", "revision", "local_dir", "total_bytes", "state",
                                                          "fraction", "message", "verified") if k in d})
            except TypeError:
                continue
            if item.active:      # the app ended while it ran: the bytes are kept, it can resume
                item.state = "paused"
                item.message = "Interrupted when Trellis closed; press Resume to continue."
            self.items.append(item)

    def save(self) -> None:
        data = [{k: v for k, v in asdict(i).items() if k not in ("eta_s", "command_id", "detail")} for i in self.items]
        try:
            self.registry.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.registry.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(self.registry)
        except OSError:
            pass  # a full disk must not break the list in memory; it is saved on the next change

    # ------------------------------------------------------------------ actions
    def find(self, repo: str, revision: str) -> Optional[DownloadItem]:
        return next((i for i in self.items if i.repo == repo and i.revision == revision), None)

    def start(self, repo: str, revision: str, total_bytes: int = 0) -> DownloadItem:
        """Start (or resume) a download of a whole revision into the library."""
        item = self.find(repo, revision)
        if item is None:
            item = DownloadItem(repo, revision, str(local_dir_for(repo, revision)), total_bytes=total_bytes)
            self.items.append(item)
            self.added.emit(item)
        elif total_bytes:
            item.total_bytes = total_bytes
        self.resume(item)
        return item

    def resume(self, item: DownloadItem, verify: bool = False) -> bool:
        if item.active:
            return True
        if not self.client.running:
            return self._set(item, "paused", "The engine is not running: restart it, then press Resume.")
        folder = Path(item.local_dir)
        if not verify and item.total_bytes:
            need = max(0, item.total_bytes - bytes_on_disk(folder))
            free = free_bytes(folder)
            if free < need + DISK_MARGIN:
                return self._set(item, "failed",
                                 f"Not enough disk space: {item.repo}@{item.revision} needs {human_bytes(need)} more "
                                 f"but {self._volume(folder)} has {human_bytes(free)} free. Free up space or choose "
                                 "another library folder, then press Resume.")
        if verify:
            # Without the markers engine.hub hashes every file again and re-fetches any that differ.
            for marker in (folder / PARTIAL_DIR).rglob("*.verified") if (folder / PARTIAL_DIR).is_dir() else []:
                marker.unlink(missing_ok=True)
            item.verified = False
        item.command_id = self.client.send(P.Download(repo=item.repo, revision=item.revision,
                                                      local_dir=item.local_dir))
        self._set(item, "verifying" if verify else "downloading",
                  "Checking every file against the hub's checksums…" if verify else "Starting…")
        return True

    def verify(self, item: DownloadItem) -> bool:
        return self.resume(item, verify=True)

    def pause(self, item: DownloadItem) -> None:
        if item.active and item.command_id:
            self.client.cancel(item.command_id)
            self._set(item, "paused", "Pausing…")

    def cancel(self, item: DownloadItem) -> None:
        """Stop and delete what was downloaded (a finished download stays on disk: use the library)."""
        if item.active and item.command_id:
            # The folder is deleted once the worker confirms it stopped writing into it.
            self._cancelling[item.command_id] = item
            self.client.cancel(item.command_id)
        elif item.state != "done":
            self._delete_folder(item)
        self.items.remove(item)
        self.removed.emit(item)
        self.save()

    # ------------------------------------------------------------------ engine answers
    def _by_command(self, command_id: str) -> Optional[DownloadItem]:
        return next((i for i in self.items if i.command_id and i.command_id == command_id), None)

    def _on_progress(self, command_id: str, prog) -> None:
        item = self._by_command(command_id)
        if item is None or not item.active:
            return
        if prog.fraction is not None:
            item.fraction = float(prog.fraction)
        item.eta_s = prog.eta_s
        item.message = prog.message
        self.changed.emit(item)

    def _on_result(self, command_id: str, command: str, data) -> None:
        if command_id in self._cancelling and command == "download":
            self._cancelling.pop(command_id)     # finished before the cancel arrived: keep it
            return
        item = self._by_command(command_id)
        if item is None or command != "download":
            return
        item.command_id = None
        item.fraction = 1.0
        item.verified = True
        item.local_dir = str(data.get("local_dir") or item.local_dir)
        folder = Path(item.local_dir)
        if not item.total_bytes:
            item.total_bytes = bytes_on_disk(folder)
        n = len(list((folder / PARTIAL_DIR).rglob("*.verified"))) if (folder / PARTIAL_DIR).is_dir() else 0
        self._set(item, "done", f"Downloaded to {item.local_dir}; {n} file{'s' if n != 1 else ''} match the hub's "
                                "checksums.")
        self.finished.emit(item)

    def _on_error(self, err) -> None:
        if err.id in self._cancelling:
            self._delete_folder(self._cancelling.pop(err.id))
            return
        item = self._by_command(err.id or "")
        if item is None:
            return
        item.command_id = None
        if item.total_bytes:       # progress events are rate-limited: count what is really kept
            item.fraction = min(1.0, bytes_on_disk(Path(item.local_dir)) / item.total_bytes)
        if err.code == P.ErrorCode.CANCELLED:
            self._set(item, "paused", f"Paused at {item.fraction * 100:.0f}%; press Resume to continue.")
        elif is_disk_full(err.message):
            folder = Path(item.local_dir)
            self._set(item, "failed", f"The disk is full: {self._volume(folder)} has "
                                      f"{human_bytes(free_bytes(folder))} free. The "
                                      f"{human_bytes(bytes_on_disk(folder))} already downloaded are kept; free up "
                                      "space, then press Resume.")
        elif err.code == P.ErrorCode.OFFLINE or "cannot be reached" in err.message:
            self._set(item, "failed", f"The connection to the hub was lost at {item.fraction * 100:.0f}%; what was "
                                      "downloaded is kept. Press Resume to continue.")
            item.detail = err.message
        else:
            self._set(item, "failed", sentence(err.message))

    def _on_died(self, _reason: str) -> None:
        for item in self.items:
            if item.active:
                item.command_id = None
                self._set(item, "paused", "The engine stopped; the downloaded bytes are kept. Restart the engine "
                                          "and press Resume.")

    # ------------------------------------------------------------------ helpers
    def _set(self, item: DownloadItem, state: str, message: str) -> bool:
        item.state, item.message = state, message
        if state != "downloading":
            item.eta_s = None
        self.changed.emit(item)
        self.save()
        return state in ("downloading", "verifying")

    @staticmethod
    def _volume(folder: Path) -> str:
        p = folder
        while not p.exists() and p != p.parent:
            p = p.parent
        return str(p)

    @staticmethod
    def _delete_folder(item: DownloadItem) -> None:
        folder = Path(item.local_dir)
        # Only a folder this download created: it holds our partial-files folder, or nothing yet.
        if (folder / PARTIAL_DIR).is_dir():
            shutil.rmtree(folder, ignore_errors=True)
        elif folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def sentence(message: str) -> str:
    """An engine or hub message as a sentence: capital first letter, final full stop."""
    m = message.strip()
    m = m[0].upper() + m[1:] if m else "The download failed."
    return m if m.endswith((".", "!", "?")) else m + "."
