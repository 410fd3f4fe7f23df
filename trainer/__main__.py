"""`python -m trainer` (also under torchrun): the same arguments as `sleuth train`, no tools."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from trainer import (ConfigError, OtherRunError, TrainerError, exit_worker, load_config,
                         report_refusal, train)

    # no abbreviations: `--res x` is a typo, not --resume
    parser = argparse.ArgumentParser(prog="python -m trainer",
                                     description="Train the reference GPT.", allow_abbrev=False)
    parser.add_argument("--config", help="JSON file of config keys (any subset)")
    parser.add_argument("--preset", default="tiny", help="starting config: tiny (default) or small")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, e.g. --set optim.lr=1e-3 (repeatable)")
    parser.add_argument("--run-dir", help="run directory (overrides run_dir)")
    parser.add_argument("--resume", help="checkpoint or run directory to continue from, or 'latest'")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of another run found in the run directory")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, *(["overwrite=true"] if args.overwrite else [])]
    try:
        train(load_config(args.config, preset=args.preset, overrides=overrides,
                          run_dir=args.run_dir, resume=args.resume),
              argv=[sys.executable, "-m", "trainer", *(sys.argv[1:] if argv is None else argv)])
    except OtherRunError as e:  # every rank refuses alike: said once a machine, exit 2
        report_refusal(f"trainer: error: {e}")
        if argv is None:
            exit_worker(2)
        return 2
    except (ConfigError, TrainerError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    if argv is None:  # the command, not a call from Python: a torchrun worker leaves now
        exit_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main())
