#!/usr/bin/env bash
# A throwaway single-node Ceph cluster with an S3 gateway, for the tests and benchmarks:
# one monitor, one manager, one OSD (memstore: objects in RAM), radosgw on 127.0.0.1, a
# user and a bucket. No systemd: plain background processes with their own config, run,
# log and data directories under DIR. Facts this relies on: ../shared/notes/ceph-rgw.md.
#
#   tools/ceph.sh start DIR [BUCKET]   starts it; writes DIR/s3.env (endpoint, keys, bucket)
#   tools/ceph.sh fs DIR               adds CephFS (an MDS) to it, mounted with ceph-fuse at
#                                      DIR/cephfs (prints the path)
#   tools/ceph.sh stop DIR             unmounts CephFS, kills it and removes DIR
#
# s3.env holds AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION and
# CKPTD_TEST_BUCKET, for `set -a; . DIR/s3.env`. Start takes ~2-6 s on 2 cores; the OSD keeps
# what is stored in memory (--memstore-bytes, 4 GiB by default).
set -euo pipefail

cmd=${1:?usage: tools/ceph.sh start|fs|stop DIR [BUCKET]}
dir=${2:?usage: tools/ceph.sh start|fs|stop DIR [BUCKET]}

stop() {
  # A ceph-fuse mount killed under its mount point would leave it unremovable.
  if [ -d "$dir/cephfs" ] && mountpoint -q "$dir/cephfs"; then
    umount "$dir/cephfs" 2>/dev/null || umount -l "$dir/cephfs" 2>/dev/null || true
  fi
  if [ -d "$dir/run" ]; then
    for pidfile in "$dir"/run/*.pid; do
      [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    done
  fi
  rm -rf "$dir"
}

# A port free now, outside the kernel's ephemeral range (tools/free_port.py says why).
free_port() {
  python3 "$(dirname "${BASH_SOURCE[0]}")/free_port.py"
}

wait_for() {  # wait_for SECONDS COMMAND...: retries COMMAND until it succeeds
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then echo "ceph.sh: timed out waiting for: $*" >&2; return 1; fi
    sleep 0.2
  done
}

start() {
  local bucket=${3:-ckptd-test}
  for tool in ceph-mon ceph-mgr ceph-osd radosgw radosgw-admin ceph; do
    command -v "$tool" >/dev/null || { echo "ceph.sh: $tool is missing (tools/setup.sh installs it)" >&2; exit 1; }
  done
  rm -rf "$dir"
  mkdir -p "$dir"/{run,log,mon,osd,mgr,rgw}
  dir=$(cd "$dir" && pwd)
  local fsid mon_port rgw_port
  fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
  mon_port=$(free_port)
  rgw_port=$(free_port)
  local memstore_bytes=${CKPTD_CEPH_MEMSTORE_BYTES:-4294967296}
  cat > "$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon_host = v2:127.0.0.1:$mon_port
keyring = $dir/keyring
run_dir = $dir/run
admin_socket = $dir/run/\$name.\$pid.asok
log_file = $dir/log/\$name.log
pid_file = $dir/run/\$name.pid
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
mon_data_avail_warn = 1
mon_data_avail_crit = 0
paxos_propose_interval = 0.05
osd_objectstore = memstore
memstore_device_bytes = $memstore_bytes
osd_data = $dir/osd
mon_data = $dir/mon
mgr_data = $dir/mgr
ms_bind_msgr1 = false
ms_bind_msgr2 = true
osd_crush_chooseleaf_type = 0
[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw_data = $dir/rgw
rgw_gc_obj_min_wait = 10
rgw_gc_processor_period = 10
rgw_dns_name = localhost
EOF
  local conf=(--conf "$dir/ceph.conf")
  # cephx, as any real cluster: radosgw refuses to run without it. One keyring for all.
  ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
    --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
  ceph-mon "${conf[@]}" --mkfs -i a --fsid "$fsid" --keyring "$dir/keyring" >/dev/null
  ceph-mon "${conf[@]}" -i a
  wait_for 30 ceph "${conf[@]}" -s
  ceph "${conf[@]}" auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' >> "$dir/keyring"
  ceph-mgr "${conf[@]}" -i x
  local osd
  osd=$(ceph "${conf[@]}" osd create)
  ceph "${conf[@]}" auth get-or-create "osd.$osd" mon 'allow profile osd' mgr 'allow profile osd' \
    osd 'allow *' >> "$dir/keyring"
  ceph-osd "${conf[@]}" -i "$osd" --mkfs >/dev/null 2>&1
  ceph-osd "${conf[@]}" -i "$osd"
  wait_for 30 bash -c "ceph --conf '$dir/ceph.conf' osd stat | grep -q '1 up'"
  ceph "${conf[@]}" auth get-or-create client.rgw mon 'allow rw' osd 'allow rwx' mgr 'allow rw' \
    >> "$dir/keyring"
  radosgw "${conf[@]}" -n client.rgw
  wait_for 60 curl -sf "http://127.0.0.1:$rgw_port/"
  local keys access secret
  keys=$(radosgw-admin "${conf[@]}" user create --uid=ckptd --display-name=ckptd)
  access=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["keys"][0]["access_key"])' <<<"$keys")
  secret=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["keys"][0]["secret_key"])' <<<"$keys")
  # The bucket, made by signing with curl the same way ckptd does.
  wait_for 30 curl -sf -X PUT --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "http://127.0.0.1:$rgw_port/$bucket"
  umask 077
  cat > "$dir/s3.env" <<EOF
AWS_ENDPOINT_URL_S3=http://127.0.0.1:$rgw_port
AWS_ACCESS_KEY_ID=$access
AWS_SECRET_ACCESS_KEY=$secret
AWS_REGION=us-east-1
CKPTD_TEST_BUCKET=$bucket
EOF
  echo "ceph.sh: S3 at http://127.0.0.1:$rgw_port, bucket $bucket ($dir/s3.env)"
}

# CephFS on the running cluster: an MDS, a data and a metadata pool, and a FUSE mount (the
# kernel client is not available on these machines: ../shared/notes/ceph-rgw.md).
fs() {
  for tool in ceph-mds ceph-fuse; do
    command -v "$tool" >/dev/null || { echo "ceph.sh: $tool is missing (tools/setup.sh installs it)" >&2; exit 1; }
  done
  [ -e /dev/fuse ] || { echo "ceph.sh: /dev/fuse is missing: no FUSE on this machine" >&2; exit 1; }
  dir=$(cd "$dir" && pwd)
  local conf=(--conf "$dir/ceph.conf")
  mkdir -p "$dir/mds" "$dir/cephfs"
  ceph "${conf[@]}" auth get-or-create mds.a mon 'allow profile mds' osd 'allow *' mds 'allow *' \
    mgr 'allow profile mds' >> "$dir/keyring"
  ceph-mds "${conf[@]}" -i a --mds-data "$dir/mds" >"$dir/log/mds.out" 2>&1
  ceph "${conf[@]}" osd pool create cephfs_metadata 8 >/dev/null 2>&1
  ceph "${conf[@]}" osd pool create cephfs_data 8 >/dev/null 2>&1
  ceph "${conf[@]}" fs new cephfs cephfs_metadata cephfs_data >/dev/null 2>&1
  wait_for 60 bash -c "ceph --conf '$dir/ceph.conf' mds stat | grep -q 'up:active'"
  ceph-fuse "${conf[@]}" "$dir/cephfs" >"$dir/log/ceph-fuse.out" 2>&1
  wait_for 30 mountpoint -q "$dir/cephfs"
  echo "$dir/cephfs"
}

case $cmd in
  start) start "$@" ;;
  fs) fs ;;
  stop) stop ;;
  *) echo "usage: tools/ceph.sh start|fs|stop DIR [BUCKET]" >&2; exit 2 ;;
esac
