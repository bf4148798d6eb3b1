"""Per-frame pdf alignments: int-vector tables, Kaldi alignment dirs, TextGrids.

Alignments are small next to features (one integer per frame), so they are read
whole and kept in memory as int32 arrays; features stay lazy (labavg.data.archives).
"""

from __future__ import annotations

import gzip
import io
import re
import shutil
import zlib
from pathlib import Path

import numpy as np

from labavg.data.archives import iter_ark, iter_table
from labavg.data.rxfilenames import (is_pipe, is_rspecifier, one_line, refuse_pipe,
                                     split_rspecifier)
from labavg.data.transition import TransitionModel, read_transition_model
from labavg.base.errors import DataError

_ALI_NAME = re.compile(r"^ali\.(\d+)\.gz$")


def as_int_vector(value: object, where: str) -> np.ndarray:
    """Check that a table object is a 1-d integer vector and return it as int32."""
    array = np.asarray(value)
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(f"{where}: expected an int vector (an alignment), got a "
                        f"{array.ndim}-d {array.dtype} object")
    return array.astype(np.int32)


def read_int_vectors(rspecifier: str, *, allow_pipes: bool = False) -> dict[str, np.ndarray]:
    """Read a table of int vectors: `ark:ali.ark`, `ark,t:...`, `scp:...`, `ark:cmd |`.

    Pipes (`ark:cmd |`, `scp:cmd |`, or pipe lines in the scp) run through the shell,
    as in Kaldi, and only with allow_pipes=True; otherwise they raise DataError. A pipe
    that calls a Kaldi binary (e.g. `| ali-to-pdf ...`) needs Kaldi on PATH; without
    it this raises DataError and suggests `ali_dir`, which maps transition ids without
    Kaldi.
    """
    if not is_rspecifier(rspecifier):
        raise DataError(f"alignment {rspecifier!r} is not an rspecifier; write e.g. "
                        f"'ark:{rspecifier}', or for Kaldi's ali.*.gz give ali_dir=<their dir>")
    _, target = split_rspecifier(rspecifier)
    if is_pipe(target) or target.strip() == "-":
        refuse_pipe(target, f"alignment rspecifier {rspecifier!r}", allow_pipes)
        check_pipe_commands(target)
    elif not Path(target).is_file():
        raise DataError(f"alignment file not found: {target} (looked in {Path.cwd()})")
    result: dict[str, np.ndarray] = {}
    # Options such as ,t only matter to Kaldi's writer; the reader detects text itself.
    for key, value, where in iter_table(rspecifier, allow_pipes=allow_pipes):
        if key in result:
            raise DataError(f"{where}: alignment key {key!r} appears twice")
        result[key] = as_int_vector(value, where)
    if is_pipe(target) and not result:
        raise DataError(f"the pipe {target!r} produced no alignments (did the command fail?)")
    return result


def check_pipe_commands(pipe: str) -> None:
    """Fail early, with advice, when a pipe needs a Kaldi binary that is not installed."""
    for command in re.findall(r"(?:^|\|)\s*([A-Za-z0-9_.\-/]+)", pipe):
        if "-" in command and command.split("/")[-1].startswith(("ali-", "copy-", "apply-")):
            if shutil.which(command) is None:
                raise DataError(f"the pipe {pipe!r} runs {command!r}, which is not on PATH "
                                "(Kaldi is not installed here); pass ali_dir=<exp/x_ali> "
                                "instead, and labavg maps transition ids to pdfs itself")


def read_gzip_ark(path: Path) -> dict[str, np.ndarray]:
    """Read one `ali.N.gz` (text or binary int-vector ark): gzip, then the checked ark reader."""
    try:
        # In memory: the reader seeks backwards, which gzip streams only do by re-reading.
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: not a readable gzip file (truncated or corrupt?): "
                        f"{one_line(exc)}") from exc
    result: dict[str, np.ndarray] = {}
    for key, value, entry in iter_ark(io.BytesIO(data), len(data), f"{path} (decompressed)"):
        if key in result:
            raise DataError(f"{path}: alignment key {key!r} appears twice")
        result[key] = as_int_vector(value, f"{path} key {key!r}")
    return result


def list_ali_files(ali_dir: Path) -> list[Path]:
    """`ali.1.gz, ali.2.gz, ...` of an alignment dir in job order."""
    files = [p for p in ali_dir.iterdir() if _ALI_NAME.match(p.name)]
    return sorted(files, key=lambda p: int(_ALI_NAME.match(p.name).group(1)))


def read_ali_dir(ali_dir: str | Path) -> tuple[dict[str, np.ndarray], TransitionModel]:
    """Read pdf alignments from a Kaldi alignment dir (`ali.*.gz` + `final.mdl`).

    Transition ids are mapped to pdf ids with the dir's TransitionModel, as
    `ali-to-pdf` would. Returns ({key: int32 pdfs}, model); `model.num_pdfs` is the
    number of pdfs of the model.
    """
    ali_dir = Path(ali_dir)
    if not ali_dir.is_dir():
        raise DataError(f"alignment dir not found: {ali_dir} (looked in {Path.cwd()})")
    model_path = ali_dir / "final.mdl"
    if not model_path.is_file():
        raise DataError(f"{ali_dir}: no final.mdl; an alignment dir needs the model that "
                        "made the alignments to map transition ids to pdfs")
    files = list_ali_files(ali_dir)
    if not files:
        raise DataError(f"{ali_dir}: no ali.*.gz files")
    model = read_transition_model(model_path)
    pdfs: dict[str, np.ndarray] = {}
    for path in files:
        for key, tids in read_gzip_ark(path).items():
            if key in pdfs:
                raise DataError(f"{path}: alignment key {key!r} also appears in another ali.*.gz")
            pdfs[key] = model.pdfs_of(tids, f"{path} key {key!r}").astype(np.int32)
    return pdfs, model
