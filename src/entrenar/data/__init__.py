"""Training data: pretraining token shards (corpus), SFT JSONL with loss masks (sft), code → SFT pairs."""

from .corpus import PretrainLoader, pack, read_index
from .sft import DataReport, SFTExample, SFTLoader, load_sft

__all__ = ["DataReport", "PretrainLoader", "SFTExample", "SFTLoader", "load_sft", "pack", "read_index"]
