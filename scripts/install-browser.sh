#!/usr/bin/env bash
# Install what the dashboard's browser test needs: Debian's chromium (Playwright's own browser
# downloads are not used) and the Playwright Python driver in the project's virtualenv.
# Idempotent and quiet: does nothing when both are already there. Run as root (CI images are).
set -euo pipefail

VENV="${VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"

if [ ! -x /usr/bin/chromium ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "playwright>=1.40"
fi
