# Written against vLLM's offline API, as vLLM's examples/offline_inference/basic/basic.py uses
# it: the test runs it with `vllm` replaced by `mrv2` in the imports, and nothing else changed.
from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
args = parser.parse_args()

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16)
llm = LLM(**vars(args))
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
