"""Run train/SCRIPT.py as its `__main__` would (errors as one line), with one fault planted:

    fault_probe.py SCRIPT --nan_at K [--rank R] -- SCRIPT_ARGS...   the K-th training loss on rank R is NaN
    fault_probe.py SCRIPT --stale_latest [--rank R] -- SCRIPT_ARGS...  rank R sees no checkpoint in the folder
    fault_probe.py sft --slow_prepare S -- SCRIPT_ARGS...     rank 0's tokenizing takes S seconds longer
    fault_probe.py SCRIPT --raise_at K [--rank R] [--user_error] -- SCRIPT_ARGS...   the K-th training
        loss on rank R raises ValueError (with --user_error: one of the project's one-line errors)
    fault_probe.py SCRIPT --full_at_the_end -- SCRIPT_ARGS...   the final model.safetensors meets a full
        disk on rank 0 (the one that writes it)

The second is what a rank sees when a checkpoint lands between two ranks' looks at the folder:
only the main process's answer may count. No hooks in the training code: public functions are
wrapped from outside.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn.functional as F


def main():
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--nan_at", type=int, default=None)
    parser.add_argument("--stale_latest", action="store_true")
    parser.add_argument("--slow_prepare", type=float, default=None)
    parser.add_argument("--raise_at", type=int, default=None)
    parser.add_argument("--user_error", action="store_true")
    parser.add_argument("--full_at_the_end", action="store_true")
    args = parser.parse_args(sys.argv[1:split])
    mine = int(os.environ.get("RANK", 0)) == args.rank
    if mine and args.nan_at:
        real, calls = F.mse_loss, [0]

        def mse_loss(*a, **k):
            loss = real(*a, **k)
            calls[0] += 1
            return loss * float("nan") if calls[0] == args.nan_at else loss

        F.mse_loss = mse_loss
    if mine and args.raise_at:
        real, calls = F.mse_loss, [0]

        def mse_loss(*a, **k):
            calls[0] += 1
            if calls[0] == args.raise_at:
                if args.user_error:
                    from data.errors import fail

                    fail(f"planted user error at loss {calls[0]}; nothing to fix")
                raise ValueError(f"planted failure at loss {calls[0]}\nits second line")
            return real(*a, **k)

        F.mse_loss = mse_loss
    if mine and args.full_at_the_end:
        import errno

        import train.core.loop

        def save_weights(tensors, path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        train.core.loop.save_weights = save_weights
    if mine and args.stale_latest:
        import train.core.checkpoint

        train.core.checkpoint.list_checkpoints = lambda output_dir: []
    if mine and args.slow_prepare:  # before the script imports it by name
        import time

        import data.prompt_response

        real = data.prompt_response.prepare_prompt_response

        def prepare_prompt_response(*a, **k):
            time.sleep(args.slow_prepare)
            return real(*a, **k)

        data.prompt_response.prepare_prompt_response = prepare_prompt_response
    from train.core.run import run

    module = __import__(f"train.{args.script}", fromlist=["main"])
    run(module.main, module.parse_args(sys.argv[split + 1 :]))


if __name__ == "__main__":
    main()
