"""Writing a prepared set into its folder: only what is ours is replaced, one writer at a time, and
the whole set at once.

- Ownership (claim): a folder is replaced only when it is new, empty, or holds nothing but what
  data.prepare's manifest lists, as written (size and sha256; --force: changed files too). A file
  the manifest does not list is never deleted: the prepare is refused naming it.
- One writer: the folder's lock (data/locks.py) is held for the whole prepare. A second prepare of
  the same set (two runs started on the same cold data) waits for the first and uses its set; a
  prepare of another set into the folder is refused, naming the holder.
- All at once: the new set is written to a hidden folder beside it (.prepare-NAME-XXXXXXXX) and
  swapped in with one renameat2(RENAME_EXCHANGE), so a crash never leaves a half-written set looking
  complete; the next prepare of the folder removes what a killed one left there.
- Up to date: the same inputs and arguments, every file as written, is a prepare that writes nothing.
"""

import contextlib
import errno
import os
import re
import secrets
import shutil

from data.errors import DataError
from data.locks import LOCK_NAME, FolderBusy, lock_folder, wait_for_job
from data.shards import MANIFEST, check_files_written, fingerprint, folder_contents, listed_files, prepared_manifest

WRITE_FIXES = {
    errno.ENOSPC: "free some space or pass an --output_dir on another disk",
    errno.EDQUOT: "free some space or pass an --output_dir on another disk",
    errno.EROFS: "pass an --output_dir on a writable disk",
    errno.EACCES: "pass an --output_dir you can write to",
    errno.EPERM: "pass an --output_dir you can write to",
}


@contextlib.contextmanager
def atomic_folder(output_dir, force=False, job=None):
    """A hidden folder beside output_dir to write the new set into (its manifest last); when the block
    ends without an error it takes output_dir's place in one step and the old set is removed. What is
    in output_dir must be this module's own (claim()), checked before anything is written, then again
    under the folder's lock, which is held throughout; a folder this call created is removed again
    if the block fails. OSErrors (a full disk, a read-only folder) are one line saying where.
    `job`, the fingerprint of the set written (data.shards.fingerprint of its inputs and arguments):
    another process preparing the same set is waited for, not refused; if it finished first, its set
    stays and the block's copy is dropped."""
    claim(output_dir, force)
    created = not os.path.isdir(output_dir)
    target = os.path.realpath(output_dir)  # a link to a folder: the folder is replaced, not the link
    try:
        lock = lock_folder(output_dir, what="a data folder being prepared", note=print, job=job)
    except FolderBusy as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(write_error(output_dir, e)) from None
    tmp = None
    try:
        claim(output_dir, force)  # again, holding the lock: it may have changed meanwhile
        # a prepare of the same set started with ours and finished first: its set stays, ours is dropped
        done = job is not None and not force and finished_set(output_dir, job) is not None
        remove_leftovers(target)
        tmp = make_temp_folder(target)
        yield tmp
        if done:
            print(
                f"another process prepared {output_dir} meanwhile with the same inputs and arguments; kept its set, "
                "dropped this copy"
            )
        else:
            os.link(os.path.join(target, LOCK_NAME), os.path.join(tmp, LOCK_NAME))  # the held lock goes along
            exchange(tmp, target)  # tmp now holds the old set
    except OSError as e:
        raise DataError(write_error(output_dir, e)) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if (
            created
            and lock.in_place()
            and not folder_contents(output_dir)
            and not os.path.exists(os.path.join(output_dir, MANIFEST))
        ):
            # a failed first write leaves nothing behind
            with contextlib.suppress(OSError):
                os.remove(os.path.join(output_dir, LOCK_NAME))
                os.rmdir(output_dir)
        lock.release()


def write_error(output_dir, e):
    where = f" ({e.filename})" if e.filename else ""
    return (
        f"could not write --output_dir {output_dir}: {e.strerror or e}{where}; nothing there was changed; "
        f"{WRITE_FIXES.get(e.errno, 'check the folder and run again')}"
    )


def temp_name(output_dir):
    """A hidden name beside output_dir that remove_leftovers() knows as a prepare's of output_dir."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    return os.path.join(parent, f".prepare-{name}-{secrets.token_hex(4)}")


def make_temp_folder(output_dir):
    while True:
        tmp = temp_name(output_dir)
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def remove_leftovers(output_dir):
    """Remove the temporary folders of earlier prepares of output_dir that were killed: their name
    says whose they are, and the caller holds output_dir's lock, so none is a live prepare's."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    pattern = re.compile(rf"^\.prepare-{re.escape(name)}-[0-9a-f]{{8}}$")
    for entry in sorted(os.listdir(parent)):
        path = os.path.join(parent, entry)
        if pattern.match(entry) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            print(f"removed {path}, left behind by a data.prepare of {output_dir} that was stopped")


def exchange(a, b):
    """Swap folders a and b in one step, so b never stops existing (nor the lock file inside it that
    the holder holds). Linux's renameat2(RENAME_EXCHANGE) does it; the os module has no call for it.
    Where the system lacks it, two renames, with a moment without b between them."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), b)
    exchange_by_renames(a, b)


def exchange_by_renames(a, b):
    """Three renames, b missing between the first two: another process locking b then makes it
    again (data/locks.py), and a no longer fits in its place. The old set waits under a name of
    b's temporary folders, so whatever stops us there, the next prepare of b removes it; if a cannot
    take b's place, the old set goes back."""
    old = temp_name(b)
    os.rename(b, old)
    try:
        os.rename(a, b)
    except OSError:
        try:
            os.rename(old, b)
        except OSError:
            raise DataError(
                f"another process made {b} again while this prepare swapped its new set in by renames "
                f"(this file system cannot exchange two folders in one step); the earlier set is in {old} "
                f"until the next prepare of {b} removes it; run the prepare again"
            ) from None
        raise
    os.rename(old, a)


def claim(output_dir, force=False):
    """Refuse (DataError naming a file) unless output_dir is new, empty, or holds only what its
    data.prepare manifest lists, as it was written (with force: changed files may be replaced too).
    Never deletes anything."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"--output_dir {output_dir} is a file; pass a folder")
    present = folder_contents(output_dir) if os.path.isdir(output_dir) else []
    if os.path.isdir(output_dir) and os.path.isfile(os.path.join(output_dir, MANIFEST)):
        present.append(MANIFEST)
    if not present:
        return
    manifest = prepared_manifest(output_dir)  # an unreadable one: one line naming it
    if manifest is None:
        raise DataError(
            f"--output_dir {output_dir} holds files data.prepare did not write ({', '.join(present[:3])}) "
            "and no manifest.json of data.prepare; pass a new or empty folder"
        )
    listed = listed_files(manifest)
    if foreign := [f for f in present if f != MANIFEST and f not in listed]:
        raise DataError(
            f"--output_dir {output_dir} holds files data.prepare did not write ({', '.join(foreign[:3])}), "
            "not in its manifest.json; move them away or pass another folder"
        )
    missing, changed = check_files_written(output_dir, manifest)
    if changed and not force:
        rel, how = changed[0]
        raise DataError(
            f"{os.path.join(output_dir, rel)} changed since data.prepare wrote it ({how}); pass --force "
            f"to write {output_dir} again, or move it away"
        )
    if missing:
        print(
            f"{output_dir}: {len(missing)} file(s) data.prepare wrote are missing ({missing[0]}); writing the set again"
        )


def up_to_date(output_dir, inputs, arguments, force=False):
    """True (and says so) if output_dir already holds these inputs written with these arguments,
    every file still there as written (size and sha256). A prepare of this same set under way in
    another process is waited for first (atomic_folder() with the same job waits for one started
    meanwhile). Holds no lock and writes nothing; anything else is for claim() to judge, under the lock."""
    job = fingerprint(inputs, arguments)
    manifest = None if force else finished_set(output_dir, job)
    if manifest is None and not force and wait_for_job(output_dir, job):
        manifest = finished_set(output_dir, job)
    if manifest is None:
        return False
    rows = ", ".join(f"{split} {entry['rows']} rows" for split, entry in manifest["splits"].items())
    print(f"{output_dir} is up to date ({rows}, fingerprint {manifest['fingerprint']}); nothing written")
    return True


def finished_set(output_dir, job):
    """The manifest of output_dir if it holds the set of fingerprint `job`, every file as written
    and nothing else; None otherwise."""
    try:
        manifest = prepared_manifest(output_dir) if os.path.isdir(output_dir) else None
    except DataError:
        return None
    if manifest is None or manifest.get("fingerprint") != job:
        return None
    missing, changed = check_files_written(output_dir, manifest)
    if missing or changed or any(f not in listed_files(manifest) for f in folder_contents(output_dir)):
        return None
    return manifest


def report(output_dir, manifest):
    """The one line a prepare prints about the set it wrote."""
    rows = ", ".join(
        f"{split}: {entry['rows']} rows in {len(entry['shards'])} shards" for split, entry in manifest["splits"].items()
    )
    columns = ", ".join(f"{k} ({v})" for k, v in next(iter(manifest["splits"].values()))["columns"].items())
    print(f"wrote {output_dir}: {rows}; columns {columns}; fingerprint {manifest['fingerprint']}")
