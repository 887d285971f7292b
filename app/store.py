"""Store: the only road to the app's SQLite database of conversations.

Messages form a tree, not a list: regenerating an answer adds a sibling of the old answer, and
editing a message adds a sibling of the old message, so nothing is ever deleted by a branch. A
conversation remembers its current leaf; the transcript shown is the path from a root to that
leaf. Generated text is appended to its row as it streams (WAL journal, one short transaction
per delta), so a crash of the app or the engine loses at most the delta in flight.

No Qt here: the store is plain Python so the same file can be used by scripts and tests.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT 'New chat',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    system_prompt TEXT NOT NULL DEFAULT '',
    preset TEXT NOT NULL DEFAULT 'Balanced',
    leaf_id INTEGER
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    images TEXT NOT NULL DEFAULT '[]',
    created REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'done',
    stats TEXT NOT NULL DEFAULT '{}',
    model TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation_id, parent_id);
"""

# Message states. "streaming" rows found at start-up were cut off by a crash.
DONE, STREAMING, CANCELLED, ERROR, INTERRUPTED = "done", "streaming", "cancelled", "error", "interrupted"


@dataclass
class Conversation:
    id: int
    title: str
    created: float
    updated: float
    pinned: bool
    system_prompt: str
    preset: str
    leaf_id: int | None


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str                      # "user" | "assistant"
    content: str
    images: list[str] = field(default_factory=list)
    created: float = 0.0
    state: str = DONE
    stats: dict = field(default_factory=dict)
    model: str = ""


class Store:
    def __init__(self, path: str | Path):
        self.db_path = Path(path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.db_path), isolation_level=None)   # autocommit
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # Streaming rewrites a row per token; checkpointing the WAL mid-stream would stall the UI,
        # so the WAL grows during an answer and is checkpointed when the answer finishes.
        self.db.execute("PRAGMA wal_autocheckpoint=20000")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        # Rows still streaming belong to a session that crashed: keep the text, mark it.
        self.db.execute("UPDATE messages SET state=? WHERE state=?", (INTERRUPTED, STREAMING))

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------ conversations
    def create_conversation(self, title: str = "New chat", system_prompt: str = "", preset: str = "Balanced") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations(title, created, updated, system_prompt, preset) VALUES (?,?,?,?,?)",
            (title, now, now, system_prompt, preset))
        return cur.lastrowid

    def conversation(self, conv_id: int) -> Conversation | None:
        row = self.db.execute("SELECT id, title, created, updated, pinned, system_prompt, preset, leaf_id "
                              "FROM conversations WHERE id=?", (conv_id,)).fetchone()
        return Conversation(*row[:4], bool(row[4]), *row[5:]) if row else None

    def list_conversations(self, search: str = "") -> list[Conversation]:
        """Pinned first, then most recently updated. `search` matches titles and message text."""
        sql = "SELECT id, title, created, updated, pinned, system_prompt, preset, leaf_id FROM conversations"
        args: tuple = ()
        if search.strip():
            like = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            sql += (" WHERE title LIKE ? ESCAPE '\\' OR id IN "
                    "(SELECT conversation_id FROM messages WHERE content LIKE ? ESCAPE '\\')")
            args = (like, like)
        sql += " ORDER BY pinned DESC, updated DESC, id DESC"
        return [Conversation(*r[:4], bool(r[4]), *r[5:]) for r in self.db.execute(sql, args)]

    def rename(self, conv_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title=? WHERE id=?", (title.strip() or "Untitled", conv_id))

    def set_pinned(self, conv_id: int, pinned: bool) -> None:
        self.db.execute("UPDATE conversations SET pinned=? WHERE id=?", (int(pinned), conv_id))

    def set_system_prompt(self, conv_id: int, text: str) -> None:
        self.db.execute("UPDATE conversations SET system_prompt=? WHERE id=?", (text, conv_id))

    def set_preset(self, conv_id: int, preset: str) -> None:
        self.db.execute("UPDATE conversations SET preset=? WHERE id=?", (preset, conv_id))

    def delete_conversation(self, conv_id: int) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM messages WHERE conversation_id=?", (conv_id,))
            self.db.execute("DELETE FROM conversations WHERE id=?", (conv_id,))

    def _touch(self, conv_id: int, leaf_id: int | None = None) -> None:
        if leaf_id is None:
            self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conv_id))
        else:
            self.db.execute("UPDATE conversations SET updated=?, leaf_id=? WHERE id=?", (time.time(), leaf_id, conv_id))

    # ------------------------------------------------------------------ messages
    def add_message(self, conv_id: int, parent_id: int | None, role: str, content: str = "",
                    images: list[str] | None = None, state: str = DONE, model: str = "") -> int:
        """Add a message under `parent_id` (None: a new root) and make it the current leaf."""
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, parent_id, role, content, images, created, state, model) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (conv_id, parent_id, role, content, json.dumps(list(images or [])), time.time(), state, model))
        self._touch(conv_id, cur.lastrowid)
        return cur.lastrowid

    def append_text(self, msg_id: int, delta: str) -> None:
        self.db.execute("UPDATE messages SET content = content || ? WHERE id=?", (delta, msg_id))

    def finish_message(self, msg_id: int, state: str = DONE, stats: dict | None = None, content: str | None = None) -> None:
        if content is None:
            self.db.execute("UPDATE messages SET state=?, stats=? WHERE id=?", (state, json.dumps(stats or {}), msg_id))
        else:
            self.db.execute("UPDATE messages SET state=?, stats=?, content=? WHERE id=?",
                            (state, json.dumps(stats or {}), content, msg_id))
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def message(self, msg_id: int) -> Message | None:
        row = self.db.execute(self._MSG_SQL + " WHERE id=?", (msg_id,)).fetchone()
        return self._msg(row) if row else None

    _MSG_SQL = "SELECT id, conversation_id, parent_id, role, content, images, created, state, stats, model FROM messages"

    @staticmethod
    def _msg(r) -> Message:
        return Message(r[0], r[1], r[2], r[3], r[4], json.loads(r[5] or "[]"), r[6], r[7], json.loads(r[8] or "{}"), r[9])

    def children(self, conv_id: int, parent_id: int | None) -> list[Message]:
        if parent_id is None:
            rows = self.db.execute(self._MSG_SQL + " WHERE conversation_id=? AND parent_id IS NULL ORDER BY id", (conv_id,))
        else:
            rows = self.db.execute(self._MSG_SQL + " WHERE conversation_id=? AND parent_id=? ORDER BY id", (conv_id, parent_id))
        return [self._msg(r) for r in rows]

    def siblings(self, msg_id: int) -> list[Message]:
        """The alternatives of a message (itself included), oldest first."""
        m = self.message(msg_id)
        return self.children(m.conversation_id, m.parent_id) if m else []

    def path(self, conv_id: int) -> list[Message]:
        """Root-to-leaf messages of the conversation's current branch."""
        conv = self.conversation(conv_id)
        out: list[Message] = []
        mid = conv.leaf_id if conv else None
        while mid is not None:
            m = self.message(mid)
            if m is None:
                break
            out.append(m)
            mid = m.parent_id
        return out[::-1]

    def select(self, msg_id: int) -> None:
        """Show the branch through `msg_id`: follow its newest children down to a leaf."""
        m = self.message(msg_id)
        if m is None:
            return
        leaf = m
        while True:
            kids = self.children(m.conversation_id, leaf.id)
            if not kids:
                break
            leaf = kids[-1]
        self._touch(m.conversation_id, leaf.id)

    def set_leaf(self, conv_id: int, leaf_id: int | None) -> None:
        self._touch(conv_id, leaf_id)

    # ------------------------------------------------------------------ export
    def export_json(self, conv_id: int) -> dict:
        """The whole tree (every branch), plus the current path, as plain data."""
        conv = self.conversation(conv_id)
        rows = [self._msg(r) for r in self.db.execute(self._MSG_SQL + " WHERE conversation_id=? ORDER BY id", (conv_id,))]
        return {"format": "trellis-chat", "version": 1, "conversation": asdict(conv),
                "messages": [asdict(m) for m in rows], "current_path": [m.id for m in self.path(conv_id)]}

    def export_markdown(self, conv_id: int) -> str:
        conv = self.conversation(conv_id)
        lines = [f"# {conv.title}", ""]
        if conv.system_prompt.strip():
            lines += ["**System:**", "", conv.system_prompt.strip(), ""]
        for m in self.path(conv_id):
            who = "User" if m.role == "user" else "Assistant"
            lines += [f"## {who}", ""]
            lines += [f"![image]({p})" for p in m.images]
            lines += [m.content.rstrip(), ""]
        return "\n".join(lines)
