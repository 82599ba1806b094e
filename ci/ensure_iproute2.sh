#!/usr/bin/env bash
# The netns tests build hosts with iproute2 (ip, tc). Install it from Debian's packages when it is
# missing and we are root; otherwise do nothing: those tests then skip with the reason.
set -u
if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null \
    || echo "ci/ensure_iproute2.sh: could not install iproute2; the netns tests will skip" >&2
fi
exit 0
