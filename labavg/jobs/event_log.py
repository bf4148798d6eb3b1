"""The event log writer: every rank appends its events to RUN_DIR/events.jsonl with one
O_APPEND write per line, which keeps lines whole on a local file system (labavg.jobs.index
reads them back)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from labavg.base.checkpoint import no_room
from labavg.base.events import Averaged, EpochDone, Event, MinibatchDone
from labavg.jobs.index import EVENTS


class EventLog:
    """Appends events to events.jsonl and, if asked, to this rank's TensorBoard files."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = True) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._path = run_dir / EVENTS
        # Never through a link: the run directory's lock holder refused one, this refuses a
        # link planted since (labavg.jobs.run_dir.check_own_files).
        try:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                               0o644)
        except OSError as exc:
            raise no_room(self._path, exc) from None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard" / f"rank{rank}"))

    def write(self, event: Event) -> None:
        """Log one event (one write call, so concurrent ranks never split a line).

        A full disk is a UserError naming the file; the part of the line written before the
        disk filled is cut off again, so the log holds whole lines and the run resumes."""
        line = (json.dumps(event.to_dict(), allow_nan=True) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            if written < len(line):  # a short write to a file: the disk filled mid-line
                self._cut(written)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            raise no_room(self._path, exc) from None
        if self._tb is None:
            return
        if isinstance(event, MinibatchDone):
            self._tb.add_scalar("train/loss", event.loss, event.step)
            self._tb.add_scalar("train/frame_accuracy", event.frame_accuracy, event.step)
            self._tb.add_scalar("train/lr", event.lr, event.step)
        elif isinstance(event, Averaged):
            self._tb.add_scalar("averaging/divergence", event.divergence, event.step)
            self._tb.add_scalar("averaging/comm_seconds", event.comm_seconds, event.step)
            self._tb.add_scalar("averaging/frames_per_second", event.frames_per_second, event.step)
        elif isinstance(event, EpochDone):
            self._tb.add_scalar("cv/loss", event.cv_loss, event.step)
            self._tb.add_scalar("cv/frame_accuracy", event.cv_frame_accuracy, event.step)

    def _cut(self, written: int) -> None:
        """Remove the `written` bytes of a short write, if no other rank has appended since."""
        end = os.lseek(self._fd, 0, os.SEEK_CUR)
        if os.fstat(self._fd).st_size == end:
            os.ftruncate(self._fd, end - written)

    def close(self) -> None:
        """Flush and close the files."""
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()
