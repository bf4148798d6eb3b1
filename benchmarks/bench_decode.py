"""Decoding time per second of audio at the default beam (one thread).

    python benchmarks/bench_decode.py RUN_DIR DATA_DIR [--acwt 0.1] [--beam 13]

RUN_DIR is a finished run (final.pt); DATA_DIR a data dir it can decode (e.g. the built-in
corpus' test/). Reports the search alone (FasterDecoder on the HLG) and the DNN forward pass
separately, each per second of audio (10 ms frames), as the median of 3 passes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from labavg.decode.decoder import DEFAULT_BEAM, Decoder
from labavg.decode.model import load_final_model
from labavg.decode.task import load_set, prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("data")
    parser.add_argument("--acwt", type=float, default=0.1)
    parser.add_argument("--beam", type=float, default=DEFAULT_BEAM)
    parser.add_argument("--lexicon")
    parser.add_argument("--lm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pathlib import Path

    model = load_final_model(args.run_dir)
    start = time.perf_counter()
    task = prepare(model, Path(args.data), lexicon=Path(args.lexicon) if args.lexicon else None,
                   lm=Path(args.lm) if args.lm else None, cache_dir=None)
    graph_s = time.perf_counter() - start
    test = load_set(task, Path(args.data))
    decoder = Decoder(task.hlg, beam=args.beam)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for x in test.loglikes:
            decoder.decode(x, args.acwt)
        times.append(time.perf_counter() - t0)
    audio = test.audio_seconds
    print(f"graph: {task.hlg.num_states} states, built in {graph_s:.2f} s")
    print(f"audio: {audio:.1f} s in {len(test.keys)} utterances")
    print(f"search at beam {args.beam:g}, acwt {args.acwt:g}: "
          f"{statistics.median(times) / audio:.5f} s per audio second")
    print(f"DNN forward (log-likelihoods): {test.seconds / audio:.5f} s per audio second")


if __name__ == "__main__":
    main()
