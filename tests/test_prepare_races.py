"""Processes that meet on one data folder at the same moment: a prepare's lock, its swap and its
check that the set is already there. Each test releases its processes together with a barrier, many
rounds over, and counts the rounds that went wrong."""
import os

from data.locks import FolderBusy, lock_folder
from races import quiet, race


# ---------------------------------------------------------------------------------------- the lock

def test_a_folder_removed_while_another_process_locks_it_is_made_again_not_a_crash(tmp_path):
    """One process removes a folder it created (a failed first prepare: .lock and the folder, then it
    lets go) while another takes its lock: 300 rounds, none may end in FileNotFoundError or
    FileExistsError from between lock_folder's makedirs and its open."""
    def remove(n, barrier):
        out = str(tmp_path / f"round_{n}")
        lock = lock_folder(out, note=quiet)
        barrier.wait()
        try:
            os.remove(os.path.join(out, ".lock"))
            os.rmdir(out)
        except OSError:  # the other process made it again meanwhile: its folder now
            pass
        lock.release()
        return "removed"

    def take(n, barrier):
        out = str(tmp_path / f"round_{n}")
        barrier.wait()
        for _ in range(500):
            try:
                lock = lock_folder(out, note=quiet)
            except FolderBusy:
                continue
            lock.release()
            return "locked"
        return "busy throughout"

    rounds = 300
    _, taken = race([remove, take], rounds)
    crashed = [o for o in taken if o not in ("locked", "busy throughout")]
    assert not crashed, f"{len(crashed)} of {rounds} rounds crashed, e.g. {crashed[0]}"
