# vLLM's examples/offline_inference/basic/embed.py pattern: a decoder served as an embedding
# model (runner="pooling" as the parser's default), LLM.embed, then LLM.score.
from argparse import Namespace

from vllm import LLM, EngineArgs
from vllm.utils import FlexibleArgumentParser


def main(args: Namespace) -> None:
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    llm = LLM(**vars(args))
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs):
        embeds = output.outputs.embedding
        embeds_trimmed = (str(embeds[:4])[:-1] + ", ...]") if len(embeds) > 4 else embeds
        print(f"Prompt: {prompt!r} \nEmbeddings: {embeds_trimmed} (size={len(embeds)})")
    scores = llm.score("What is the capital of France?", ["The capital of France is Paris.",
                                                          "The capital of Brazil is Brasilia."])
    print("Scores:", [round(output.outputs.score, 4) for output in scores])


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(runner="pooling")
    main(parser.parse_args())
