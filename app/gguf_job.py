"""`python -m app.gguf_job GGUF OUT_DIR`: import a GGUF into an HF folder, printing progress lines.

Runs as its own process, started by the Library pane: the import needs torch and minutes of CPU,
and the app's UI process imports neither. Exit 0 on success; otherwise one line saying why."""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m app.gguf_job GGUF OUT_DIR", file=sys.stderr)
        return 2
    from engine.errors import TrellisError
    from engine.gguf_import import import_gguf

    last = [-1]

    def progress(done, total, name=""):
        pct = int(100 * done / max(total, 1))
        if pct != last[0] and pct % 5 == 0:
            last[0] = pct
            print(f"Importing: {pct}% ({name})", flush=True)

    try:
        out = import_gguf(argv[0], argv[1], progress=progress)
    except TrellisError as e:
        print(str(e), flush=True)
        return 1
    except OSError as e:
        print(f"import failed: {e.strerror or e}", flush=True)
        return 1
    print(f"Imported to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
