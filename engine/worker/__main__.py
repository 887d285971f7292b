"""`python -m engine.worker`: the engine process. Protocol in engine/worker/protocol.py.

Stdout belongs to the protocol, so before anything else is imported the real stdout file
descriptor is duplicated for protocol lines and fd 1 is pointed at stderr: a stray print, a
library warning or a C extension writing to fd 1 lands in stderr instead of corrupting the stream.
"""
from __future__ import annotations

import io
import os
import sys


def main() -> int:
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out = io.TextIOWrapper(io.FileIO(protocol_fd, "w"), encoding="utf-8", newline="\n", write_through=True)
    from engine.worker.loop import Worker

    worker = Worker(out)
    try:
        worker.run(sys.stdin.buffer)
    except KeyboardInterrupt:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
