#!/usr/bin/env bash
# The slurm tests run a real Slurm from Debian's packages: slurmctld, slurmd, the client commands and
# munge (Slurm's authentication). Install them when missing and we are root; otherwise do nothing: those
# tests then skip with the reason. Idempotent. The packages' own services are not started here (the
# tests start private daemons with their own config in a temporary directory).
set -u
have() { command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have sbatch && have munged; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! have apt-get; then
  echo "ci/install_slurm.sh: not root or no apt-get; the slurm tests will skip" >&2
  exit 0
fi
# Keep the packages' postinst from starting system-wide daemons (no init system here, and the tests
# run their own); restore whatever policy was there before.
policy=/usr/sbin/policy-rc.d
saved=""
if [ -e "$policy" ]; then saved=$(mktemp); cp -p "$policy" "$saved"; fi
printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy"
apt-get update -qq \
  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       slurmctld slurmd slurm-client munge >/dev/null \
  || echo "ci/install_slurm.sh: could not install Slurm; the slurm tests will skip" >&2
if [ -n "$saved" ]; then mv "$saved" "$policy"; else rm -f "$policy"; fi
exit 0
