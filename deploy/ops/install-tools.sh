#!/usr/bin/env bash
# The operations tools the tests run for real: Prometheus and promtool (Debian's `prometheus`) and a
# headless browser (Debian's `chromium`). Idempotent: installs only what is missing. Needs root and
# apt (Debian); elsewhere it says what is missing and fails, so no test silently skips.
set -euo pipefail

missing=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-tools.sh: install ${missing[*]} (Debian packages of the same names)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
