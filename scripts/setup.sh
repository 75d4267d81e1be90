#!/usr/bin/env bash
# Installs what cachefs, its tests and its benchmark need on a fresh Debian machine:
# FUSE from Debian, rclone (the benchmark's peer), then the Python packages.
# Safe to run again: every step is a no-op once done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fusermount >/dev/null || need_apt+=(fuse)
command -v rclone >/dev/null || need_apt+=(rclone)
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# torch first and pinned: an unpinned torch pulls gigabytes of CUDA packages.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore torch==2.13.0
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test,bench]' -e './client[fast]'
