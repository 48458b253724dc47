#!/usr/bin/env bash
# The main job, end to end on this machine: starts ckptd with defaults in a temporary
# directory, trains the example trainer (2 ranks), kills it part-way with SIGKILL, resumes
# it, and shows `ckptctl status` and `ckptctl list`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //daemon:ckptd //client:ckptctl //client:example_trainer

work=$(mktemp -d /tmp/ckptd-demo.XXXXXX)
bin=bazel-bin
sock=$work/ckptd.sock
cleanup() { [ -n "${daemon_pid:-}" ] && kill "$daemon_pid" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT

echo "== starting ckptd (root $work/root, socket $sock)"
$bin/daemon/ckptd --root "$work/root" --socket "$sock" --staging-bytes 1G 2>"$work/ckptd.log" &
daemon_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done

train() {  # rank, extra args...; exec so that $! is the trainer itself
  local rank=$1; shift
  exec $bin/client/example_trainer --socket "$sock" --job demo --rank "$rank" --world-size 2 \
    --steps 60 --save-every 10 --state-bytes 64000000 "$@"
}

echo "== reference run of rank 0 without ckptd checkpoints (job ref)"
want=$($bin/client/example_trainer --socket /nonexistent --job ref --steps 60 --save-every 10 \
        --state-bytes 64000000 2>/dev/null | grep 'final checksum')
echo "   $want"

echo "== training 2 ranks, SIGKILL once step 30 is committed"
train 0 --step-sleep-ms 50 >"$work/r0.log" 2>&1 & r0=$!
train 1 --step-sleep-ms 50 >"$work/r1.log" 2>&1 & r1=$!
until grep -q "committed step=30" "$work/r0.log"; do sleep 0.05; done
kill -9 $r0 $r1; wait $r0 $r1 2>/dev/null || true
tail -n 2 "$work/r0.log" | sed 's/^/   rank 0: /'

echo "== resuming"
train 0 --resume >"$work/r0b.log" 2>&1 & r0=$!
train 1 --resume >"$work/r1b.log" 2>&1 & r1=$!
wait $r0 $r1
grep -E "resumed|final" "$work/r0b.log" | sed 's/^/   rank 0: /'
if [ "$(grep 'final checksum' "$work/r0b.log")" = "$want" ]; then
  echo "   resumed run matches the uninterrupted run bit for bit"
else
  echo "   MISMATCH against the uninterrupted run" >&2; exit 1
fi

echo "== ckptctl status"
$bin/client/ckptctl --socket "$sock" status
echo "== ckptctl list"
$bin/client/ckptctl --socket "$sock" list
echo "== files: $work/root/demo"
ls "$work/root/demo"
