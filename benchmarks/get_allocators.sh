#!/usr/bin/env bash
# jemalloc and tcmalloc (Debian's builds) unpacked into .allocators/ without installing them,
# for `benchmarks/dlrm_throughput.py --allocators` (issue 31: which malloc keeps XLA:CPU's
# per-step temporaries off the page-fault path). Needs apt-get (any Debian / Ubuntu); prints
# the --allocators argument to use.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="$PWD/.allocators"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download libjemalloc2 libtcmalloc-minimal4 >/dev/null)
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
mkdir -p "$dest"
je="$(find "$tmp/x" -name 'libjemalloc.so.2' | head -1)"
tc="$(find "$tmp/x" -name 'libtcmalloc_minimal.so.4' | head -1)"
cp -L "$je" "$tc" "$dest/"
echo "--allocators=jemalloc=$dest/libjemalloc.so.2,tcmalloc=$dest/libtcmalloc_minimal.so.4"
