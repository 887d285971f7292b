"""Image attachments: check that a file is an image Trellis can send, and keep a private copy.

A copy lives in the app's folder (named by content hash) so a chat still shows its images after
the originals are moved or deleted. Checks happen before anything is stored: an unreadable or
oversized file gives one clear sentence, never an exception in the UI."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from PySide6.QtGui import QImage, QImageReader

from app.settings import home

MAX_BYTES = 20 * 1024 * 1024
MAX_SIDE = 8192


class AttachmentError(ValueError):
    """The one line to show the person."""


def attachments_dir() -> Path:
    d = home() / "attachments"
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_image(path: str | Path) -> None:
    p = Path(path)
    if not p.is_file():
        raise AttachmentError(f"{p.name}: file not found")
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise AttachmentError(f"{p.name} is too large ({size / 2**20:.0f} MB; at most {MAX_BYTES // 2**20} MB)")
    reader = QImageReader(str(p))
    if not reader.canRead():
        raise AttachmentError(f"{p.name} is not an image Trellis can read (PNG, JPEG, WebP, GIF, BMP)")
    dims = reader.size()
    if dims.isValid() and max(dims.width(), dims.height()) > MAX_SIDE:
        raise AttachmentError(f"{p.name} is too large ({dims.width()}×{dims.height()} px; at most {MAX_SIDE} px a side)")


def import_image(path: str | Path) -> str:
    """Check, then copy into the attachments folder; returns the stored path."""
    check_image(path)
    p = Path(path)
    digest = hashlib.sha256(p.read_bytes()).hexdigest()[:20]
    dest = attachments_dir() / f"{digest}{p.suffix.lower() or '.img'}"
    if not dest.exists():
        shutil.copyfile(p, dest)
    return str(dest)


def import_qimage(image: QImage) -> str:
    """A pasted image: saved as PNG in the attachments folder."""
    if image.isNull():
        raise AttachmentError("the clipboard holds no readable image")
    if max(image.width(), image.height()) > MAX_SIDE:
        raise AttachmentError(f"pasted image is too large ({image.width()}×{image.height()} px; at most {MAX_SIDE} px a side)")
    tmp = attachments_dir() / "pasted.tmp.png"
    if not image.save(str(tmp), "PNG"):
        raise AttachmentError("the pasted image could not be saved")
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:20]
    dest = attachments_dir() / f"{digest}.png"
    tmp.replace(dest)
    return str(dest)
