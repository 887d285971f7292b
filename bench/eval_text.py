"""Held-out evaluation text: Jane Austen's novels, from Debian's r-cran-janeaustenr package.

Austen is reserved for evaluation (never calibration), so quality numbers are measured on prose
the quantizer never saw. The package stores the novels as an R lazy-load database; we read it
with the `rdata` parser (pip) instead of requiring R.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb /tmp/ja
    python -m bench.eval_text --root /tmp/ja --out austen.txt
"""
from __future__ import annotations

import argparse
import gzip
import zlib
from pathlib import Path

DATA = "usr/lib/R/site-library/janeaustenr/data"
NOVELS = ["prideprejudice", "sensesensibility", "emma", "persuasion", "mansfieldpark", "northangerabbey"]


def read_novels(root: Path) -> dict[str, str]:
    import rdata

    d = Path(root) / DATA
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((d / "Rdata.rdx").read_bytes())))
    blob = (d / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (off, length) in index["variables"].items():
        off, length = int(off), int(length)
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[off + 4 : off + length])))
        novels[name] = "\n".join(str(x) for x in lines)
    return novels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="folder the .deb was extracted into")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    novels = read_novels(Path(args.root))
    text = "\n\n".join(novels[n] for n in NOVELS if n in novels)
    Path(args.out).write_text(text)
    print(f"{len(text)} characters from {len(novels)} novels -> {args.out}")


if __name__ == "__main__":
    main()
