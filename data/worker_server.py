"""What the worker server of a training process imports once, before it starts that process's
DataLoader workers. Never imported by a training process itself: only by the server that
data.loader.loader_workers starts (multiprocessing's forkserver, which imports the modules named
in its preload list and nothing else).

- SIGTERM is ignored. The server shares its training process's process group, which torch elastic's
  agent signals as a whole (os.killpg) and SLURM's `scancel --signal` signals process by process; a
  server that died of it would leave the workers without their parent, and torch's workers end when
  their parent does, so the training process would fail ("DataLoader worker exited unexpectedly")
  instead of saving the checkpoint the signal asks for. It still ends with its training process,
  which it watches through a pipe. Workers get SIGTERM back: data.loader.own_process_group.
- torch's DataLoader worker loop, and the training script itself (everything it imports), are
  imported here once, so that each worker, forked from this process, starts in milliseconds and not
  in the seconds an import of torch takes. multiprocessing's forkserver was meant to import the
  script by itself, but CPython 3.11-3.13 never pass it the script's path.
"""
import os
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch.utils.data  # noqa: E402  (after the signal: an import is seconds long)

MAIN_PATH = "DATA_WORKER_SERVER_MAIN"  # the training script's path (data.loader.SERVER_MAIN), set while the server starts


def _import_main():
    path = os.environ.pop(MAIN_PATH, None)
    if not path:
        return
    from multiprocessing import spawn

    try:  # as the script's own workers would import it (then they find it imported already)
        spawn.import_main_path(path)
    except BaseException:  # noqa: BLE001  each worker imports it again and shows the error where it matters
        pass


_import_main()
