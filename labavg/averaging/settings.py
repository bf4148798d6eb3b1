"""The [averaging] section: how a run's workers average, and the plan
labavg.averaging.factory.make_averager builds the run's averager from. It holds the method and
its own table ([averaging.bmuf], [averaging.diloco]: declared with the method in
labavg.averaging.registry), K, what a round sends (labavg.averaging.payload), how the mean is
computed (labavg.comm.reduce), whether it overlaps compute (labavg.averaging.overlap) and
[averaging.hierarchy] (labavg.averaging.hierarchy). Imports no torch: the registry declares the
methods apart from their classes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from labavg.averaging.registry import method_names, method_sections
from labavg.averaging.schedule_names import SCHEDULES
from labavg.base.schema import POSITIVE, Rule, integer, named_sections, one_of, setting
from labavg.comm.settings import REDUCE

# What a round sends (labavg.averaging.payload, docs/averaging.md): the fp32 parameters (the paper), or
# their change since the last round in 16 bits or as integer codes of PAYLOAD_BITS bits.
PAYLOADS = ("fp32", "bf16", "fp16", "int")
PAYLOAD_BITS = (4, 8, 16)
# Whether a round's mean runs while the next minibatches compute (labavg.averaging.overlap).
OVERLAP = ("none", "eager", "streaming")


# Keys of an earlier labavg's top level (its [bmuf], [diloco] and [hierarchy] tables too) and
# where they went: TrainConfig refuses a file that still has one with this line
# (labavg.base.settings.from_dict).
MOVED_TO_AVERAGING = {
    "averaging": "averaging.method", "average_every": "averaging.average_every",
    "average_every_frames": "averaging.average_every_frames", "reduce": "averaging.reduce",
    "payload": "averaging.payload", "payload_bits": "averaging.payload_bits",
    "error_feedback": "averaging.error_feedback", "overlap": "averaging.overlap",
    "streaming_fragments": "averaging.streaming_fragments", "hierarchy": "averaging.hierarchy",
    "bmuf": "averaging.bmuf", "diloco": "averaging.diloco"}


@dataclass(frozen=True)
class HierarchyConfig:
    """Hierarchical averaging (labavg.averaging.hierarchy.HierarchicalAverager, docs/averaging.md),
    the [averaging.hierarchy] table: the ranks of a node average every K minibatches
    (`averaging.average_every`), all ranks every `across_nodes_every`."""

    # A key of an earlier labavg, and where it went.
    MOVED: ClassVar[dict[str, str]] = {"every": "across_nodes_every"}

    across_nodes_every: int = setting(
        0, "minibatches between averaging rounds across nodes, a multiple of K (0: no "
        "hierarchy, every round across all ranks)", integer(0))
    node_size: int = setting(0, "ranks per node (0: the ranks sharing a host's memory; inproc "
                             "needs a number)", integer(0))

    def problem_with(self, k: int, k_name: str, backend: str, size: int | None) -> str | None:
        """What is wrong with these settings for a run averaging every `k` minibatches
        (`k_name` says where K comes from) on `backend` with `size` ranks (None: not known
        yet), or None."""
        if self.across_nodes_every % k:
            return (f"averaging.hierarchy.across_nodes_every = {self.across_nodes_every} is not a "
                    f"multiple of {k_name}")
        if self.node_size == 0 and backend == "inproc":
            return ("averaging.hierarchy.node_size = 0 (the hosts' shared-memory groups) cannot be "
                    "told on backend 'inproc', whose ranks are threads of one process: set "
                    "averaging.hierarchy.node_size")
        if size is not None and self.node_size > 0 and size % self.node_size:
            return (f"averaging.hierarchy.node_size = {self.node_size} does not divide the {size} "
                    f"ranks")
        return None


@dataclass(frozen=True)
class AveragingConfig:
    """The [averaging] table: what `make_averager` builds a run's averager from."""

    method: str = setting("model", "how a round combines the models (model: plain average, the "
                          "paper; a method's settings in its own table, e.g. [averaging.bmuf])",
                          one_of(method_names), flag="--averaging")
    # the paper: 10 minibatches of 1024 frames
    average_every: int = setting(10, "minibatches between averaging rounds (K)", POSITIVE,
                                 flag="--average-every")
    schedule: str = setting("constant", "how K changes during the run (constant: every K, the "
                            "paper; post_local: every minibatch for the first post_local_frames "
                            "frames, then every K; adacomm: K shrinking with the training loss, "
                            "ceil(K sqrt(loss / first loss)))", one_of(SCHEDULES),
                            flag="--average-schedule")
    post_local_frames: int = setting(0, "schedule = post_local: frames all workers together "
                                     "train while averaging every minibatch", integer(0))
    average_every_frames: int | None = setting(
        None, "frames between averaging rounds (K = round(frames / minibatch))", POSITIVE,
        flag="--average-every-frames")
    reduce: str = setting("allreduce", "how the ranks compute the mean (allreduce: the backend's "
                          "collective; butterfly: recursive halving and doubling; ring)",
                          one_of(REDUCE), flag="--reduce")
    payload: str = setting("fp32", "what a round sends (fp32: the parameters; bf16, fp16, int: "
                           "their change since the last round, compressed)", one_of(PAYLOADS),
                           flag="--payload")
    payload_bits: int = setting(8, "bits per value of payload = int (4, 8 or 16)",
                                Rule(lambda v: v in PAYLOAD_BITS, "4, 8 or 16 (the quantisation "
                                      "bits of payload = int)"),
                                flag="--payload-bits")
    error_feedback: bool = setting(True, "a lossy payload adds each rank's compression error to "
                                   "its next round's change (1-bit SGD, EF-SGD)")
    overlap: str = setting("none", "hide the round's mean behind the next K minibatches (eager: "
                           "one round late, the whole model; streaming: one fragment per round)",
                           one_of(OVERLAP), flag="--overlap")
    streaming_fragments: int = setting(4, "overlap = streaming: contiguous fragments of the "
                                       "model (whole parameter tensors), one synced per round",
                                       POSITIVE)
    # One table per registered method with settings ([averaging.bmuf], [averaging.diloco]).
    method_settings: dict[str, Any] = setting(help="each averaging method's own table",
                                              factory=dict, sections=method_sections)
    hierarchy: HierarchyConfig = setting(help="averaging within nodes, then across them",
                                         factory=HierarchyConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method_settings",
                           named_sections(AveragingConfig, self.method_settings, "method_settings"))

    def table(self, method: str | None = None) -> Any:
        """The own table of `method` (the chosen one unless given), None for a method without
        one."""
        return self.method_settings.get(self.method if method is None else method)

    def with_table(self, section: Any) -> AveragingConfig:
        """A copy with `section` as its method's table (the method whose dataclass it is)."""
        name = next(n for n, cls in method_sections().items() if isinstance(section, cls))
        return dataclasses.replace(self, method_settings={**self.method_settings, name: section})

    def effective_average_every(self, minibatch: int) -> int:
        """K as trained, the minibatches between averaging rounds, for minibatches of
        `minibatch` frames: average_every, or average_every_frames in minibatches."""
        if self.average_every_frames is not None:
            return max(1, round(self.average_every_frames / minibatch))
        return self.average_every

    def k_name(self, minibatch: int) -> str:
        """Where K comes from, for a message."""
        if self.average_every_frames is not None:
            return (f"K = {self.effective_average_every(minibatch)} "
                    f"(averaging.average_every_frames = {self.average_every_frames})")
        return f"averaging.average_every = {self.average_every}"

    def problem(self, prefix: str = "") -> str | None:
        """What the section's settings do not combine with; the message, or None."""
        if self.schedule != "constant" and (self.overlap != "none"
                                            or self.hierarchy.across_nodes_every > 0):
            with_ = (f"overlap = {self.overlap!r}" if self.overlap != "none"
                     else "averaging.hierarchy.across_nodes_every > 0")
            return (f"averaging.schedule = {self.schedule!r} does not combine with {with_} yet "
                    f"(set averaging.schedule = \"constant\")")
        if self.schedule == "post_local" and self.post_local_frames == 0:
            return ("averaging.schedule = \"post_local\" needs averaging.post_local_frames > 0 "
                    "(the frames averaged every minibatch before K takes over)")
        if self.payload != "fp32" and self.reduce != "allreduce":
            # A compressed payload is gathered, not reduced: the reduce algorithms sum fp32.
            return (f"averaging.payload = {self.payload!r} gathers the ranks' compressed changes "
                    f"and cannot use averaging.reduce = {self.reduce!r} (set reduce = "
                    f"\"allreduce\" or payload = \"fp32\")")
        if self.overlap == "none":
            return None
        mode = self.overlap
        if self.hierarchy.across_nodes_every > 0:
            return (f"averaging.overlap = {mode} does not combine with "
                    f"averaging.hierarchy.across_nodes_every > 0 yet")
        if self.reduce != "allreduce":
            return (f"averaging.overlap = {mode} needs reduce = allreduce (the backend's "
                    f"non-blocking collective); reduce = {self.reduce} is a blocking exchange")
        if self.payload != "fp32":
            # The compressed payloads are gathered by a blocking allgather (labavg.averaging.payload).
            return (f"averaging.overlap = {mode} does not combine with payload = "
                    f"{self.payload!r} yet (set payload = \"fp32\" or overlap = \"none\")")
        return None
