"""The transcript: one QTextBrowser drawing the current branch as HTML.

Actions are links inside the document (`nav:ID:-1`, `regen:ID`, `edit:ID`, `copy:ID:N`,
`copymsg:ID`), so the whole transcript is one cheap widget instead of a widget per message.
Finished messages are rendered once and cached; while an answer streams only its own HTML is
rebuilt, at most every `REDRAW_MS`, which keeps the UI thread free however fast tokens come.
"""
from __future__ import annotations

import html
import time
from pathlib import Path

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication, QTextCursor
from PySide6.QtWidgets import QTextBrowser

from app import store as S
from app.render import code_blocks, render_markdown

REDRAW_MS = 50


def stats_line(stats: dict) -> str:
    parts = []
    n = stats.get("generated_tokens")
    if n:
        parts.append(f"{n} tokens")
    tps = stats.get("tokens_per_s")
    if tps:
        parts.append(f"{tps:.1f} tok/s")
    ttft = stats.get("ttft_s")
    if ttft is not None:
        parts.append(f"first token {ttft:.2f} s")
    if stats.get("finish_reason") == "length":
        parts.append("hit the token limit")
    return " · ".join(parts)


class Transcript(QTextBrowser):
    action = Signal(str, int, int)     # kind ("nav", "regen", "edit"), message id, argument

    def __init__(self, store: S.Store, parent=None):
        super().__init__(parent)
        self.store = store
        self.dark = False
        self.setOpenLinks(False)
        self.setObjectName("transcript")
        self.document().setIndentWidth(22)     # Qt's 40 px per list level wastes a narrow pane
        self.anchorClicked.connect(self._on_anchor)
        self._cache: dict[tuple, str] = {}
        self._conv_id: int | None = None
        self._streaming_id: int | None = None
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._timed_redraw)
        self.render_count = 0
        self._tail_start: int | None = None
        self._tail_id: int | None = None
        self._last_cost_ms = 0.0
        self._prefix_html = ""      # what the document holds before the last message, and
        self._prefix_ids: list[int] = []    # whose messages: what a partial update may keep

    def show_conversation(self, conv_id: int | None, streaming_id: int | None = None) -> None:
        """Redraw for a change of conversation or state. Where the shown messages before the last
        are still the path's first ones, unchanged (an answer starting or finishing), only the
        last one is replaced and any new ones appended: a full `setHtml` re-lays out the whole
        chat, 55-60 ms of the UI thread for 80 messages."""
        same_conv = conv_id == self._conv_id
        self._conv_id, self._streaming_id = conv_id, streaming_id
        path = self.store.path(conv_id) if conv_id else []
        n = len(self._prefix_ids)
        if (same_conv and self._tail_start is not None and self.dark == self._app_is_dark()
                and len(path) > n and [m.id for m in path[:n + 1]] == [*self._prefix_ids, self._tail_id]
                and (self._tail_start > 0 or len(path) == n + 1)
                and "".join(self._message_html(m) for m in path[:n]) == self._prefix_html):
            self._replace_tail(path[n:])
            return
        self.redraw()

    @staticmethod
    def _app_is_dark() -> bool:
        app = QGuiApplication.instance()
        return bool(app.property("trellisDark")) if app else False

    def schedule_redraw(self) -> None:
        """Coalesce stream updates: at most one partial redraw per interval, and the interval
        grows with the cost of a redraw so a long answer never monopolises the UI thread."""
        if not self._timer.isActive():
            self._timer.start(max(REDRAW_MS, int(3 * self._last_cost_ms)))

    def redraw(self) -> None:
        """Rebuild the document: every message but the last from cache, the last one inserted
        separately so that streaming can replace just that part (see `_redraw_streaming`)."""
        self._timer.stop()
        self.render_count += 1
        self.dark = self._app_is_dark()
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 40
        old = bar.value()
        path = self.store.path(self._conv_id) if self._conv_id else []
        self._tail_start = None
        if not path:
            self.setHtml(self._empty("Start a conversation: type below and press Enter. Shift+Enter adds a line."))
            return
        self._prefix_html = "".join(self._message_html(m) for m in path[:-1])
        self._prefix_ids = [m.id for m in path[:-1]]
        self.setHtml(self._prefix_html)
        self._insert_last(path[-1], first=len(path) == 1)
        bar.setValue(bar.maximum() if at_bottom else old)

    def _insert_last(self, m: S.Message, first: bool) -> None:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.End)
        self._tail_start = cursor.position()
        self._tail_id = m.id
        html_text = self._message_html(m)
        if first:
            self.setHtml(html_text)
            self._tail_start = 0
        else:
            cursor.insertHtml(html_text)

    def _redraw_streaming(self) -> None:
        """While an answer streams, replace only its own HTML at the end of the document."""
        m = self.store.message(self._streaming_id) if self._streaming_id else None
        if m is None or self._tail_start is None or self._tail_id != m.id:
            self.redraw()
            return
        self._replace_tail([m])

    def _replace_tail(self, ms: list[S.Message]) -> None:
        """Replace the last message shown with `ms`: that message again, then any after it, the
        last of them the new tail (the only one a stream rewrites)."""
        self._timer.stop()
        self.render_count += 1
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 40
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        cursor.setPosition(self._tail_start)
        cursor.movePosition(QTextCursor.End, QTextCursor.KeepAnchor)
        cursor.removeSelectedText()
        if self._tail_start == 0:       # the only message (show_conversation appends to none)
            cursor.endEditBlock()
            self.setHtml(self._message_html(ms[-1]))
        else:
            if len(ms) > 1:
                middle = "".join(self._message_html(m) for m in ms[:-1])
                cursor.insertHtml(middle)
                self._prefix_html += middle
                self._prefix_ids += [m.id for m in ms[:-1]]
                cursor.movePosition(QTextCursor.End)
                self._tail_start, self._tail_id = cursor.position(), ms[-1].id
            cursor.insertHtml(self._message_html(ms[-1]))
            cursor.endEditBlock()
        if at_bottom:
            bar.setValue(bar.maximum())

    def _timed_redraw(self) -> None:
        t0 = time.perf_counter()
        self._redraw_streaming()
        self._last_cost_ms = (time.perf_counter() - t0) * 1000

    # ------------------------------------------------------------------ HTML
    def _empty(self, text: str) -> str:
        return f'<p align="center" style="color:#888; margin-top:40px;">{html.escape(text)}</p>'

    def _message_html(self, m: S.Message) -> str:
        streaming = m.id == self._streaming_id
        nsib = len(self.store.siblings(m.id))
        key = (m.id, len(m.content), m.state, self.dark, streaming, str(m.stats), nsib)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        muted = "#9aa0a6" if self.dark else "#6a737d"
        who = "You" if m.role == "user" else ("Assistant" + (f" · {html.escape(m.model)}" if m.model else ""))
        head = f'<b>{who}</b>'
        if nsib > 1:
            idx = [s.id for s in self.store.siblings(m.id)].index(m.id) + 1
            head += (f'&nbsp;&nbsp;<a href="nav:{m.id}:-1">&#8592;</a> <span style="color:{muted}">{idx}/{nsib}</span> '
                     f'<a href="nav:{m.id}:1">&#8594;</a>')
        body = render_markdown(m.content, dark=self.dark, copy_prefix=f"copy:{m.id}:") if m.content else ""
        if streaming:
            body += f'<p style="color:{muted}">&#9613;</p>' if not m.content else ""
            body = body or f'<p style="color:{muted}">…</p>'
        imgs = "".join(f'<img src="{QUrl.fromLocalFile(p).toString()}" height="96"> ' for p in m.images if Path(p).exists())
        if imgs:
            imgs = f"<p>{imgs}</p>"
        foot = []
        if m.role == "assistant" and not streaming:
            line = stats_line(m.stats)
            if m.state == S.CANCELLED:
                line = "stopped" + (f" · {line}" if line else "")
            elif m.state in (S.ERROR, S.INTERRUPTED):
                line = ("⚠ " + html.escape(m.stats.get("error", "failed")))
            if line:
                foot.append(f'<span style="color:{muted}">{line}</span>')
            foot.append(f'<a href="regen:{m.id}:0">Regenerate</a>')
            foot.append(f'<a href="copymsg:{m.id}:0">Copy</a>')
            foot.append(f'<a href="edit:{m.id}:0">Edit</a>')
        elif m.role == "user":
            foot.append(f'<a href="edit:{m.id}:0">Edit</a>')
        footer = f'<p style="font-size:small;">{"&nbsp;&nbsp;".join(foot)}</p>' if foot else ""
        bg = ("#2b2f36" if self.dark else "#eef2f7") if m.role == "user" else ("#1e1f22" if self.dark else "#ffffff")
        out = (f'<table width="100%" cellspacing="0" cellpadding="10" bgcolor="{bg}" style="margin-bottom:8px;">'
               f'<tr><td>{head}{imgs}{body}{footer}</td></tr></table>')
        if not streaming:
            self._cache[key] = out
        return out

    # ------------------------------------------------------------------ links
    def _on_anchor(self, url: QUrl) -> None:
        text = url.toString()
        kind, _, rest = text.partition(":")
        try:
            a, _, b = rest.partition(":")
            msg_id, arg = int(a), int(b or 0)
        except ValueError:
            return
        if kind == "copy":
            m = self.store.message(msg_id)
            blocks = code_blocks(m.content) if m else []
            if 0 <= arg < len(blocks):
                QGuiApplication.clipboard().setText(blocks[arg].code)
        elif kind == "copymsg":
            m = self.store.message(msg_id)
            if m:
                QGuiApplication.clipboard().setText(m.content)
        else:
            self.action.emit(kind, msg_id, arg)
