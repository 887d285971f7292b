"""ChatSession: the rules of a chat, between the Store and the EngineClient.

Send, stop, regenerate, edit-and-branch and switching alternatives all reduce to "pick a parent
in the message tree, add a child, stream an answer into a new assistant row". The pane only
wires buttons to these methods and redraws on `changed`; all state lives in the Store, so a
crash of the engine or the app leaves every word that arrived on disk.
"""
from __future__ import annotations

import itertools
import time

from PySide6.QtCore import QObject, Signal

from app import store as S
from app.engine_client import EngineClient
from app.settings import PRESETS
from engine.worker import protocol as P

CHARS_PER_TOKEN = 4          # rough estimate when the engine has not counted a message yet
DEFAULT_MAX_TOKENS = 1024


def estimate_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN + 4


class ChatSession(QObject):
    changed = Signal(int)             # conversation id whose transcript changed (structure or text)
    streamed = Signal(int, str)       # message id, delta (cheap redraw hint)
    streaming_changed = Signal(bool)
    notice = Signal(str)              # a message for the person (not an error dialog)

    def __init__(self, store: S.Store, client: EngineClient, parent=None):
        super().__init__(parent)
        self.store = store
        self.client = client
        self.conv_id: int | None = None
        self.max_tokens = DEFAULT_MAX_TOKENS
        self._rids = itertools.count(1)
        self._stream: dict | None = None     # {rid, msg_id, conv_id, t0, t_first}
        client.token.connect(self._on_token)
        client.done.connect(self._on_done)
        client.error.connect(self._on_error)
        client.died.connect(self._on_died)

    # ------------------------------------------------------------------ state
    @property
    def streaming(self) -> bool:
        return self._stream is not None

    @property
    def streaming_message_id(self) -> int | None:
        return self._stream["msg_id"] if self._stream else None

    def open(self, conv_id: int | None) -> None:
        self.conv_id = conv_id
        self.changed.emit(conv_id or 0)

    def new_conversation(self, system_prompt: str = "") -> int:
        self.conv_id = self.store.create_conversation(system_prompt=system_prompt)
        self.changed.emit(self.conv_id)
        return self.conv_id

    def model_max_context(self) -> int:
        m = self.client.model or {}
        return int(m.get("max_context") or 0)

    def model_has_vision(self) -> bool:
        return bool((self.client.model or {}).get("vision"))

    def context_used(self) -> int:
        """Tokens the current branch would take: the engine's count where it gave one."""
        if self.conv_id is None:
            return 0
        conv = self.store.conversation(self.conv_id)
        total = estimate_tokens(conv.system_prompt) if conv and conv.system_prompt else 0
        path = self.store.path(self.conv_id)
        # The last finished answer knows the exact size of everything up to and including it.
        for i in range(len(path) - 1, -1, -1):
            st = path[i].stats
            if path[i].role == "assistant" and st.get("prompt_tokens"):
                exact = int(st["prompt_tokens"]) + int(st.get("generated_tokens", 0))
                return exact + sum(estimate_tokens(m.content) for m in path[i + 1:])
        return total + sum(estimate_tokens(m.content) for m in path)

    # ------------------------------------------------------------------ actions
    def send(self, text: str, images: list[str] | None = None) -> int | None:
        """Add a user message at the end of the current branch and stream an answer to it."""
        text = text.strip()
        if (not text and not images) or self.streaming:
            return None
        if self.conv_id is None or self.store.conversation(self.conv_id) is None:
            self.new_conversation()
        conv = self.store.conversation(self.conv_id)
        parent = conv.leaf_id
        if conv.title == "New chat" and not self.store.path(self.conv_id):
            self.store.rename(self.conv_id, _title_from(text))
        msg_id = self.store.add_message(self.conv_id, parent, "user", text, images=images or [])
        self._answer(msg_id)
        return msg_id

    def regenerate(self, assistant_id: int) -> None:
        """A new alternative answer beside `assistant_id` (the old one stays, as 1/2)."""
        m = self.store.message(assistant_id)
        if m is None or m.role != "assistant" or self.streaming or m.parent_id is None:
            return
        self._answer(m.parent_id)

    def edit(self, msg_id: int, new_text: str) -> None:
        """Branch: a sibling of the edited message with the new text; a user message is answered."""
        m = self.store.message(msg_id)
        if m is None or self.streaming or not new_text.strip():
            return
        new_id = self.store.add_message(m.conversation_id, m.parent_id, m.role, new_text.strip(), images=m.images)
        if m.role == "user":
            self._answer(new_id)
        else:
            self.changed.emit(m.conversation_id)

    def switch_alternative(self, msg_id: int, step: int) -> None:
        sibs = self.store.siblings(msg_id)
        ids = [s.id for s in sibs]
        if msg_id not in ids or self.streaming:
            return
        target = ids[(ids.index(msg_id) + step) % len(ids)]
        self.store.select(target)
        self.changed.emit(self.conv_id or 0)

    def stop(self) -> None:
        if self._stream:
            self.client.cancel(self._stream["rid"])

    # ------------------------------------------------------------------ generation
    def build_messages(self, upto: list[S.Message]) -> tuple[list[dict], list[str], bool]:
        """Messages for the engine, oldest dropped first when the estimate exceeds the context.

        Returns (messages, images of the last user message, whether anything was dropped)."""
        conv = self.store.conversation(self.conv_id)
        system = [{"role": "system", "content": conv.system_prompt}] if conv.system_prompt.strip() else []
        turns = [{"role": m.role, "content": m.content} for m in upto]
        limit = self.model_max_context()
        dropped = False
        if limit:
            budget = max(limit - min(self.max_tokens, limit // 2), limit // 4)
            cost = lambda ms: sum(estimate_tokens(x["content"]) for x in ms)
            while len(turns) > 1 and cost(system + turns) > budget:
                turns.pop(0)
                dropped = True
        images = list(upto[-1].images) if upto and upto[-1].role == "user" else []
        return system + turns, images, dropped

    def _answer(self, user_msg_id: int) -> None:
        conv_id = self.conv_id
        self.store.select(user_msg_id)
        upto = self.store.path(conv_id)
        messages, images, dropped = self.build_messages(upto)
        if dropped:
            self.notice.emit("The chat is longer than the model's context: the oldest messages were left out "
                             "of what the model sees (they stay in the chat).")
        if images and not self.model_has_vision():
            self.notice.emit(f"{(self.client.model or {}).get('name', 'The loaded model')} has no vision: "
                             f"the {len(images)} attached image(s) were not sent, only the text.")
            images = []
        conv = self.store.conversation(conv_id)
        preset = PRESETS.get(conv.preset, PRESETS["Balanced"])
        sampler = P.SamplerParams(temperature=preset.temperature, top_k=preset.top_k, top_p=preset.top_p,
                                  min_p=preset.min_p, repetition_penalty=preset.repetition_penalty)
        model_name = (self.client.model or {}).get("name", "")
        msg_id = self.store.add_message(conv_id, user_msg_id, "assistant", "", state=S.STREAMING, model=model_name)
        rid = f"chat-{conv_id}-{msg_id}-{next(self._rids)}"
        self._stream = {"rid": rid, "msg_id": msg_id, "conv_id": conv_id, "t0": time.monotonic(), "t_first": None,
                        "tokens": 0}
        self.streaming_changed.emit(True)
        self.changed.emit(conv_id)
        if not self.client.running or self.client.model is None:
            why = "The engine is not running." if not self.client.running else "No model is loaded: load one in the Library."
            self._finish(S.ERROR, {"error": why})
            self.notice.emit(why)
            return
        self.client.generate(rid, messages=messages, sampler=sampler, max_tokens=self.max_tokens, images=images)

    def _on_token(self, rid: str, text: str, tokens: int) -> None:
        s = self._stream
        if not s or rid != s["rid"]:
            return
        if s["t_first"] is None:
            s["t_first"] = time.monotonic()
        s["tokens"] = tokens
        self.store.append_text(s["msg_id"], text)
        self.streamed.emit(s["msg_id"], text)

    def _on_done(self, rid: str, done: P.Done) -> None:
        s = self._stream
        if not s or rid != s["rid"]:
            return
        stats = dict(done.stats.__dict__)
        stats["finish_reason"] = done.finish_reason
        if s["t_first"] is not None:
            stats["ttft_s"] = round(s["t_first"] - s["t0"], 4)
        stats["wall_s"] = round(time.monotonic() - s["t0"], 4)
        state = S.CANCELLED if done.finish_reason == P.FinishReason.CANCELLED else S.DONE
        # The engine's full text is authoritative (a stop string may have been cut from the tail).
        self._finish(state, stats, content=done.text if done.text or state == S.DONE else None)

    def _on_error(self, err: P.Error) -> None:
        s = self._stream
        if not s or err.request_id != s["rid"]:
            return
        self._finish(S.ERROR, {"error": err.message, "code": err.code})
        self.notice.emit(err.message)

    def _on_died(self, reason: str) -> None:
        if self._stream:
            self._finish(S.INTERRUPTED, {"error": reason})

    def _finish(self, state: str, stats: dict, content: str | None = None) -> None:
        s, self._stream = self._stream, None
        self.store.finish_message(s["msg_id"], state, stats, content=content)
        self.streaming_changed.emit(False)
        self.changed.emit(s["conv_id"])


def _title_from(text: str) -> str:
    """The first line with words in it, without Markdown punctuation, cut at 48 characters."""
    for line in text.splitlines():
        line = line.strip().lstrip("#>-*+ ").strip()
        if line.startswith("```") or line.startswith("~~~"):
            continue
        line = " ".join(line.replace("**", "").replace("`", "").split())
        if line:
            return line[:48] + ("…" if len(line) > 48 else "")
    return "Image chat" if not text.strip() else text.strip()[:48]
