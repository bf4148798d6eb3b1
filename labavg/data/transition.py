"""Kaldi's TransitionModel, read from the head of a `final.mdl`, binary or text.

A GMM or nnet3 `final.mdl` starts with the TransitionModel (src/hmm/transition-model.cc,
TransitionModel::Write); the acoustic model after it is not read. Only the mapping from
transition ids to pdf ids and phones is needed to turn `ali.*.gz` into pdf targets
(what Kaldi's `ali-to-pdf` does).

Numbering, following TransitionModel::ComputeDerived: transition states are the
tuples (phone, hmm_state, forward_pdf, self_loop_pdf) in file order (Kaldi writes them
sorted), numbered from 1; each state gets one transition id per transition of its
topology HmmState, in topology order, counting from 1. A transition id is a
self-loop when its transition goes back to its own hmm_state; its pdf is then
self_loop_pdf, else forward_pdf. The old `<Triples>` form has one pdf for both.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from labavg.data.rxfilenames import one_line
from labavg.base.errors import DataError

NO_PDF = -1  # kNoPdf in hmm/hmm-topology.h: the non-emitting final state


@dataclass(frozen=True)
class HmmState:
    """One state of a topology entry; transitions are (destination hmm_state, prob)."""

    forward_pdf_class: int
    self_loop_pdf_class: int
    transitions: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Topology:
    """Kaldi's HmmTopology: phone -> list of HmmState."""

    phones: tuple[int, ...]
    phone2idx: tuple[int, ...]
    entries: tuple[tuple[HmmState, ...], ...]

    def for_phone(self, phone: int) -> tuple[HmmState, ...]:
        """The topology entry of `phone` (DataError if the phone is not covered)."""
        if not 0 <= phone < len(self.phone2idx) or self.phone2idx[phone] < 0:
            raise DataError(f"phone {phone} is not covered by the model's topology")
        return self.entries[self.phone2idx[phone]]


@dataclass(frozen=True)
class TransitionTuple:
    """One transition state: (phone, hmm_state, forward_pdf, self_loop_pdf)."""

    phone: int
    hmm_state: int
    forward_pdf: int
    self_loop_pdf: int


class TransitionModel:
    """Transition-id -> pdf-id / phone maps of a Kaldi TransitionModel.

    `tid_to_pdf[t]`, `tid_to_phone[t]`, `tid_to_hmm_state[t]`, `tid_is_self_loop[t]`
    for t in 1..num_transition_ids (entry 0 is unused and holds -1, as Kaldi's ids
    start at 1). `num_pdfs` is 1 + the largest pdf of any tuple.
    """

    def __init__(self, topology: Topology, tuples: list[TransitionTuple],
                 log_probs: np.ndarray, is_hmm: bool):
        self.topology = topology
        self.tuples = tuples
        self.log_probs = log_probs
        self.is_hmm = is_hmm
        self._compute_derived()

    def _compute_derived(self) -> None:
        if not self.tuples:
            raise DataError("TransitionModel: no transition states (corrupt model?)")
        for index in self.topology.phone2idx:
            if not -1 <= index < len(self.topology.entries):
                raise DataError(f"TransitionModel: topology entry {index} of a phone is out of "
                                f"range 0..{len(self.topology.entries) - 1} (corrupt model?)")
        for tstate, tup in enumerate(self.tuples, start=1):
            if min(tup.forward_pdf, tup.self_loop_pdf) < 0:
                raise DataError(f"TransitionModel: transition state {tstate} has a negative pdf "
                                f"id ({tup.forward_pdf}, {tup.self_loop_pdf}; corrupt model?)")
        pdfs, phones, states, loops, tstates = [NO_PDF], [-1], [-1], [False], [0]
        for tstate, tup in enumerate(self.tuples, start=1):
            entry = self.topology.for_phone(tup.phone)
            if not 0 <= tup.hmm_state < len(entry):
                raise DataError(f"transition state {tstate}: hmm_state {tup.hmm_state} out of "
                                f"range for phone {tup.phone}")
            for destination, _prob in entry[tup.hmm_state].transitions:
                loop = destination == tup.hmm_state
                pdfs.append(tup.self_loop_pdf if loop else tup.forward_pdf)
                phones.append(tup.phone)
                states.append(tup.hmm_state)
                loops.append(loop)
                tstates.append(tstate)
        self.tid_to_pdf = np.asarray(pdfs, dtype=np.int64)
        self.tid_to_phone = np.asarray(phones, dtype=np.int64)
        self.tid_to_hmm_state = np.asarray(states, dtype=np.int64)
        self.tid_is_self_loop = np.asarray(loops, dtype=bool)
        self.tid_to_tstate = np.asarray(tstates, dtype=np.int64)
        self.num_pdfs = 1 + max(max(t.forward_pdf, t.self_loop_pdf) for t in self.tuples)
        # Every pdf of a model belongs to some transition state, each of which has at most
        # two: more pdf ids than that means a corrupt id (and an absurdly wide output layer).
        if self.num_pdfs > 2 * len(self.tuples):
            raise DataError(f"TransitionModel: largest pdf id {self.num_pdfs - 1} but only "
                            f"{len(self.tuples)} transition states (corrupt model?)")
        if self.log_probs.size not in (0, len(pdfs)):
            raise DataError(f"TransitionModel: {self.log_probs.size} log-probs for "
                            f"{len(pdfs) - 1} transition ids (expected one more than the ids)")

    @property
    def num_transition_ids(self) -> int:
        """The largest transition id (ids run 1..num_transition_ids)."""
        return len(self.tid_to_pdf) - 1

    def pdfs_of(self, tids: np.ndarray, where: str = "alignment") -> np.ndarray:
        """Map transition ids to pdf ids (int64), raising DataError for ids out of range."""
        tids = np.asarray(tids, dtype=np.int64)
        bad = (tids < 1) | (tids > self.num_transition_ids)
        if bad.any():
            frame = int(np.argmax(bad))
            raise DataError(f"{where}: transition id {int(tids[frame])} at frame {frame} is out "
                            f"of range 1..{self.num_transition_ids} for this final.mdl "
                            "(alignment made with another model?)")
        return self.tid_to_pdf[tids]


# ------------------------------------------------------------------ binary reader


class _BinaryReader:
    """Kaldi basic binary I/O (base/io-funcs.h): tokens end in a space, ints are size-prefixed."""

    def __init__(self, handle: BinaryIO, name: str, end: int):
        self.handle = handle
        self.name = name
        self.end = end

    def fail(self, what: str) -> DataError:
        return DataError(f"{self.name} byte {self.handle.tell()}: {what} (truncated or not a "
                         "Kaldi model?)")

    def read(self, size: int) -> bytes:
        # Sizes come from the file: check them against what is left before reading
        # (allocating) that much, so a flipped byte cannot ask for gigabytes.
        left = self.end - self.handle.tell()
        if size > left:
            raise self.fail(f"a size in the file asks for {size} bytes, only {left} are left")
        data = self.handle.read(size)
        if len(data) != size:
            raise self.fail(f"unexpected end of file reading {size} bytes")
        return data

    def token(self) -> str:
        chars = bytearray()
        while True:
            byte = self.read(1)
            if byte == b" ":
                if chars:
                    return chars.decode("latin-1")
                continue
            chars += byte
            if len(chars) > 128:
                raise self.fail("token too long")

    def expect(self, token: str) -> None:
        got = self.token()
        if got != token:
            raise self.fail(f"expected {token}, got {got}")

    def int32(self) -> int:
        size = self.read(1)[0]
        if size != 4:
            raise self.fail(f"expected a 4-byte integer, size byte is {size}")
        return struct.unpack("<i", self.read(4))[0]

    def float32(self) -> float:
        size = self.read(1)[0]
        if size == 4:
            return struct.unpack("<f", self.read(4))[0]
        if size == 8:
            return struct.unpack("<d", self.read(8))[0]
        raise self.fail(f"expected a float, size byte is {size}")

    def int_vector(self) -> list[int]:
        size = self.read(1)[0]
        if size != 4:
            raise self.fail(f"expected an int32 vector, element size is {size}")
        (count,) = struct.unpack("<i", self.read(4))
        if count < 0:
            raise self.fail(f"negative vector length {count}")
        return list(struct.unpack(f"<{count}i", self.read(4 * count)))

    def float_vector(self) -> np.ndarray:
        kind = self.token()
        if kind not in ("FV", "DV"):
            raise self.fail(f"expected FV or DV, got {kind}")
        count = self.int32()
        if count < 0:
            raise self.fail(f"negative vector length {count}")
        dtype = "<f4" if kind == "FV" else "<f8"
        return np.frombuffer(self.read(count * np.dtype(dtype).itemsize), dtype=dtype).copy()


def _read_binary_topology(reader: _BinaryReader) -> tuple[Topology, bool]:
    reader.expect("<Topology>")
    phones = reader.int_vector()
    phone2idx = reader.int_vector()
    num_entries = reader.int32()
    is_hmm = True
    if num_entries == -1:  # marks the extended format with SelfLoopPdfClass
        is_hmm = False
        num_entries = reader.int32()
    entries = []
    for _ in range(num_entries):
        states = []
        for _ in range(reader.int32()):
            forward = reader.int32()
            self_loop = forward if is_hmm else reader.int32()
            transitions = tuple((reader.int32(), reader.float32()) for _ in range(reader.int32()))
            states.append(HmmState(forward, self_loop, transitions))
        entries.append(tuple(states))
    reader.expect("</Topology>")
    return Topology(tuple(phones), tuple(phone2idx), tuple(entries)), is_hmm


def _read_binary(handle: BinaryIO, name: str, end: int) -> TransitionModel:
    reader = _BinaryReader(handle, name, end)
    reader.expect("<TransitionModel>")
    topology, _ = _read_binary_topology(reader)
    kind = reader.token()
    if kind not in ("<Triples>", "<Tuples>"):
        raise reader.fail(f"expected <Triples> or <Tuples>, got {kind}")
    tuples = []
    for _ in range(reader.int32()):
        phone, hmm_state, forward = reader.int32(), reader.int32(), reader.int32()
        self_loop = reader.int32() if kind == "<Tuples>" else forward
        tuples.append(TransitionTuple(phone, hmm_state, forward, self_loop))
    reader.expect(kind.replace("<", "</"))
    reader.expect("<LogProbs>")
    log_probs = reader.float_vector()
    reader.expect("</LogProbs>")
    reader.expect("</TransitionModel>")
    return TransitionModel(topology, tuples, log_probs, kind == "<Triples>")


# ------------------------------------------------------------------ text reader


def _text_tokens(handle: BinaryIO) -> Iterator[str]:
    """Whitespace-separated tokens, read line by line so the nnet after the model is never read."""
    for raw in handle:
        yield from raw.decode("utf-8", errors="replace").split()


class _TextReader:
    def __init__(self, tokens: Iterator[str], name: str):
        self.tokens = tokens
        self.name = name
        self.last = ""

    def token(self) -> str:
        try:
            self.last = next(self.tokens)
        except StopIteration:
            raise DataError(f"{self.name}: unexpected end of file after {self.last!r} "
                            "(truncated text model?)") from None
        return self.last

    def expect(self, token: str) -> None:
        got = self.token()
        if got != token:
            raise DataError(f"{self.name}: expected {token}, got {got!r}")

    def int32(self) -> int:
        text = self.token()
        try:
            value = int(text)
        except ValueError:
            raise DataError(f"{self.name}: expected an integer, got {text!r}") from None
        if not -(1 << 31) <= value < (1 << 31):
            raise DataError(f"{self.name}: integer {text[:30]!r} does not fit in 32 bits")
        return value

    def float32(self) -> float:
        text = self.token()
        try:
            return float(text)
        except ValueError:
            raise DataError(f"{self.name}: expected a number, got {text!r}") from None


def _read_text_topology(reader: _TextReader, max_phone: int) -> Topology:
    """HmmTopology::Read text form: <TopologyEntry> <ForPhones> ... <State> ... entries."""
    reader.expect("<Topology>")
    entries: list[tuple[HmmState, ...]] = []
    phone2idx: list[int] = []
    phones: list[int] = []
    while (token := reader.token()) != "</Topology>":
        if token != "<TopologyEntry>":
            raise DataError(f"{reader.name}: expected <TopologyEntry> or </Topology>, got {token!r}")
        reader.expect("<ForPhones>")
        entry_phones = []
        while (token := reader.token()) != "</ForPhones>":
            try:
                phone = int(token)
            except ValueError:
                raise DataError(f"{reader.name}: expected a phone id, got {token!r}") from None
            # phone2idx gets one slot per id up to the largest: bound it by what a file
            # this size could list, so a corrupt digit cannot ask for gigabytes.
            if not 0 <= phone <= max_phone:
                raise DataError(f"{reader.name}: phone id {token[:30]} is out of range "
                                f"0..{max_phone} (corrupt topology?)")
            entry_phones.append(phone)
        states: list[HmmState] = []
        token = reader.token()
        while token != "</TopologyEntry>":
            if token != "<State>":
                raise DataError(f"{reader.name}: expected <State>, got {token!r}")
            if reader.int32() != len(states):
                raise DataError(f"{reader.name}: topology states must be numbered from 0 in order")
            token = reader.token()
            forward = self_loop = NO_PDF
            if token == "<PdfClass>":
                forward = self_loop = reader.int32()
                token = reader.token()
            elif token == "<ForwardPdfClass>":
                forward = reader.int32()
                reader.expect("<SelfLoopPdfClass>")
                self_loop = reader.int32()
                token = reader.token()
            transitions = []
            while token == "<Transition>":
                transitions.append((reader.int32(), reader.float32()))
                token = reader.token()
            if token != "</State>":
                raise DataError(f"{reader.name}: expected </State>, got {token!r}")
            states.append(HmmState(forward, self_loop, tuple(transitions)))
            token = reader.token()
        for phone in entry_phones:
            if len(phone2idx) <= phone:
                phone2idx.extend([-1] * (phone + 1 - len(phone2idx)))
            phone2idx[phone] = len(entries)
            phones.append(phone)
        entries.append(tuple(states))
    return Topology(tuple(sorted(phones)), tuple(phone2idx), tuple(entries))


def _read_text(handle: BinaryIO, name: str, end: int) -> TransitionModel:
    reader = _TextReader(_text_tokens(handle), name)
    reader.expect("<TransitionModel>")
    topology = _read_text_topology(reader, max_phone=end)
    kind = reader.token()
    if kind not in ("<Triples>", "<Tuples>"):
        raise DataError(f"{name}: expected <Triples> or <Tuples>, got {kind!r}")
    tuples = []
    for _ in range(reader.int32()):
        phone, hmm_state, forward = reader.int32(), reader.int32(), reader.int32()
        self_loop = reader.int32() if kind == "<Tuples>" else forward
        tuples.append(TransitionTuple(phone, hmm_state, forward, self_loop))
    reader.expect(kind.replace("<", "</"))
    reader.expect("<LogProbs>")
    reader.expect("[")
    values = []
    while (token := reader.token()) != "]":
        try:
            values.append(float(token))
        except ValueError:
            raise DataError(f"{name}: expected a log-prob, got {token!r}") from None
    reader.expect("</LogProbs>")
    reader.expect("</TransitionModel>")
    return TransitionModel(topology, tuples, np.asarray(values, dtype=np.float32),
                           kind == "<Triples>")


def read_transition_model(path: str | Path) -> TransitionModel:
    """Read the TransitionModel at the head of a Kaldi model file (binary or text)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"model file not found: {path}")
    try:
        with open(path, "rb") as handle:
            end = os.fstat(handle.fileno()).st_size
            head = handle.read(2)
            if head == b"\0B":
                return _read_binary(handle, str(path), end)
            handle.seek(0)
            return _read_text(handle, str(path), end)
    except DataError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise DataError(f"{path}: {exc}") from exc
    except (ValueError, IndexError, OverflowError, struct.error, OSError) as exc:
        # A last line of defence: whatever the checks above missed is still corrupt input.
        raise DataError(f"{path}: corrupt TransitionModel: {one_line(exc)}") from exc
