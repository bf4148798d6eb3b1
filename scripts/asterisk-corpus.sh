#!/usr/bin/env bash
# Debian's Asterisk prompts (one speaker, 8 kHz, CC-BY-SA-3.0) prepared as a real corpus:
#   bash scripts/asterisk-corpus.sh [OUT]      (default data/asterisk; needs root for apt)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-data/asterisk}"
if [ ! -f /usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz ]; then
    apt-get install -y -q asterisk-core-sounds-en-wav asterisk-core-sounds-en
fi
.venv/bin/python scripts/asterisk_corpus.py "$out" --overwrite
