"""Which pretrained model a run fine-tunes, as one short hash (model_fingerprint): recorded in args.json
and in checkpoints, so that a resume from another model, or from the same folder whose config or
weights have changed since, is refused. A Hub model is named by its snapshot's commit; a local folder
by its config and the sha256 of each weights file, remembered in --cache_dir so that a second start
reads no weights."""

import os

FINGERPRINTS = "model_fingerprints.json"  # in --cache_dir: each weights file's hash, by its path and stat


def model_fingerprint(name, folder, cache_dir=None):
    """Of the model `name` in `folder` (resolve_model's): a Hub model's commit (its snapshot folder's
    name); a local folder's config.json and the whole content of each weights file (sha256, the
    Hub's own hash of a weights file). Two fine-tunes of one base that differ in one middle layer are
    two models: a safetensors file's first and last MiB (its header, embeddings, head, last norm)
    can be the same in both. A file's hash is remembered in CACHE_DIR/model_fingerprints.json by its
    real path, size, mtime, ctime, inode and device (a rewrite or a copy changes one of them), so a
    second start reads no weights; without `cache_dir`, or where it cannot be written, every start
    hashes them."""
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    if os.path.abspath(folder) != os.path.abspath(name):  # a Hub snapshot: the commit names every file of it
        h.update(f"hub:{name}@{os.path.basename(os.path.normpath(folder))}".encode())
        return h.hexdigest()
    for entry in sorted(os.listdir(folder)):
        full = os.path.join(folder, entry)
        if not os.path.isfile(full):
            continue
        if entry == "config.json":
            with open(full, "rb") as f:
                h.update(b"config.json\0" + f.read())
        elif entry.endswith((".safetensors", ".bin")):
            h.update(f"{entry}\0{os.path.getsize(full)}\0{_file_hashes(full, cache_dir)}".encode())
    return h.hexdigest()


def _file_stat(path):
    s = os.stat(path)
    return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev]


def _still(path, stat):
    try:
        return _file_stat(path) == stat
    except OSError:
        return False


def _sha256(path):
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_hashes(path, cache_dir):
    """`path`'s sha256, remembered in CACHE_DIR/model_fingerprints.json by its real path and stat: under
    a lock, so the processes of one launch hash a file once (the others wait and read it), and
    written whole (a temporary file, then os.replace), so a reader never meets half a file."""
    import json
    import tempfile

    from filelock import FileLock

    path = os.path.realpath(path)  # a folder of links to another's weights shares its hashes
    if cache_dir is None:
        return _sha256(path)
    memo = os.path.join(cache_dir, FINGERPRINTS)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = FileLock(memo + ".lock")
        lock.acquire()
    except OSError:  # a cache that cannot be written: hash without remembering
        return _sha256(path)
    try:
        try:
            with open(memo) as f:
                known = json.load(f)
        except (OSError, ValueError):
            known = {}
        stat = _file_stat(path)
        entry = known.get(path)
        if isinstance(entry, dict) and entry.get("stat") == stat:
            return entry["sha256"]
        digest = _sha256(path)
        if _file_stat(path) != stat:  # written while it was read: no hash of it to remember
            return digest
        known[path] = {"stat": stat, "sha256": digest}
        # files gone or changed since their hash was taken are forgotten, so the memo stays small
        known = {p: e for p, e in known.items() if isinstance(e, dict) and _still(p, e.get("stat"))}
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{FINGERPRINTS}.")
            with os.fdopen(fd, "w") as f:
                json.dump(known, f, indent=1, sort_keys=True)
            os.replace(tmp, memo)
        except OSError:  # remembered another time
            if tmp and os.path.exists(tmp):
                os.remove(tmp)
        return digest
    finally:
        lock.release()
