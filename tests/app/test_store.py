"""Store: the message tree (alternatives, branches), streaming writes, crash recovery, search,
export. Plain SQLite, no Qt."""
from __future__ import annotations

import json

from app import store as S


def test_branches_alternatives_and_path(tmp_path):
    st = S.Store(tmp_path / "c.db")
    c = st.create_conversation("t")
    u1 = st.add_message(c, None, "user", "hello")
    a1 = st.add_message(c, u1, "assistant", "first answer")
    a2 = st.add_message(c, u1, "assistant", "second answer")          # regenerate
    assert [m.id for m in st.siblings(a1)] == [a1, a2]
    assert [m.content for m in st.path(c)] == ["hello", "second answer"]
    st.select(a1)
    assert [m.content for m in st.path(c)] == ["hello", "first answer"]
    u2 = st.add_message(c, a1, "user", "more")
    u2b = st.add_message(c, a1, "user", "edited more")                # edit = sibling, nothing deleted
    assert [m.content for m in st.path(c)][-1] == "edited more"
    st.select(u2)
    assert [m.content for m in st.path(c)] == ["hello", "first answer", "more"]
    # selecting a message follows its newest children down to a leaf
    a3 = st.add_message(c, u2b, "assistant", "x")
    st.select(a1)
    assert st.path(c)[-1].id == a3
    assert st.conversation(c).leaf_id == a3


def test_streamed_text_survives_a_crash(tmp_path):
    db = tmp_path / "c.db"
    st = S.Store(db)
    c = st.create_conversation()
    u = st.add_message(c, None, "user", "q")
    a = st.add_message(c, u, "assistant", "", state=S.STREAMING)
    for piece in ("Hel", "lo", " wor", "ld"):
        st.append_text(a, piece)
    # a second connection (as after a crash) sees every delta, and the row is marked interrupted
    st2 = S.Store(db)
    m = st2.message(a)
    assert m.content == "Hello world" and m.state == S.INTERRUPTED


def test_search_rename_pin_delete(tmp_path):
    st = S.Store(tmp_path / "c.db")
    a = st.create_conversation("Rust lifetimes")
    b = st.create_conversation("Dinner ideas")
    st.add_message(b, None, "user", "what about 100% pasta_al dente?")
    assert [c.id for c in st.list_conversations("lifetimes")] == [a]
    assert [c.id for c in st.list_conversations("PASTA")] == [b]          # message text, any case
    assert [c.id for c in st.list_conversations("100%")] == [b]           # % is literal
    assert st.list_conversations("_al") and not st.list_conversations("x_y")
    st.set_pinned(a, True)
    assert [c.id for c in st.list_conversations()][0] == a
    st.rename(b, "  ")
    assert st.conversation(b).title == "Untitled"
    st.delete_conversation(b)
    assert st.conversation(b) is None
    assert st.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id=?", (b,)).fetchone()[0] == 0


def test_export_markdown_and_json(tmp_path):
    st = S.Store(tmp_path / "c.db")
    c = st.create_conversation("Export me", system_prompt="Be brief.")
    u = st.add_message(c, None, "user", "2+2?", images=["/x/cat.png"])
    st.add_message(c, u, "assistant", "old")
    a = st.add_message(c, u, "assistant", "4")
    st.finish_message(a, S.DONE, {"generated_tokens": 1})
    md = st.export_markdown(c)
    assert md.startswith("# Export me") and "Be brief." in md and "## User" in md and "![image](/x/cat.png)" in md
    assert "4" in md and "old" not in md          # markdown is the current branch
    data = json.loads(json.dumps(st.export_json(c)))
    assert data["format"] == "trellis-chat"
    assert {m["content"] for m in data["messages"]} == {"2+2?", "old", "4"}   # JSON keeps every branch
    assert data["current_path"] == [u, a]
    assert [m for m in data["messages"] if m["id"] == a][0]["stats"] == {"generated_tokens": 1}
