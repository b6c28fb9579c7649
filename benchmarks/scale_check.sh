#!/bin/bash
# One call of the device tool for issue #16 (Scale) and the CUDA regression check, on a
# machine with a core per rank (the lent GPU machine: 16 cores). In order, each step with
# its own time limit inside an overall budget ($SCALE_BUDGET_S, default 540 s):
#   1. what the machine has (cores, kernel, ip/tc, network namespaces);
#   2. the CUDA build and the GPU tests (as benchmarks/gpu_check.sh) -- skipped with
#      SCALE_SKIP_CUDA=1, which builds the CPU extension instead;
#   3. #16 item 1: ring and sharded busbw against the raw-TCP line, 2 and 4 hosts, 16/64 MiB;
#      and 2 hosts with 4 streams per peer and 4 I/O threads;
#   4. #16 item 6: dense vs top-k step time behind 1 Gbit/s tbf, 2 and 4 ranks;
#   5. #16 item 4: auto, ring and sharded at 4 hosts behind 1 Gbit/s tbf, 1-16 MiB;
#   6. the CPU-side tests of the CUDA build, in what time is left;
#   7. (only when SCALE_STEPS names it) tcp-variants: the 2- and 4-host ring at 64 MiB with
#      the raw-TCP line sent by send(2) copies as well as sendfile(2), and with other
#      segment sizes, streams and I/O threads: where the ring's time goes on a fast link;
#   8. (only when SCALE_STEPS names it) threads: the ring's CPU per call and per thread
#      (benchmarks/call_cost.py --threads, loopback, 2 and 4 ranks, 64 MiB), by default and
#      with 2 streams and 2 I/O threads: is one thread (the I/O thread, the caller that
#      reduces) busy all the time, with cores to spare?
#   9. (only when SCALE_STEPS names it) ab: a change against its base in one call. The
#      base is a copy of the older tree in $SCALE_BASE (default .base, carried like .ipr;
#      made here with `git archive BASE setup.py csrc pycomm benchmarks/call_cost.py |
#      tar -x -C .base`), built beside this one; then, alternating base and change
#      $SCALE_AB_REPS times (default 2): call_cost.py --threads for the ring on 4 and 2
#      ranks (64 MiB, loopback) and pycomm-bench --hosts 4 and 2, ring, 16 and 64 MiB.
# SCALE_STEPS picks steps 2-9 by name (default: cuda,hosts,compression,hosts-1gbit,cpu-tests).
# Logs go to /tmp/scale-logs and, packed after every step, to $1/scale.tar.gz (default
# $1: $OUT, else .): the device tool brings back at most 8 files, and what a step killed
# at the call's limit had written still comes back. SCALE_NO_BUILD=1 uses the extension
# already built (a local dry run). Without `ip` on the PATH, a folder of iproute2 binaries
# in $SCALE_IPROUTE (default .ipr: bin/ip, bin/tc wrappers) is used when present; the GPU
# machine's image has no iproute2. Made here on Debian, carried with the device tool's
# `carry: [".ipr"]` (the wrappers run the binaries through the dynamic loader with the
# carried libraries, so nothing they start inherits those libraries):
#   echo /.ipr/ >> .git/info/exclude; mkdir -p .ipr/debs .ipr/bin && cd .ipr/debs
#   apt-get download iproute2 libbpf1 libbsd0 libcap2 libdb5.3 libelf1 libmnl0 libselinux1 \
#     libtirpc3 libxtables12 libmd0 libpcre2-8-0 libzstd1 zlib1g libgssapi-krb5-2 libkrb5-3 \
#     libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
#   cd .. && for f in debs/*.deb; do dpkg -x $f root; done && rm -r debs
#   for t in bin/ip sbin/tc; do printf '#!/bin/sh\nR=$(dirname "$(readlink -f "$0")")/../root\nexec /lib64/ld-linux-x86-64.so.2 --library-path "$R/lib/x86_64-linux-gnu:$R/usr/lib/x86_64-linux-gnu" "$R/%s" "$@"\n' $t > bin/${t#*/}; chmod +x bin/${t#*/}; done
#   (root/sbin/ip is an absolute link to /bin/ip, which does not travel: use root/bin/ip)
set -u
dest=${1:-${OUT:-.}}
out=/tmp/scale-logs
rm -rf "$out"; mkdir -p "$out" "$dest"
pack() { tar -czf "$dest/scale.tar.gz" -C /tmp scale-logs; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export CXX=${PYCOMM_CXX:-/usr/bin/g++} CC=${PYCOMM_CC:-/usr/bin/gcc}
start=$(date +%s)
budget=${SCALE_BUDGET_S:-540}
# left LIMIT: the smaller of LIMIT and the seconds left in the budget (less 10 s to write up)
left() { local l=$(( budget - ($(date +%s) - start) - 10 )); (( l > $1 )) && l=$1; (( l < 1 )) && l=1; echo $l; }
steps=",${SCALE_STEPS:-cuda,hosts,compression,hosts-1gbit,cpu-tests},"
want() { [[ $steps == *",$1,"* ]]; }
step() { pack; echo "== $(( $(date +%s) - start )) s: $*"; }

carried=""
if ! command -v ip >/dev/null && [ -x "${SCALE_IPROUTE:-.ipr}/bin/ip" ]; then
  export PATH=$PWD/${SCALE_IPROUTE:-.ipr}/bin:$PATH
  carried="using carried iproute2"
fi

step "machine"
{
  nproc; uname -r; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  [ -n "$carried" ] && echo "$carried"
  command -v ip tc mpirun
  ip netns add scalecheck$$ && ip netns exec scalecheck$$ ip link set lo up && echo "netns OK"
  ip netns del scalecheck$$ 2>/dev/null
  uptime
} 2>&1 | tee "$out/machine.txt"

if [ "${SCALE_NO_BUILD:-0}" = 1 ]; then
  step "no build (SCALE_NO_BUILD=1)"
elif [ "${SCALE_SKIP_CUDA:-0}" = 1 ] || ! want cuda; then
  rm -rf build pycomm/_C*.so
  step "CPU build"
  PYCOMM_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; pack; exit 1; }
else
  step "CUDA build"
  rm -rf build pycomm/_C*.so
  PYCOMM_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    python3 setup.py build_ext --inplace > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; pack; exit 1; }
  python3 -c "import pycomm; assert pycomm.built_with_cuda() and pycomm.cuda_available(); print('pycomm CUDA build OK')" \
    || { tail -40 "$out/build.log"; pack; exit 1; }
  step "GPU tests"
  timeout $(left 150) python3 -m pytest -q -rs -p no:cacheprovider --timeout 100 -m gpu tests/ 2>&1 \
    | tee "$out/gpu_tests.log" | tail -6
fi

bench() {  # bench NAME ARGS...: one pycomm-bench run, output to $out/NAME.txt / .json
  local name=$1; shift
  step "$name: pycomm-bench $*"
  timeout $(left 90) python3 -m pycomm.bench "$@" --json "$out/$name.json" > "$out/$name.txt" 2>&1
  echo "exit $?"; grep -E "raw TCP|^ +[0-9]+ " "$out/$name.txt" | head -12
}
if want hosts; then
bench hosts2 --hosts 2 -b 16M -e 64M -f 4 --algos ring,sharded --peer none
bench hosts4 --hosts 4 -b 16M -e 64M -f 4 --algos ring,sharded --peer none
PYCOMM_SOCKETS_PER_PEER=4 PYCOMM_IO_THREADS=4 bench hosts2_4streams --hosts 2 -b 16M -e 64M -f 4 --algos ring --peer none
fi

if want compression; then
step "compression, 1 Gbit/s"
timeout $(left 150) python3 benchmarks/compression_digits.py --tasks digits-sgd --worlds '' --slow-rates 1gbit \
  --slow-worlds 2,4 --repeat 3 --configs "dense,topk 1% EF,topk 1% EF fused" --out "$out/compression_1gbit" \
  > "$out/compression_1gbit.log" 2>&1
echo "exit $?"; grep -E "^\| netns" "$out/compression_1gbit.md" 2>/dev/null | head -12
fi

want hosts-1gbit && bench hosts4_1gbit --hosts 4 --rate 1gbit -b 1M -e 16M -f 4 --algos auto,ring,sharded --peer none

if want tcp-variants; then
  ring64() { bench "$@" -b 64M -e 64M --algos ring --peer none; }
  for h in 2 4; do
    ring64 v${h}_base --hosts $h
    PYCOMM_BENCH_LINK_SEND=copy ring64 v${h}_refcopy --hosts $h
    PYCOMM_SEGMENT_BYTES=1048576 ring64 v${h}_seg1m --hosts $h
    PYCOMM_SEGMENT_BYTES=4194304 ring64 v${h}_seg4m --hosts $h
    PYCOMM_SOCKETS_PER_PEER=1 PYCOMM_IO_THREADS=2 ring64 v${h}_s1t2 --hosts $h
    PYCOMM_SOCKETS_PER_PEER=2 PYCOMM_IO_THREADS=2 ring64 v${h}_s2t2 --hosts $h
    PYCOMM_SOCKETS_PER_PEER=2 PYCOMM_IO_THREADS=2 PYCOMM_BENCH_LINK_SEND=copy ring64 v${h}_s2t2_refcopy --hosts $h
    PYCOMM_SOCKETS_PER_PEER=2 PYCOMM_IO_THREADS=2 PYCOMM_SEGMENT_BYTES=1048576 ring64 v${h}_s2t2_seg1m --hosts $h
  done
fi

if want threads; then
  step "#16 item 1: the ring's CPU per thread (call_cost.py --threads)"
  for r in 2 4; do
    for knobs in "" "PYCOMM_SOCKETS_PER_PEER=2 PYCOMM_IO_THREADS=2"; do
      echo "## ranks $r ${knobs:-defaults}" | tee -a "$out/threads.txt"
      env $knobs timeout $(left 90) python3 benchmarks/call_cost.py --algo ring --mib 64 --ranks $r --iters 20 \
        --threads 2>&1 | tee -a "$out/threads.txt"
    done
  done
fi

if want ab; then
  base=$PWD/${SCALE_BASE:-.base}
  step "ab: build the base ($base)"
  (cd "$base" && rm -rf build pycomm/_C*.so && PYCOMM_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-16} \
    python3 setup.py build_ext --inplace > "$out/build_base.log" 2>&1) || { tail -20 "$out/build_base.log"; pack; exit 1; }
  for rep in $(seq "${SCALE_AB_REPS:-2}"); do
    for side in base change; do
      dir=$PWD; [ $side = base ] && dir=$base
      for r in 4 2; do
        step "ab $rep $side: call_cost ring $r ranks"
        echo "## rep $rep $side ranks $r" >> "$out/ab_threads.txt"
        (cd "$dir" && PYTHONPATH=$dir timeout $(left 60) python3 benchmarks/call_cost.py --algo ring --mib 64 \
          --ranks $r --iters 20 --threads) >> "$out/ab_threads.txt" 2>&1
        tail -$((2 * r)) "$out/ab_threads.txt" | grep -E "^rank [0-9]+:" | sed -E 's/, (user|minor|voluntary|involuntary)[^,]*//g'
      done
      for h in 4 2; do
        step "ab $rep $side: pycomm-bench --hosts $h"
        (cd "$dir" && PYTHONPATH=$dir timeout $(left 60) python3 -m pycomm.bench --hosts $h -b 16M -e 64M -f 4 \
          --algos ring --peer none) > "$out/ab_${side}_${rep}_hosts$h.txt" 2>&1
        echo "exit $?"; grep -E "raw TCP,|^ +[0-9]+ " "$out/ab_${side}_${rep}_hosts$h.txt" | sed -E 's/\(each rank.*\): //'
      done
    done
  done
fi

if want cpu-tests && [ "${SCALE_SKIP_CUDA:-0}" != 1 ] && [ "${SCALE_NO_BUILD:-0}" != 1 ]; then
  step "CPU-side tests of the CUDA build"
  timeout $(left 200) python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/kernels/test_kernels.py \
    tests/kernels/test_cuda_build.py tests/hooks/test_hooks.py tests/backend/test_errors.py 2>&1 | tee "$out/cpu_tests.log" | tail -4
fi
ip netns list 2>/dev/null | grep -E "^pcm" && echo "WARNING: namespaces left behind"
step "done"
