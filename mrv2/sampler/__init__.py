"""Token sampling (DESIGN.md section 5): per-slot parameter tables (states.py), the sampler
pipeline (sampler.py; torch on CPU, Triton kernels on CUDA) and its stages (bias.py,
penalties.py, filters.py, noise.py, logprobs.py) and the runner's prompt logprobs
(prompt_logprobs.py)."""

from mrv2.sampler.logprobs import LOGPROBS_MODES, LogprobsTensors
from mrv2.sampler.sampler import Sampler, SamplerOutput
from mrv2.sampler.states import BatchFlags, SamplingStates

__all__ = ["Sampler", "SamplerOutput", "SamplingStates", "BatchFlags", "LogprobsTensors",
           "LOGPROBS_MODES"]
