#!/usr/bin/env bash
# The wheels as pip users install them (issue 45 item 2): tools/wheels.sh builds the
# manylinux wheels for CPython 3.10 to 3.13, whose tag must be the one docs/python.md names;
# each is installed into a fresh virtual environment of its own Python (pyenv's), with no
# PYTHONPATH or LD_LIBRARY_PATH, where tests/packaging/wheel_trainer.py (the bindings alone,
# no PyTorch) saves three steps through a running ckptd, is killed with SIGKILL, and a new
# process resumes the last step bit for bit. The 3.11 wheel also trains and resumes the
# example PyTorch trainer beside the project's PyTorch 2 (.venv), and does the same as the
# others in a bare
# Debian 12 (mmdebstrap minbase with python3-pip, none of the libraries the build links:
# checked), installed with that system's pip. ckptd is the build's, on the host; its socket's
# folder is mounted into the Debian 12 root at the same path (ckptd tells trainers the paths of
# its other sockets beside it).
# Root (a chroot), and Debian's archive reachable the first time (the root is kept in
# ~/.cache/ckptd). Prints "wheels: passed" at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d /tmp/ckptd-wheels.XXXXXX)
root=$work/root
cleanup() {
  [ -n "${trainer:-}" ] && kill -9 "$trainer" 2>/dev/null && wait "$trainer" 2>/dev/null || true
  [ -n "${daemon:-}" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  for m in "$work/sock" /dev /proc; do mountpoint -q "$root$m" && umount -l "$root$m"; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "wheels: FAILED: $*" >&2; exit 1; }

tools/wheels.sh "$work/dist" | tee "$work/wheels.out"
plat=$(sed -n 's/.*auditwheel show: //p' "$work/wheels.out" | sort -u)
[ "$(grep -c "auditwheel show: $plat" "$work/wheels.out")" = 4 ] || fail "not four wheels of one tag: $plat"
grep -q "\`$plat\`" docs/python.md || fail "docs/python.md does not name the wheels' tag $plat"
echo "wheels: tag $plat (docs/python.md says so)"

bazel build //daemon:ckptd //client:ckptctl 2>/dev/null
B=$(bazel info bazel-bin 2>/dev/null)
mkdir -p "$work/sock"
socket=$work/sock/ckptd.sock
"$B/daemon/ckptd" --root "$work/checkpoints" --socket "$socket" --staging-bytes 64M \
  --prefault-staging false > "$work/ckptd.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do "$B/client/ckptctl" --socket "$socket" health >/dev/null 2>&1 && break; sleep 0.1; done
"$B/client/ckptctl" --socket "$socket" health >/dev/null || { cat "$work/ckptd.log"; fail "ckptd did not start"; }

# save, SIGKILL, resume: RUN... runs wheel_trainer.py (then "SOCKET JOB save|resume"): a
# command that execs the trainer, so that SIGKILL hits it; the first line of each run
# must name where ckptd came from.
save_kill_resume() {
  local from=$1 job=$2 socket=$3
  shift 3
  "$@" "$socket" "$job" save > "$work/$job.save" 2>&1 &
  trainer=$!
  for _ in $(seq 1200); do grep -q "^saved 3" "$work/$job.save" && break; kill -0 "$trainer" 2>/dev/null || break; sleep 0.1; done
  grep -q "^saved 3" "$work/$job.save" || { cat "$work/$job.save"; fail "$job: the trainer did not save"; }
  kill -9 "$trainer"
  wait "$trainer" 2>/dev/null || true
  trainer=
  "$@" "$socket" "$job" resume > "$work/$job.resume" 2>&1 || { cat "$work/$job.resume"; fail "$job: resume failed"; }
  grep -q "^resumed step 3 bit-exact" "$work/$job.resume" || { cat "$work/$job.resume"; fail "$job: wrong values"; }
  for f in "$work/$job.save" "$work/$job.resume"; do
    grep -q "^ckptd from $from" "$f" || { cat "$f"; fail "$job: ckptd not imported from $from"; }
  done
  echo "wheels: $job: saved, killed, resumed bit-exact ($(head -n 1 "$work/$job.resume"))"
}

# Each wheel in a fresh virtual environment of its Python.
pyenv=${PYENV_ROOT:-$HOME/.pyenv}
for minor in 10 11 12 13; do
  python=$(ls -d "$pyenv"/versions/3.$minor.*/bin/python3 2>/dev/null | sort -V | tail -n 1)
  [ -x "$python" ] || fail "no Python 3.$minor under $pyenv/versions"
  venv=$work/venv3$minor
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --no-index --no-deps --disable-pip-version-check "$work"/dist/ckptd-*-cp3$minor-cp3$minor-$plat.whl
  native=$(ls "$venv"/lib/python3.$minor/site-packages/ckptd/_native*.so)
  # Every library from the wheel's own ckptd.libs, none from the build's system.
  ldd "$native" > "$work/ldd3$minor"
  ! grep -q "not found" "$work/ldd3$minor" || { cat "$work/ldd3$minor"; fail "3.$minor: a library is missing"; }
  awk -v venv="$venv/" '$1 ~ /^libgrpc\+\+-/ && index($3, venv) == 1 && $3 ~ /\/ckptd\.libs\//' "$work/ldd3$minor" | grep -q . ||
    { cat "$work/ldd3$minor"; fail "3.$minor: gRPC is not the wheel's own"; }
  # Run from $work, away from the sources, with nothing of the caller's environment.
  save_kill_resume "$venv/lib/python3.$minor/site-packages/ckptd/" "wheel-3$minor" "$socket" \
    env -i -C "$work" PATH=/usr/bin:/bin HOME="$work" "$venv/bin/python" "$PWD/tests/packaging/wheel_trainer.py"
done

# The 3.11 wheel beside the PyTorch a user has: the project's PyTorch 2 (.venv, a CUDA build),
# whose own libraries load in the same process as the wheel's; pip installs it into a
# folder of its own on PYTHONPATH, ahead of the build's. The example trainer saves every 10
# steps and a second run resumes from the last.
torch_python=${CKPTD_PYTHON:-$PWD/.venv/bin/python}
"$torch_python" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$work/torch-site" \
  "$work"/dist/ckptd-*-cp311-cp311-$plat.whl
torch_run=(env -i -C "$work" PATH=/usr/bin:/bin HOME="$work" PYTHONPATH="$work/torch-site" "$torch_python"
           "$PWD/client/python/examples/train_mlp.py" --socket "$socket" --job wheel-torch --steps 30 --save-every 10)
"${torch_run[@]}" > "$work/torch.save" 2>&1 || { cat "$work/torch.save"; fail "wheel-torch: training failed"; }
"${torch_run[@]}" --resume --steps 40 > "$work/torch.resume" 2>&1 || { cat "$work/torch.resume"; fail "wheel-torch: resume failed"; }
grep -q "^resumed from step 30" "$work/torch.resume" || { cat "$work/torch.resume"; fail "wheel-torch: did not resume from step 30"; }
version=$(env -i -C "$work" PYTHONPATH="$work/torch-site" "$torch_python" -c \
  'import torch, ckptd.torch; assert ckptd._native.__file__.startswith("'"$work/torch-site/"'"); print(torch.__version__)')
echo "wheels: wheel-torch: PyTorch $version saved, resumed from step 30 (ckptd from $work/torch-site)"

# The 3.11 wheel in a bare Debian 12: python3 and pip, kept between runs (the archive's).
base=${CKPTD_DEBIAN_PYTHON_TARBALL:-$HOME/.cache/ckptd/bookworm-minbase-python3-pip.tar}
if [ ! -s "$base" ]; then
  rm -rf "$base" "$base.part.tar"
  mkdir -p "$(dirname "$base")"
  # mmdebstrap picks the output's format by its name: the partial file must end in .tar.
  mmdebstrap --quiet --variant=minbase --include=python3-pip bookworm "$base.part.tar"
  mv "$base.part.tar" "$base"
fi
mkdir -p "$root"
tar -xf "$base" -C "$root"
built=$(find "$root/usr/lib" "$root/lib" -name 'libgrpc*' -o -name 'libprotobuf*' -o -name 'libabsl*' \
        -o -name 'libcurl*' -o -name 'libcudart*' -o -name 'libfmt*' 2>/dev/null || true)
[ -z "$built" ] || fail "the Debian 12 root holds libraries of the build: $built"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
cp "$work"/dist/ckptd-*-cp311-cp311-$plat.whl tests/packaging/wheel_trainer.py "$root/tmp/"
in_root=(chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root)
# Debian's python3 is externally managed (PEP 668): a user's pip install says so.
"${in_root[@]}" sh -c 'pip install -q --no-index --no-deps --break-system-packages --root-user-action=ignore /tmp/ckptd-*.whl'
mkdir -p "$root$work/sock"
mount --bind "$work/sock" "$root$work/sock"
save_kill_resume /usr/local/lib/python3.11/dist-packages/ckptd/ wheel-debian12 "$socket" \
  "${in_root[@]}" python3 /tmp/wheel_trainer.py
kill "$daemon"
wait "$daemon" || { cat "$work/ckptd.log"; fail "ckptd did not stop cleanly"; }
daemon=
echo "wheels: passed"
