"""Processes that meet on one data folder at the same moment: a prepare's lock, its swap and its
check that the set is already there. Each test releases its processes together with a barrier, many
rounds over, and counts the rounds that went wrong."""

import os

import pytest

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


# ---------------------------------------------------------------------------------------- the swap

INPUTS = [{"name": "eight rows", "blake2b": "0"}]
RENAME = os.rename


def prepare_like_a_script(out, arguments, force=False, seconds=0.0):
    """What data/local_files.py and the others do: nothing if up to date, else a new set (taking
    `seconds` more to write) swapped in."""
    import time

    import torch

    from data.atomic_folder import atomic_folder, up_to_date
    from data.shards import fingerprint, write_manifest, write_shards

    if up_to_date(out, INPUTS, arguments, force):
        return "up to date"
    with atomic_folder(out, force, fingerprint(INPUTS, arguments)) as tmp:
        write_shards({"x": torch.arange(8)}, tmp, "train", 1)
        time.sleep(seconds)
        write_manifest(tmp, INPUTS, arguments)
    return "written"


def no_renameat2(*args, **kwargs):
    """ctypes.CDLL where the C library has no renameat2 (glibc before 2.28)."""
    raise OSError("no renameat2 here")


def without_rename_exchange():
    """exchange() as on NFS (in this process only): no renameat2, so its three renames, each a round
    trip to the server that takes a while."""
    import ctypes
    import time

    def slow_rename(src, dst):
        RENAME(src, dst)
        time.sleep(0.001)

    ctypes.CDLL, os.rename = no_renameat2, slow_rename


def test_a_swap_by_renames_never_strands_the_old_set(tmp_path):
    """A prepare rewrites a set (--force) by three renames, the folder missing between the first two,
    while another process takes the folder's lock: 100 rounds. Whatever happens, the old set is in the
    folder or in a folder the next prepare's clean-up removes, never under a name nothing matches."""
    import re
    import time

    def rewrite(n, barrier):
        out = str(tmp_path / f"round_{n}" / "out")
        prepare_like_a_script(out, {"round": n})
        without_rename_exchange()
        barrier.wait()
        try:
            return prepare_like_a_script(out, {"round": n}, force=True)
        finally:
            barrier.wait()

    def take(n, barrier):
        out = str(tmp_path / f"round_{n}" / "out")
        barrier.wait()
        deadline = time.monotonic() + 5
        while not any(name.startswith(".prepare-") for name in os.listdir(tmp_path / f"round_{n}")):
            if time.monotonic() > deadline:  # the rewrite was over before this process looked
                break
        while time.monotonic() < deadline:
            try:
                lock_folder(out, note=quiet).release()
                break
            except FolderBusy:
                continue
        barrier.wait()
        return "took it"

    rounds = 100
    rewritten, _ = race([rewrite, take], rounds)
    ours = re.compile(r"^\.prepare-out-[0-9a-f]{8}$")
    stranded = [
        name
        for n in range(rounds)
        for name in os.listdir(tmp_path / f"round_{n}")
        if name != "out" and not ours.match(name)
    ]
    assert not stranded, f"{len(stranded)} of {rounds} rounds left the old set where no clean-up looks: {stranded[0]}"
    for n, outcome in enumerate(rewritten):  # a set in the folder, or the old one where the next prepare removes it
        sets = [
            name
            for name in os.listdir(tmp_path / f"round_{n}")
            if os.path.isfile(tmp_path / f"round_{n}" / name / "manifest.json")
        ]
        assert sets == ["out"] or (sets and outcome.startswith("DataError: another process made")), (sets, outcome)


def test_a_swap_by_renames_that_cannot_put_the_new_set_in_puts_the_old_one_back(tmp_path, monkeypatch):
    import ctypes

    from data.errors import DataError

    out = str(tmp_path / "out")
    prepare_like_a_script(out, {"set": "old"})
    before = open(os.path.join(out, "manifest.json")).read()
    rename = os.rename

    def new_set_refused(src, dst):  # what another process's lock file in the folder made again does
        if dst == out and '"set": "new"' in open(os.path.join(src, "manifest.json")).read():
            raise OSError(39, "Directory not empty", dst)
        rename(src, dst)

    monkeypatch.setattr(ctypes, "CDLL", no_renameat2)
    monkeypatch.setattr(os, "rename", new_set_refused)
    with pytest.raises(DataError, match="Directory not empty"):
        prepare_like_a_script(out, {"set": "new"})
    assert open(os.path.join(out, "manifest.json")).read() == before
    assert os.listdir(tmp_path) == ["out"]


# ---------------------------------------------------------------------------------------- two prepares


def test_two_prepares_of_the_same_set_started_together_both_get_it(tmp_path):
    """Two runs reach the prepare of the same cold folder together (one up to 10 ms later), 100 rounds:
    both used to see the set missing and the second was refused ('in use as a data folder being
    prepared'); now the second waits and gets the first's set, and each folder ends up to date."""
    import random
    import time

    from data.atomic_folder import up_to_date

    def prepare(n, barrier):
        time.sleep(random.random() * 0.01)
        return prepare_like_a_script(str(tmp_path / f"round_{n}"), {"round": n}, seconds=0.005)

    rounds = 100
    first, second = race([prepare, prepare], rounds)
    refused = [o for o in first + second if o not in ("written", "up to date")]
    assert not refused, f"{len(refused)} of {2 * rounds} prepares failed, e.g. {refused[0]}"
    assert all(up_to_date(str(tmp_path / f"round_{n}"), INPUTS, {"round": n}) for n in range(rounds))


def test_a_prepare_of_another_set_into_a_folder_being_prepared_is_refused_naming_the_holder(tmp_path, capsys):
    from data.atomic_folder import atomic_folder, up_to_date
    from data.errors import DataError
    from data.shards import fingerprint

    out = str(tmp_path / "out")
    held = lock_folder(out, what="a data folder being prepared", job=fingerprint(INPUTS, {"set": "one"}))
    try:
        assert not up_to_date(out, INPUTS, {"set": "two"})
        with pytest.raises(DataError, match=f"in use as a data folder being prepared by pid {os.getpid()}"):
            with atomic_folder(out):
                pass
    finally:
        held.release()
    assert "waiting" not in capsys.readouterr().out
