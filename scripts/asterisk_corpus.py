"""Debian's Asterisk prompts (568 recordings, one speaker, 8 kHz) as a real corpus: train, dev, test.

    apt-get install -y asterisk-core-sounds-en-wav asterisk-core-sounds-en   (scripts/asterisk-corpus.sh)
    .venv/bin/python scripts/asterisk_corpus.py data/asterisk [--sounds DIR] [--transcripts FILE]

Reads the prompts' transcripts (core-sounds-en.txt.gz: `name: text`), keeps the spoken ones
(bracketed tone descriptions and silence/ are not speech), writes each word as CMUdict spells it
(lower case; `*` star, `#` pound, a lone digit as its word), splits by prompt (a hash of its name:
10 % test, 10 % dev, the rest train) and prepares each split with labavg.data.prepare into
OUT (train), OUT/dev and OUT/test, the layout of the built-in corpus. Prompts with words outside
CMUdict (multi-digit numbers, names) are left out and listed in each split's left_out.txt.
The recordings are by Allison Smith, CC-BY-SA-3.0 (/usr/share/doc/asterisk-core-sounds-en/copyright).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labavg.data.prepare import prepare_corpus  # noqa: E402

SOUNDS = Path("/usr/share/asterisk/sounds/en_US_f_Allison")
TRANSCRIPTS = Path("/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
DIGITS = "zero one two three four five six seven eight nine".split()
SYMBOLS = {"*": "star", "#": "pound"}


def words_of(text: str) -> list[str]:
    words = []
    for token in re.findall(r"[A-Za-z']+|\d+|[*#]", text):
        if token in SYMBOLS:
            words.append(SYMBOLS[token])
        elif token.isdigit() and len(token) == 1:
            words.append(DIGITS[int(token)])
        else:
            words.append(token.lower().strip("'"))
    return [w for w in words if w]


def read_prompts(path: Path, sounds: Path) -> dict[str, list[str]]:
    """name -> words of every spoken prompt that has a recording."""
    prompts = {}
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            name, colon, text = line.partition(":")
            name = name.strip()
            if not colon or line.startswith(";") or text.strip().startswith("[") \
                    or name.startswith("silence/") or not (sounds / f"{name}.wav").is_file():
                continue
            words = words_of(text)
            if words:
                prompts[name] = words
    return prompts


def split_of(name: str) -> str:
    bucket = int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sounds", type=Path, default=SOUNDS)
    parser.add_argument("--transcripts", type=Path, default=TRANSCRIPTS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    prompts = read_prompts(args.transcripts, args.sounds)
    with tempfile.TemporaryDirectory() as tmp:
        for split, out in (("train", args.out), ("dev", args.out / "dev"), ("test", args.out / "test")):
            audio = Path(tmp) / split
            audio.mkdir()
            names = sorted(n for n in prompts if split_of(n) == split)
            for name in names:
                # One flat folder: a prompt's utterance id is its name with / as __.
                (audio / f"{name.replace('/', '__')}.wav").symlink_to(args.sounds / f"{name}.wav")
            text = Path(tmp) / f"{split}.txt"
            text.write_text("".join(f"{n.replace('/', '__')} {' '.join(prompts[n])}\n" for n in names))
            done = prepare_corpus(audio, out, text=text, speaker="allison",
                                  overwrite=args.overwrite or split != "train")
            print(f"{split}: {done.num_utts} prompts, {done.hours * 60:.1f} min, left out "
                  f"{len(done.unknown_words)} with words outside CMUdict and {len(done.failed)} "
                  f"not aligned ({done.seconds_taken:.0f} s) -> {out}")
    # One lexicon for the three sets, as a recipe's data/local/dict: a test word missing from the
    # training transcripts is then a word the unigram LM cannot say, not one decoding refuses.
    dirs = (args.out, args.out / "dev", args.out / "test")
    entries = sorted({line for d in dirs for line in (d / "lexicon.txt").read_text().splitlines()})
    for d in dirs:
        (d / "lexicon.txt").write_text("".join(line + "\n" for line in entries))


if __name__ == "__main__":
    main()
