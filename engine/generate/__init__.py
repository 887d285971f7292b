"""Generation: sampling settings, the single-sequence loop, CUDA-graph decode, and result types."""
from engine.generate.graph_decode import GraphDecoder, graph_decoder
from engine.generate.loop import (GenerationResult, GenerationStats, IncrementalDecoder, StopStringFilter,
                                  generate)
from engine.generate.sampling import SamplerSettings, candidates, sample_next

__all__ = ["GenerationResult", "GenerationStats", "GraphDecoder", "IncrementalDecoder", "SamplerSettings",
           "StopStringFilter", "candidates", "generate", "graph_decoder", "sample_next"]
