"""What the worker server of a training process imports once, before it starts that process's
DataLoader workers. Never imported by a training process: only by the server that
data.workers.loader_workers starts (multiprocessing's forkserver, which imports the modules named in
its preload list), as the top-level module `worker_server`.

- SIGTERM is ignored. The server shares its training process's process group, which torch elastic's
  agent signals as a whole (os.killpg), and SLURM's `scancel --signal` signals process by process; a
  server that died of it would end the workers (torch's workers end when their parent does) and the
  training process would fail instead of saving the checkpoint the signal asks for. The server ends
  once its training process and its workers have (it watches a pipe they hold); each worker follows
  its training process (data.workers.own_process_group).
- torch's DataLoader worker loop and the training script, with everything the script imports, are
  imported here once, as multiprocessing prepares every new process of the training process (its
  import path, argv, working folder), and then every other module the training process had imported
  when it started this server (torchvision's transforms, PIL, imported on first use): each worker,
  forked from this process, starts in milliseconds instead of the seconds those imports take.
  multiprocessing's forkserver was meant to import the script by itself, but CPython 3.11-3.13
  never pass it the script's path. The launcher's rank
  variables are hidden meanwhile: code of the script outside `if __name__ == "__main__":` that
  starts a process group must not join the training's as one rank too many.
"""

import importlib
import json
import os
import signal
import sys

if os.path.dirname(os.path.abspath(__file__)) in sys.path:  # put there for this import alone
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch.utils.data  # noqa: E402,F401  (after the signal: an import of torch takes seconds)

SERVER = "DATA_WORKER_SERVER"  # data.workers.SERVER
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _import_the_script():
    start = json.loads(os.environ.pop(SERVER, "null"))
    if start is None:
        return
    python_path = start.pop("python_path")
    if python_path is None:  # as the training process has it, for the workers
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = python_path
    hidden = {
        name: os.environ.pop(name)
        for name in list(os.environ)
        if name in RANK_VARIABLES or name.startswith("TORCHELASTIC_")
    }
    from multiprocessing import spawn

    modules = start.pop("modules")
    try:
        spawn.prepare(start)
    except BaseException as e:  # noqa: BLE001  each worker then imports the script itself, and fails where it shows
        print(
            f"worker server: importing the script failed ({type(e).__name__}: {e}); each DataLoader worker "
            "imports it instead",
            file=sys.stderr,
            flush=True,
        )
    try:
        with open(modules) as f:
            names = json.load(f)
        os.remove(modules)
    except (OSError, ValueError):  # an exception here would end the server, and every worker's start with it
        names = []
    try:
        for name in names:  # sorted: a package before its modules
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except BaseException:  # noqa: BLE001  an alias, a module made at run time: left to the workers
                    pass
    finally:
        os.environ.update(hidden)


_import_the_script()
