# vLLM's examples/offline_inference/basic/chat.py pattern: one conversation, a batch of them,
# and a chat template given by file.
from argparse import Namespace

from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser


def main(args: Namespace) -> None:
    chat_template_path = args.chat_template_path
    del args.chat_template_path
    sampling_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9)
    del args.max_tokens
    llm = LLM(**vars(args))
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    for output in llm.chat(conversation, sampling_params, use_tqdm=False):
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
    conversations = [conversation for _ in range(4)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print(f"{len(outputs)} conversations answered")
    if chat_template_path:
        with open(chat_template_path) as f:
            chat_template = f.read()
        outputs = llm.chat(conversations, sampling_params, use_tqdm=False,
                           chat_template=chat_template)
        print(f"with the template: {outputs[0].prompt!r}")


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chat-template-path", type=str, default=None)
    main(parser.parse_args())
