"""Generation: sampling settings, the single-sequence loop, and its result types."""
from engine.generate.loop import (GenerationResult, GenerationStats, IncrementalDecoder, StopStringFilter,
                                  generate)
from engine.generate.sampling import SamplerSettings, sample_next, top_k_mask, top_p_mask

__all__ = ["GenerationResult", "GenerationStats", "IncrementalDecoder", "SamplerSettings", "StopStringFilter",
           "generate", "sample_next", "top_k_mask", "top_p_mask"]
