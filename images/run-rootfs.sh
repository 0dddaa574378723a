#!/usr/bin/env bash
# Host mode on a host whose own Python is older than driverd needs (Ubuntu 22.04: 3.10): run driverd
# from the driver image's root file system, with its own interpreter (Debian 12's python3), and the
# host's / at /host, as the driver container sees it, without a container engine: a private mount
# namespace (unshare -m: nothing mounted here is visible to the host) and chroot.
#
#   images/build-image.sh --variant driver --out /var/lib/driverd/oci
#   umoci unpack --image /var/lib/driverd/oci:driver-0.1.0 /var/lib/driverd/bundle
#   images/run-rootfs.sh --rootfs /var/lib/driverd/bundle/rootfs -- daemon --root /host
#
# --host DIR binds DIR instead of / at /host (a test tree). $NOTIFY_SOCKET (systemd Type=notify) must be
# under the host root or abstract ('@name'); it is passed on as seen from inside (/host/...).
# Needs root and util-linux (unshare, mount, chroot).
set -euo pipefail
rootfs="" host=/
while [ $# -gt 0 ]; do
  case "$1" in
    --rootfs) rootfs=$2; shift 2;;
    --host) host=$2; shift 2;;
    --) shift; break;;
    -h|--help) sed -n '2,14p' "$0"; exit 0;;
    *) break;;
  esac
done
[ -n "$rootfs" ] || { echo "run-rootfs: --rootfs DIR is required (umoci unpack the driver image; DIR is its rootfs)" >&2; exit 2; }
[ -x "$rootfs/usr/local/bin/driverd" ] || { echo "run-rootfs: $rootfs has no /usr/local/bin/driverd; fix: unpack the image built by images/build-image.sh" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run-rootfs: run as root (mount namespaces and chroot need it)" >&2; exit 2; }
rootfs=$(readlink -f "$rootfs") host=$(readlink -f "$host")
if [ -n "${NOTIFY_SOCKET:-}" ]; then
  case "$NOTIFY_SOCKET" in
    @*) ;;
    *) if [ "$host" = / ]; then export NOTIFY_SOCKET="/host$NOTIFY_SOCKET"
       elif [ "${NOTIFY_SOCKET#"$host"/}" != "$NOTIFY_SOCKET" ]; then export NOTIFY_SOCKET="/host${NOTIFY_SOCKET#"$host"}"
       else echo "run-rootfs: NOTIFY_SOCKET $NOTIFY_SOCKET is outside the host root $host" >&2; exit 2; fi;;
  esac
fi
export DRIVERD_ROOT=/host
# shellcheck disable=SC2016
exec unshare -m --propagation private sh -euc '
  r=$1 h=$2; shift 2
  mkdir -p "$r/host" "$r/proc" "$r/sys" "$r/dev"
  mount --rbind "$h" "$r/host"
  mount -t proc proc "$r/proc"
  mount --rbind /sys "$r/sys"
  mount --rbind /dev "$r/dev"
  exec chroot "$r" /usr/local/bin/driverd "$@"' run-rootfs "$rootfs" "$host" "$@"
