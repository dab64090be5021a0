"""`python -m launch.generate "prompt" [hydra overrides...]`: offline generation through the Engine.

With no model.path the embedded SmolLM2-135M-Instruct answers; prompts are wrapped in the model's
chat template unless `--raw` is given.
"""

from __future__ import annotations

import argparse
import sys

from moeserve import Engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="+", help="prompt text (several = a batch)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("-o", "--override", action="append", default=[],
                        help="Hydra override, e.g. -o model.path=DIR -o device=cpu")
    args = parser.parse_args(argv)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    with Engine(overrides=args.override) as engine:
        if args.raw:
            outs = engine.generate(prompts=args.prompt, sampling_params=params)
        else:
            ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
            outs = engine.generate(input_ids=ids, sampling_params=params)
    for prompt, out in zip(args.prompt, outs):
        print(f"> {prompt}\n{out['text']}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
