"""UI-thread cost of the chat transcript's updates as an answer starts and ends, in a long chat.

    QT_QPA_PLATFORM=offscreen python -m bench.transcript_redraw [--messages 80] [--reps 10]

The app's UI thread must keep turning while tokens stream (tests/app/test_chat_pane.py bounds it
at 50 ms of CPU a timer tick). An answer's start (the user's message and an empty answer appear)
and its end (the answer's final form and footer) update the transcript; until session 40 each did
a full redraw, which re-lays out the whole chat. Times, in the same run and on the same chat, the
partial updates the app makes now (Transcript.show_conversation) and the full redraw
(Transcript.redraw) they replace. CPU time of this thread, median over --reps answers; each answer
adds two messages. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ANSWER = ("Here is some **text** with `code` and a list:\n\n- one\n- two\n\n"
          "```python\nfor i in range(10):\n    print(i)\n```\n") * 3


def _cpu_ms(fn) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="chat transcript update cost (JSON line)")
    ap.add_argument("--messages", type=int, default=80, help="messages in the chat before the timed answers")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)

    from PySide6.QtWidgets import QApplication

    from app import store as S
    from app.views.transcript import Transcript

    app = QApplication.instance() or QApplication([])
    with tempfile.TemporaryDirectory() as tmp:
        store = S.Store(Path(tmp) / "chats.db")
        conv = store.create_conversation("long")
        parent = None
        for i in range(args.messages // 2):
            u = store.add_message(conv, parent, "user", f"question {i}")
            parent = store.add_message(conv, u, "assistant", f"answer {i}\n\n" + ANSWER)
            store.finish_message(parent, S.DONE, {"generated_tokens": 100})
        t = Transcript(store)
        t.resize(900, 700)
        t.show()
        t.show_conversation(conv)
        app.processEvents()
        start, finish, full = [], [], []
        for i in range(args.reps):
            u = store.add_message(conv, parent, "user", f"next question {i}")
            parent = store.add_message(conv, u, "assistant", "", state=S.STREAMING)
            start.append(_cpu_ms(lambda: t.show_conversation(conv, parent)))
            store.finish_message(parent, S.DONE, {"generated_tokens": 100}, content=ANSWER)
            finish.append(_cpu_ms(lambda: t.show_conversation(conv, None)))
            app.processEvents()
            full.append(_cpu_ms(t.redraw))      # the baseline: what each of the two did before
            app.processEvents()
        store.close()
    print(json.dumps({"bench": "transcript_redraw", "messages": args.messages, "reps": args.reps,
                      "answer_start_ms": round(statistics.median(start), 2),
                      "answer_finish_ms": round(statistics.median(finish), 2),
                      "full_redraw_ms": round(statistics.median(full), 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
