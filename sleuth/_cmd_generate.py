"""`sleuth generate`: sample text from a trained checkpoint, printed token by token."""
from __future__ import annotations

import argparse
from typing import Any

from sleuth.cli import CliError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a trained checkpoint",
        description="Load a checkpoint (a run directory means its latest checkpoint) and print "
        "generated text as it comes. --temperature 0 is greedy; a --seed fixes the sample.",
    )
    p.add_argument("--checkpoint", required=True, metavar="RUN", help="run directory or checkpoints/step<S> directory")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn (for SFT-trained models)")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                   help="stop after N new tokens (default 200; sooner at an end-of-text token)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divide the logits by this before sampling; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample only among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample only among the most likely tokens whose probabilities sum to P "
                   "(nucleus sampling, 0 < P <= 1; default: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="above 1 makes tokens already in the text less likely (default 1.0: off)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler: the same seed gives the same text (default 0)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import codecs
    import sys

    import trainer
    from trainer.data import ASSISTANT, BOS, EOS, USER

    try:
        model = trainer.load_model(args.checkpoint)
    except trainer.TrainerError as e:
        raise CliError(str(e)) from e
    tok = trainer.ByteTokenizer()
    prompt = [BOS, USER, *tok.encode(args.prompt), ASSISTANT] if args.chat else [BOS, *tok.encode(args.prompt)]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(args.prompt if not args.chat else "")
    try:
        stream = trainer.stream_generate(
            model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
            seed=args.seed, stop_ids=(EOS,))
        for token in stream:
            if token < 256:
                sys.stdout.write(decoder.decode(bytes([token])))
                sys.stdout.flush()
    except ValueError as e:
        raise CliError(str(e)) from e
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return 0
