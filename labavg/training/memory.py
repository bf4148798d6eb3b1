"""The memory model: what a DNN of a [model] section holds, counted without building it.
Imports no torch."""

from __future__ import annotations

import os

from labavg.training.settings import ModelConfig

# A model (with its gradients, averaging buffer and checkpoint copy, see
# labavg.training.config.estimate_memory) must fit in this fraction of physical memory; the
# rest is for the data, Python and the OS.
MEMORY_FRACTION = 0.5
# The smallest input validation assumes before the data is open: 13 MFCCs per frame and two
# pdfs. A model refused with these is refused for any data; `check_model_size` with the real
# dimensions follows once the data is read.
MIN_FEAT_DIM = 13
MIN_NUM_PDFS = 2
# Bytes per trainable scalar: float32 weights, their gradients, the flat parameter buffer that
# is averaged, and the averaged / checkpointed copy.
BYTES_PER_PARAMETER = 4 * 4
# A lossy payload keeps the error-feedback residual and the delta (float32), its own encoding
# and the decoded sum: about 12 bytes more per parameter, not counting the gathered payloads.
PAYLOAD_BYTES_PER_PARAMETER = 3 * 4


def parameter_count(cfg: ModelConfig, input_dim: int, num_pdfs: int) -> int:
    """Trainable scalars a DNN of `cfg` would have, computed without building it.

    Python integers, so an absurd shape gives an exact huge number rather than an overflow;
    `labavg.training.config.check_model_size` uses it to refuse a model before anything is
    allocated.
    """
    out_dim = cfg.hidden_dim // cfg.pnorm_group if cfg.nonlinearity == "pnorm" else cfg.hidden_dim
    total, dim = 0, input_dim
    for _ in range(min(cfg.hidden_layers, 1)):
        total += (dim + 1) * cfg.hidden_dim
        dim = out_dim
    # The layers after the first are all alike: no loop, so 10**12 layers cost nothing here.
    total += max(cfg.hidden_layers - 1, 0) * (out_dim + 1) * cfg.hidden_dim
    return total + (dim + 1) * num_pdfs


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (os.sysconf), or None where it cannot tell."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None
