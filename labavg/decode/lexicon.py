"""Lexicons and transcripts: Kaldi's `lexicon.txt` and `text` files, checked line by line."""

from __future__ import annotations

import os
from pathlib import Path

from labavg.base.errors import DataError

UNK_WORDS = ("<unk>", "<UNK>")


def read_lexicon(path: str | os.PathLike) -> list[tuple[str, list[str]]]:
    """`word phone phone ...` lines (Kaldi's data/local/dict/lexicon.txt), in file order.

    A word may have several pronunciations (several lines).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"lexicon {path} not found") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"lexicon {path}: not UTF-8 text ({exc})") from None
    entries = []
    for number, line in enumerate(lines, start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) < 2:
            raise DataError(f"{path} line {number}: word {parts[0]!r} has no pronunciation")
        if parts[0] in ("<eps>", "<s>", "</s>") or parts[0].startswith("#"):
            raise DataError(f"{path} line {number}: {parts[0]!r} is reserved and cannot be a word")
        entries.append((parts[0], parts[1:]))
    if not entries:
        raise DataError(f"lexicon {path} is empty")
    return entries


def check_lexicon_phones(lexicon: list[tuple[str, list[str]]], phones: list[str], where: str,
                         topology_from: str) -> None:
    """DataError naming the first lexicon phone the model's topology does not cover."""
    known = set(phones)
    for word, pron in lexicon:
        for phone in pron:
            if phone not in known:
                raise DataError(f"{where}: word {word!r} uses phone {phone!r}, which the model's "
                                f"topology ({topology_from}) does not have; its phones are "
                                f"{' '.join(phones[:12])}{' ...' if len(phones) > 12 else ''}")


def read_text(path: str | os.PathLike) -> dict[str, list[str]]:
    """A Kaldi `text` file: {utterance: [word, ...]} (a line with a key only is an empty utterance)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"transcripts {path} not found (a data dir to score needs its 'text')") from None
    table: dict[str, list[str]] = {}
    for line in lines:
        parts = line.split()
        if parts:
            table[parts[0]] = parts[1:]
    return table


def map_oov(transcripts: dict[str, list[str]], words: set[str], where: str
            ) -> tuple[dict[str, list[str]], int, str | None]:
    """Map words missing from the lexicon to its <unk>: (mapped, number of OOV tokens, unk word).

    Without an <unk> in the lexicon, OOV words raise DataError with their count.
    """
    unk = next((u for u in UNK_WORDS if u in words), None)
    oov: dict[str, int] = {}
    for utt_words in transcripts.values():
        for word in utt_words:
            if word not in words:
                oov[word] = oov.get(word, 0) + 1
    count = sum(oov.values())
    if count and unk is None:
        shown = ", ".join(repr(w) for w in sorted(oov, key=lambda w: -oov[w])[:5])
        raise DataError(f"{where}: {count} word token(s) of {len(oov)} word type(s) are not in the "
                        f"lexicon (e.g. {shown}) and the lexicon has no <unk> to map them to")
    mapped = {utt: [w if w in words else unk for w in ws] for utt, ws in transcripts.items()}
    return mapped, count, unk
