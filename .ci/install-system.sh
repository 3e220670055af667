#!/usr/bin/env bash
# System packages the tests use: Debian's SLURM + munge (the real-cluster test) and Chromium (the
# report's browser test). Installing is skipped when they are already there.
set -euo pipefail
need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld slurmd slurm-client munge)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-system: not root; skipping ${need[*]} (their tests will be skipped)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
