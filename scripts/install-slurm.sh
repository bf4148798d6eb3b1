#!/usr/bin/env bash
# Install what the Slurm tests (tests/test_slurm.py) need: Debian's slurm-wlm (slurmctld, slurmd,
# srun, sbatch, scancel) and munge. The packages' own services are stopped and disabled: the
# tests start private daemons on a temp slurm.conf (scripts/slurm-up.sh) and must not meet a
# system cluster on the default ports. Idempotent and quiet. Run as root (CI images are).
set -euo pipefail

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # policy-rc.d 101: the packages' postinst must not start system daemons (no slurm.conf yet,
    # and a running system munged would hold the default socket the tests' own munged uses).
    # An existing policy-rc.d (Docker images ship one) is left as it is.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
