#!/bin/bash
# SmolLM2 converter quality on the GPU machine (device tool), in two back-to-back calls because
# the GGUF (98 MB) is over the 64 MiB carry limit:
#   1. carry .devgguf/p0 (first 38 MB of the GGUF):  cp .devgguf/p0 /tmp/p0
#   2. within 30 s, carry .devgguf/p1 (the rest) and a folder holding austen.txt.gz and the gguf
#      wheel (GGUF_WHEEL, AUSTEN_GZ), then:            bash bench/convert_session.sh
# Writes $OUT/cq_measured.jsonl and $OUT/cq_heuristic.jsonl (bench.convert_quality JSON lines) and
# a summary in $OUT/log.txt. MBITS / HBITS choose the bpw lists; TL the seconds for both runs.
set -u
export PYTHONUNBUFFERED=1 TRELLIS_CACHE=${TRELLIS_CACHE:-/tmp/trellis-cache}
L=$OUT/log.txt
t0=$(date +%s)
if [ ! -s /tmp/smol.gguf ]; then
  if [ -f /tmp/p0 ] && [ -f .devgguf/p1 ]; then
    cat /tmp/p0 .devgguf/p1 > /tmp/smol.gguf.part && mv /tmp/smol.gguf.part /tmp/smol.gguf
  else
    echo "no GGUF: carry .devgguf/p0 in one call (cp to /tmp/p0), then .devgguf/p1 in the next" | tee -a $L
    exit 2
  fi
fi
# The machine's pip may belong to another interpreter: install for python3 itself, into /tmp.
python3 -m pip install --no-deps --no-index -q --target /tmp/pylib "${GGUF_WHEEL:?wheel path}" > /dev/null 2>&1
export PYTHONPATH=/tmp/pylib${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import gguf" || { echo "gguf did not install" | tee -a $L; exit 2; }
gunzip -c "${AUSTEN_GZ:?austen.txt.gz path}" > /tmp/austen.txt
TL=${TL:-560}
timeout $(( TL * 3 / 5 )) python3 -m bench.convert_quality --model /tmp/smol-bf16 --gguf /tmp/smol.gguf \
  --eval-text /tmp/austen.txt --out /tmp/cqm --bits ${MBITS:-4.0,3.0,2.0,5.0} --device cuda \
  --allocation measured 2>&1 | tee $OUT/cq_measured.jsonl | grep -E "^\{|bit alloc" | tee -a $L
timeout $(( TL - ($(date +%s) - t0) )) python3 -m bench.convert_quality --model /tmp/smol-bf16 \
  --eval-text /tmp/austen.txt --out /tmp/cqh --bits ${HBITS:-4.0,3.0} --device cuda \
  --allocation heuristic 2>&1 | tee $OUT/cq_heuristic.jsonl | grep -E "^\{" | tee -a $L
echo "== done $(( $(date +%s) - t0 ))s" | tee -a $L
