#!/bin/bash
# alternating rounds: plain vs capped, f32 and bf16
bin=${RINGATTN_BIN:-target/release/ringattn}
out=$1; mkdir -p $out
for r in 1 2 3 4 5; do
 for dt in f32 bf16; do
  $bin bench --backend cpu --pass both --causal --dtype $dt --json $out/$dt-r$r.json >/dev/null 2>&1 || exit 1
  $bin bench --backend cpu --pass both --causal --dtype $dt --softcap 30 --json $out/$dt-softcap-r$r.json >/dev/null 2>&1 || exit 1
 done
done
python3 - $out <<'PY'
import json,sys,glob,statistics as st
out=sys.argv[1]
for dt in ['f32','bf16']:
  def tot(tag):
    v=[]
    for f in sorted(glob.glob(f"{out}/{dt}{tag}-r*.json")):
      j=json.load(open(f)); v.append(sum(r['median_ms'] for r in j['results']))
    return st.median(v)
  a,b=tot(''),tot('-softcap')
  print(dt, f"{a:.1f} -> {b:.1f} ms  +{(b/a-1)*100:.1f}%")
PY
