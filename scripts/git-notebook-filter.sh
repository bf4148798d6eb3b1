#!/usr/bin/env bash
# Commit notebooks without their outputs: JupyterLab's autosave writes a class's runs (several MB
# of outputs and widget state) into the tracked notebooks, and a student's `git pull` conflicted.
# Sets nbstripout as the clean filter that .gitattributes names, in this clone's git config
# (--keep-id: the cells keep their ids). Run by scripts/setup.sh; nothing to do outside a clone.
set -euo pipefail
PYTHON=${PYTHON:-"$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"}
git rev-parse --git-dir >/dev/null 2>&1 || exit 0
git config filter.nbstripout.clean "\"$PYTHON\" -m nbstripout --keep-id"
git config filter.nbstripout.smudge cat
git config diff.ipynb.textconv "\"$PYTHON\" -m nbstripout -t --keep-id"
