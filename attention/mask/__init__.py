"""Attention masks as data, one per file (in the spirit of attention-gym): full, causal,
sliding_window, documents, documents with a window, prefix_lm.

Each Mask gives the exact token predicate `keep(q_idx, k_idx)` (for the fp64 reference and the
gate), the block map `blocks(seq_len, block_size)` (kept / full / partial tiles and their kept
pairs, for planners, FLOPs and communication; never (S, S)), and the kept-pair count
`pairs(seq_len)`. `parse` reads the dict a run's `mask` takes; `expand` writes sampled or
file lengths out as a run stores them; `from_legacy` maps `causal` + `document_lengths` to the
same dict. docs/masks.md describes them.
"""

from attention.mask.base import BlockMap, Mask
from attention.mask.causal import Causal
from attention.mask.documents import Documents
from attention.mask.documents_window import DocumentsWindow
from attention.mask.full import Full
from attention.mask.lengths import read_lengths_file, sample_lengths
from attention.mask.parse import KINDS, expand, from_legacy, parse
from attention.mask.prefix_lm import PrefixLM
from attention.mask.sliding_window import SlidingWindow

__all__ = [
    "KINDS",
    "BlockMap",
    "Causal",
    "Documents",
    "DocumentsWindow",
    "Full",
    "Mask",
    "PrefixLM",
    "SlidingWindow",
    "expand",
    "from_legacy",
    "parse",
    "read_lengths_file",
    "sample_lengths",
]
