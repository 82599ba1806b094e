#!/usr/bin/env bash
# The browser test (`make test-browser`) loads the lighthouse status page in headless Chromium. Install
# Debian's `chromium` when it is missing and we are root; otherwise do nothing: that test then skips with
# the reason.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >/dev/null \
    || echo "ci/install_chromium.sh: could not install chromium; the browser test will skip" >&2
fi
exit 0
