#!/usr/bin/env bash
# README's first command: set up .venv, synthesise the built-in corpus (with held-out dev and
# test speakers), train it on 1 worker and on 2 MPI ranks with periodic model averaging, decode
# both on the test set, and print the results table and their paired WER difference.
# Knobs (environment): HOURS (corpus size, default 1.0), EPOCHS (default 2), RANKS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
LABAVG=.venv/bin/labavg
HOURS=${HOURS:-1.0}
EPOCHS=${EPOCHS:-2}
RANKS=${RANKS:-2}
STAMP=$(date +%Y%m%d-%H%M%S)
RUNS=runs/quickstart-$STAMP

if [ ! -f data/synth/test/feats.scp ]; then
    echo "== synthesising ${HOURS} h of speech into data/synth (+ dev/ and test/ speakers)"
    $LABAVG corpus synth data/synth --hours "$HOURS" --overwrite
fi
echo "== 1 worker (the accuracy reference), then decoding dev/ and test/"
$LABAVG train --data data/synth --out "$RUNS/ranks1" --ranks 1 --epochs "$EPOCHS" \
    --decode-data data/synth
echo "== $RANKS MPI ranks, averaging every 10 minibatches, learning rate x $RANKS"
echo "   (the run measures its own speedup: a few times rank 0 trains alone, then all ranks)"
$LABAVG train --data data/synth --out "$RUNS/ranks$RANKS" --ranks "$RANKS" --backend mpi \
    --epochs "$EPOCHS" --average-every 10 --decode-data data/synth
echo
echo "== results"
$LABAVG info "$RUNS"/ranks*
echo
$LABAVG compare "$RUNS/ranks1" "$RUNS/ranks$RANKS"
echo
echo "Run directories: $RUNS/*  (events.jsonl, summary.json, tensorboard/)"
echo "Curves:          .venv/bin/tensorboard --logdir $RUNS"
echo "Tests:           .venv/bin/python -m pytest -q"
