#!/usr/bin/env bash
# Builds driverd's container images without a registry or a container engine: the root file system
# from Debian packages (mmdebstrap), driverd and its Python dependencies from the project's own wheels,
# packed as an OCI image layout with umoci. The same script users run; tests/test_image.py runs the
# result with the real runc.
#
#   images/build-image.sh --variant driver  --out DIR [--tag T] [--packages REPO_DIR [--package NAME]...]
#   images/build-image.sh --variant builder --out DIR [--tag T] --kernel RELEASE [--source-package P]
#
# driver  : the driver container (DaemonSet): python3, kmod, openssl (signed repository indexes),
#           driverd and kubectl-driverd; entrypoint
#           `driverd container-entrypoint --root /host`. With --packages, the precompiled packages of a
#           repository directory (e.g. the build-matrix output for one kernel) are baked in at
#           /opt/driverd/packages and used as the default repository (file://): its index and the
#           package files the index names (or only each --package NAME), checked against the index's
#           size and sha256 — nothing else of the directory (images/bake-packages.py).
# builder : one build-matrix cell's image: the driver container plus the compiler, ccache (the Job's pods
#           compile through a shared cache), the kernel's headers
#           (linux-headers-RELEASE) and NVIDIA's kernel-module sources (nvidia-open-kernel-source /
#           nvidia-kernel-source, from Debian's non-free), entrypoint `driverd build`.
#
# The Debian mirror is the machine's own (from its apt sources); no host name is written here. apt
# checks every Debian package against the archive's signed Release files. Every Python package comes
# from images/requirements*.txt, pinned and hashed (tools/pin_image_requirements.py): pip runs with
# --require-hashes, so a wheel that differs from the pinned one fails the build.
# Needs root, mmdebstrap, umoci, python3 with venv. Build time and size are printed at the end.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."
variant=driver out="" tag="" packages="" kernel="" suite=bookworm
package_names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant=$2; shift 2;;
    --out) out=$2; shift 2;;
    --tag) tag=$2; shift 2;;
    --packages) packages=$2; shift 2;;
    --package) package_names+=("$2"); shift 2;;
    --kernel) kernel=$2; shift 2;;
    --suite) suite=$2; shift 2;;
    -h|--help) sed -n '2,25p' "$0"; exit 0;;
    *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
[ -n "$out" ] || { echo "build-image: --out DIR is required (an OCI image layout is written there)" >&2; exit 2; }
case "$out" in /*) ;; *) out=$here/$out;; esac              # paths are the caller's, not the checkout's
case "$packages" in /*|"") ;; *) packages=$here/$packages;; esac
[ ${#package_names[@]} = 0 ] || [ -n "$packages" ] || { echo "build-image: --package NAME needs --packages REPO_DIR" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "build-image: run as root (mmdebstrap and umoci unpack need it)" >&2; exit 2; }
for t in mmdebstrap umoci; do
  command -v $t >/dev/null || { echo "build-image: $t is missing; fix: apt-get install $t" >&2; exit 2; }
done
case "$variant" in
  driver) extra="";;
  builder)
    [ -n "$kernel" ] || { echo "build-image: --variant builder needs --kernel RELEASE" >&2; exit 2; }
    extra=",build-essential,libelf-dev,ccache,linux-headers-$kernel,nvidia-open-kernel-source,nvidia-kernel-source";;
  *) echo "build-image: --variant is driver or builder, not $variant" >&2; exit 2;;
esac
version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
tag=${tag:-$variant-$version}
start=$(date +%s)
uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '/^deb /{for(i=2;i<=NF;i++) if ($i ~ /:\/\//) {print $i; exit}}' /etc/apt/sources.list)
[ -n "$uri" ] || { echo "build-image: no Debian mirror in this machine's apt sources" >&2; exit 2; }
work=$(mktemp -d /var/tmp/driverd-image.XXXXXX)
trap 'rm -rf "$work"' EXIT

# 0. --packages first (a refusal costs nothing): the index and the packages it names (or the ones asked
#    for), each checked against the index's size and sha256 — never the rest of the directory.
if [ -n "$packages" ]; then
  python3 images/bake-packages.py --out "$work/packages" "$packages" ${package_names[@]+"${package_names[@]}"}
fi

# pip from a clean virtualenv: the machine's own site-packages play no part in what goes into the image.
python3 -m venv "$work/pip"
pip="$work/pip/bin/python -m pip"

# 1. driverd as a wheel (pure Python; its dependencies come as binary wheels for the image's Python below),
#    from a clean copy of the tree: setuptools reuses ./build/, which would carry files deleted since. The
#    build backend is the pinned, hashed setuptools, not whatever build isolation would fetch.
mkdir "$work/src"
tar --exclude-vcs --exclude=./.venv --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ \
  --exclude=./.sandbox --exclude=./.pytest_cache -cf - . | tar -xf - -C "$work/src"
$pip install --quiet --disable-pip-version-check --require-hashes -r images/requirements-build.txt \
  2>&1 | { grep -v "^WARNING: Location" || true; }
$pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps -w "$work/wheels" "$work/src" \
  2>&1 | { grep -v "^WARNING: Location" || true; }
whl=$(echo "$work"/wheels/driverd-*.whl)
echo "$whl --hash=sha256:$(sha256sum "$whl" | cut -d' ' -f1)" > "$work/driverd-wheel.txt"

# 2. the root file system from Debian packages.
components="main"
[ "$variant" = builder ] && components="main contrib non-free non-free-firmware"
mmdebstrap --quiet --variant=essential --components="$components" \
  --include="python3,kmod,ca-certificates,zstd,xz-utils,util-linux,openssl$extra" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  "$suite" "$work/rootfs" "deb $uri $suite $components" "deb $uri $suite-updates $components"
# driverd and its dependencies for the image's own Python (its version and this machine's architecture),
# not for whatever Python runs this script; installed beside it, away from the distribution's packages.
# Every file is hashed: the pinned dependencies (images/requirements.txt), and driverd's wheel from step 1.
pyver=$(chroot "$work/rootfs" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
$pip install --quiet --disable-pip-version-check --no-compile --require-hashes \
  --target "$work/rootfs/opt/driverd/lib" --python-version "$pyver" --implementation cp \
  --platform "manylinux2014_$(uname -m)" --only-binary=:all: \
  -r images/requirements.txt -r "$work/driverd-wheel.txt" \
  2>&1 | { grep -v "^WARNING: \(Location\|Running pip as\)" || true; }
cat > "$work/rootfs/usr/local/bin/driverd" <<'SH'
#!/bin/sh
PYTHONPATH=/opt/driverd/lib exec /usr/bin/python3 -m driverd "$@"
SH
cat > "$work/rootfs/usr/local/bin/kubectl-driverd" <<'SH'
#!/bin/sh
PYTHONPATH=/opt/driverd/lib exec /usr/bin/python3 -c 'import sys; from driverd.cli import kubectl_main; sys.exit(kubectl_main())' "$@"
SH
chmod 0755 "$work/rootfs/usr/local/bin/driverd" "$work/rootfs/usr/local/bin/kubectl-driverd"
if [ -n "$packages" ]; then
  mv "$work/packages" "$work/rootfs/opt/driverd/packages"
  repos="file:///opt/driverd/packages"
fi

# 3. an OCI image layout with one layer and the entrypoint.
rm -rf "$out"
umoci init --layout "$out"
umoci new --image "$out:$tag"
umoci unpack --image "$out:$tag" "$work/bundle" >/dev/null
rm -rf "$work/bundle/rootfs" && mv "$work/rootfs" "$work/bundle/rootfs"
umoci repack --image "$out:$tag" "$work/bundle"
if [ "$variant" = driver ]; then
  entry=(--config.entrypoint /usr/local/bin/driverd --config.cmd container-entrypoint --config.cmd --root --config.cmd /host)
else
  entry=(--config.entrypoint /usr/local/bin/driverd --config.cmd build)
fi
# The driver container sees the host at /host; a builder (a build-matrix pod) builds for its own headers
# and has no /host.
[ "$variant" = driver ] && entry+=(--config.env DRIVERD_ROOT=/host)
umoci config --image "$out:$tag" "${entry[@]}" \
  --config.env PYTHONUNBUFFERED=1 \
  ${repos:+--config.env DRIVERD_PACKAGES_REPOSITORIES=$repos} \
  --config.label org.opencontainers.image.title=driverd-$variant \
  --config.label org.opencontainers.image.version="$version" \
  ${kernel:+--config.label io.driverd.kernel=$kernel}
umoci gc --layout "$out"
size=$(du -sb "$out" | cut -f1)
echo "built $out:$tag ($variant) in $(( $(date +%s) - start ))s, $(( size / 1048576 )) MiB compressed"
