"""Long-context inference under TSP: TSP prefill into megatron-core's KV cache, Megatron TP=D
decode on the same parameters and cache (see docs/inference.md)."""

from megatron_tsp.inference.engine import GenerationResult, TSPInferenceEngine, build_decode_model
from megatron_tsp.inference.sampling import SamplingParams

__all__ = ["GenerationResult", "SamplingParams", "TSPInferenceEngine", "build_decode_model"]
