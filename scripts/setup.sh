#!/usr/bin/env bash
# Installs what cachefs, its tests and its benchmark need on a fresh Debian machine:
# FUSE from Debian, rclone (the benchmark's peer), Prometheus (promtool and the server the
# tests run against the deploy files), systemd-analyze (the unit's check), then the Python
# packages.
# Safe to run again: every step is a no-op once done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fusermount >/dev/null || need_apt+=(fuse)
command -v rclone >/dev/null || need_apt+=(rclone)
command -v promtool >/dev/null || need_apt+=(prometheus)
# systemd-analyze checks the unit (systemd is not PID 1 here; installing it starts nothing).
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: Prometheus's recommended exporters are not needed here.
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    # Where the package started its own server, stop it: the tests start theirs.
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl stop prometheus
    fi
fi

# torch first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore torch==2.13.0
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test,bench]' -e './client[fast]'
