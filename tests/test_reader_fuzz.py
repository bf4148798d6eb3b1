"""Mutated real Kaldi files: every reader either succeeds or raises one-line DataError.

The real archives in ../shared/data are copied, then one file at a time is mutated
deterministically (flipped bytes, header bytes, huge or negative sizes, truncation,
inserted bytes, invalid UTF-8, corrupt gzip) and read through the public readers
(open_dataset and `.load` of every utterance). The cases run in one child process
whose address space is capped (RLIMIT_AS), so a reader that trusts a header and
allocates gigabytes fails as MemoryError, which counts as a failure here.

Run by hand (`python tests/test_reader_fuzz.py [REPO]`) it prints the JSON summary,
which is how the count before the fix was measured (REPO = a checkout of that code).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()
# Headroom over the child's own address space after imports: far more than any of
# these files needs (the largest is 250 kB), far less than a trusted bogus header asks.
HEADROOM_BYTES = 1 << 30
MUTATIONS_PER_KIND = 16


# ------------------------------------------------------------------ scenarios


def _read_all(data) -> None:
    for key in data.keys:
        data.load(key)


def _yesno(root: Path) -> None:
    from labavg.data.dataset import open_dataset
    os.chdir(root / "kaldi-yesno")
    _read_all(open_dataset("data/train_yesno", ali_dir="exp/mono0a"))


def _io_scp(name: str):
    def run(root: Path) -> None:
        from labavg.data.dataset import open_dataset
        os.chdir(root / "kaldi-io-arks")
        _read_all(open_dataset(name))
    return run


def _io_bare_ark(root: Path) -> None:
    from labavg.data.dataset import open_dataset
    os.chdir(root / "kaldi-io-arks")
    _read_all(open_dataset("ark:feats.ark", ali="ark:fm/pdf_ali.ark", skip_mismatched=True))


def _io_alignments(root: Path) -> None:
    from labavg.data.alignment import read_int_vectors
    os.chdir(root / "kaldi-io-arks")
    read_int_vectors("ark:ali.ark")
    read_int_vectors("ark,t:ali_ascii.ark")


def _utterance(root: Path) -> None:
    from labavg.data.dataset import open_dataset
    os.chdir(root / "real-utterance")
    _read_all(open_dataset("ark:mfccs.ark", textgrid="acoustic_corpus.TextGrid",
                           cmvn="cmvn.ark", snip_edges=False))


SCENARIOS = {
    "yesno": _yesno,
    "io-fm": _io_scp("fm"),
    "io-cm": _io_scp("cm"),
    "io-text": _io_scp("text"),
    "io-ark": _io_bare_ark,
    "io-ali": _io_alignments,
    "utterance": _utterance,
}

# (file relative to the copied shared/data, scenarios that read it)
TARGETS = [
    ("kaldi-yesno/mfcc/raw_mfcc_train_yesno.1.ark", ["yesno"]),
    ("kaldi-yesno/mfcc/cmvn_train_yesno.ark", ["yesno"]),
    ("kaldi-yesno/data/train_yesno/feats.scp", ["yesno"]),
    ("kaldi-yesno/data/train_yesno/cmvn.scp", ["yesno"]),
    ("kaldi-yesno/data/train_yesno/utt2spk", ["yesno"]),
    ("kaldi-yesno/exp/mono0a/ali.1.gz", ["yesno"]),
    ("kaldi-yesno/exp/mono0a/final.mdl", ["yesno"]),
    ("kaldi-io-arks/feats.ark", ["io-fm", "io-ark"]),
    ("kaldi-io-arks/feats_compressed.ark", ["io-cm"]),
    ("kaldi-io-arks/feats_ascii.ark", ["io-text"]),
    ("kaldi-io-arks/fm/feats.scp", ["io-fm"]),
    ("kaldi-io-arks/cm/feats.scp", ["io-cm"]),
    ("kaldi-io-arks/ali.ark", ["io-ali"]),
    ("kaldi-io-arks/ali_ascii.ark", ["io-ali"]),
    ("real-utterance/acoustic_corpus.TextGrid", ["utterance"]),
    ("real-utterance/cmvn.ark", ["utterance"]),
]


def prepare(root: Path) -> None:
    """Copy the shared data and give the io-arks features data dirs with matching targets."""
    for name in ("kaldi-yesno", "kaldi-io-arks", "real-utterance"):
        shutil.copytree(SHARED_DATA / name, root / name)
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    import kaldiio
    import numpy as np

    io = root / "kaldi-io-arks"
    for folder, scp in (("fm", "feats.scp"), ("cm", "feats_compressed.scp"),
                        ("text", "feats_ascii.scp")):
        (io / folder).mkdir()
        # Column ranges change the dimension, which open_dataset rightly refuses.
        lines = [line for line in (io / scp).read_text().splitlines() if "," not in line]
        (io / folder / "feats.scp").write_text("\n".join(lines) + "\n")
        here = os.getcwd()
        os.chdir(io)
        try:
            frames = {key: len(kaldiio.load_mat(rx)) for key, rx in
                      (line.split() for line in lines)}
        finally:
            os.chdir(here)
        rng = np.random.default_rng(0)
        kaldiio.save_ark(str(io / folder / "pdf_ali.ark"),
                         {k: rng.integers(0, 7, n).astype(np.int32) for k, n in frames.items()})
        (io / folder / "num_pdfs").write_text("7\n")


# ------------------------------------------------------------------ mutations


def header_positions(data: bytes) -> list[int]:
    """Offsets of binary object headers, text matrix brackets, and gzip/Kaldi magic."""
    spots = [i for i in range(len(data) - 1) if data[i:i + 2] == b"\0B"]
    spots += [i for i, byte in enumerate(data) if byte == ord("[")][:200]
    return spots or [0]


def mutations(name: str, data: bytes) -> list[tuple[str, bytes]]:
    """Deterministic mutants of one file's bytes: (description, bytes)."""
    rng = random.Random(name)
    span = len(data)
    if name.endswith("final.mdl"):
        # Only the TransitionModel at the head is read; mutate there.
        span = data.index(b"</TransitionModel>") + 20
    heads = header_positions(data[:span])
    out: list[tuple[str, bytes]] = []
    for i in range(MUTATIONS_PER_KIND):
        pos = rng.randrange(span)
        flipped = bytearray(data)
        flipped[pos] ^= rng.randrange(1, 256)
        out.append((f"flip byte {pos}", bytes(flipped)))

        pos = min(rng.choice(heads) + rng.randrange(24), len(data) - 1)
        header = bytearray(data)
        header[pos] = rng.randrange(256)
        out.append((f"header byte {pos}", bytes(header)))

        # A size field set to a huge or negative value: the bytes after a size byte 4.
        sizes = [j + 1 for j in range(rng.choice(heads), min(rng.choice(heads) + 40, span - 5))
                 if data[j] == 4]
        if sizes:
            pos = rng.choice(sizes)
            value = rng.choice([0x7FFFFFFF, 0x3FFFFFFF, -1, -7, 1 << 24, rng.randrange(1 << 31)])
            sized = data[:pos] + struct.pack("<i", value) + data[pos + 4:]
            out.append((f"size {value} at {pos}", sized))

        pos = rng.randrange(span)
        out.append((f"truncate at {pos}", data[:pos]))

        pos = rng.randrange(span)
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        out.append((f"insert {junk.hex()} at {pos}", data[:pos] + junk + data[pos:]))

    if not data.startswith(b"\x1f\x8b"):
        pos = rng.randrange(span)
        out.append((f"invalid utf-8 at {pos}", data[:pos] + b"\xff\xfe" + data[pos:]))
    else:
        inner = gzip.decompress(data)
        for description, mutant in mutations(name + ":inner", inner)[:12]:
            out.append((f"gzip content: {description}", gzip.compress(mutant, mtime=0)))
    return out


# ------------------------------------------------------------------ child process


def vm_size() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def child() -> dict:
    import resource

    from labavg.base.errors import DataError

    root = Path(tempfile.mkdtemp(prefix="labavg-fuzz-"))
    try:
        prepare(root)
        for scenario in SCENARIOS.values():  # every scenario reads the intact files
            scenario(root)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + HEADROOM_BYTES, resource.RLIM_INFINITY))
        summary = {"cases": 0, "ok": 0, "data_error": 0, "bad": [], "seconds": 0.0}
        start = time.perf_counter()
        for relative, scenarios in TARGETS:
            path = root / relative
            original = path.read_bytes()
            for description, mutant in mutations(relative, original):
                path.write_bytes(mutant)
                for scenario in scenarios:
                    summary["cases"] += 1
                    case = f"{relative} [{description}] via {scenario}"
                    try:
                        SCENARIOS[scenario](root)
                    except DataError as exc:
                        if "\n" in str(exc) or not str(exc).strip():
                            summary["bad"].append([case, "multi-line DataError", str(exc)[:300]])
                        else:
                            summary["data_error"] += 1
                    except BaseException as exc:  # noqa: BLE001 - what the test is looking for
                        where = traceback.extract_tb(exc.__traceback__)[-1]
                        summary["bad"].append([case, type(exc).__name__,
                                               f"{str(exc)[:200]} ({Path(where.filename).name}:"
                                               f"{where.lineno})"])
                    else:
                        summary["ok"] += 1
            path.write_bytes(original)
        summary["seconds"] = round(time.perf_counter() - start, 2)
        return summary
    finally:
        os.chdir("/")
        shutil.rmtree(root, ignore_errors=True)


def run_child(repo: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(repo), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=str(repo))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # keeps README's fast command under 10 minutes; CI runs it
def test_mutated_real_archives_raise_only_one_line_data_errors(shared_data):
    summary = run_child(REPO)
    assert summary["bad"] == [], (len(summary["bad"]), summary["bad"][:20])
    assert summary["cases"] > 500
    # The mutations must bite: a fuzzer whose every case still reads fine tests nothing.
    assert summary["data_error"] > summary["cases"] // 3, summary


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(json.dumps(child()))
    else:
        result = run_child(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
        bad = result.pop("bad")
        print(json.dumps(result))
        kinds: dict[str, int] = {}
        for case, kind, message in bad:
            kinds[kind] = kinds.get(kind, 0) + 1
            print(kind, "|", case, "|", message)
        print(len(bad), "bad", kinds)
