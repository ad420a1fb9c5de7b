"""WordNet's noun definitions labelled with their supersense: real English text to classify, offline.

    python -m data.wordnet --output_dir runs/text/wordnet      (make text-data fetches WordNet first)

writes train.csv (5,000 rows) and validation.csv (1,000) with columns text,label for
train/text_classification.py. WordNet 3.0 files each noun synset under one supersense (noun.animal,
noun.artifact, ...); `text` is the synset's definition, `label` its supersense without "noun.": 8 distinct
classes of 2,000+ synsets each, 625 training and 125 validation rows per class, so accuracy reads plainly.

The gloss's quoted examples are left out: they are sentences using the word, not its meaning ("he sprayed
the garden to get rid of pests"), and only 4% of these synsets have any, so every row is one kind of text.
A definition two synsets share is left out (11 share "a genus of bacteria"): it cannot be learned under
two labels, and copies would cross the split. The sha1 of the synset offset picks the synsets and the
split, so the same WordNet gives byte-identical files anywhere; a rerun that would write the same bytes
writes nothing. Source: Debian's wordnet-base, installed or unpacked (make text-data); it ships no
`lexnames` file, so the numbers below are lexnames(5WN)'s.
"""

import argparse
import collections
import csv
import hashlib
import io
import os

from data.errors import DataError

WORDNET_FOLDERS = ("/usr/share/wordnet", os.path.join("runs", "corpora", "wordnet", "usr", "share", "wordnet"))
HOW_TO_GET = (
    "run `make text-data`, or `apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb runs/corpora/wordnet`"
)
LEXNAMES = {
    "05": "noun.animal",
    "06": "noun.artifact",
    "08": "noun.body",
    "13": "noun.food",
    "15": "noun.location",
    "18": "noun.person",
    "20": "noun.plant",
    "27": "noun.substance",
}
TRAIN_PER_CLASS, VALIDATION_PER_CLASS = 625, 125


def find_wordnet(folder=None):
    for candidate in [folder] if folder else WORDNET_FOLDERS:
        if os.path.isfile(os.path.join(candidate, "data.noun")):
            return candidate
    raise DataError(f"WordNet's data.noun is not in {folder or ', '.join(WORDNET_FOLDERS)}; {HOW_TO_GET}")


def read_lexnames(folder):
    """Lexicographer file number -> name: the folder's `lexnames` file where it has one, else lexnames(5WN)."""
    path = os.path.join(folder, "lexnames")
    if not os.path.isfile(path):
        return LEXNAMES
    with open(path, encoding="utf-8") as f:
        return dict(line.split()[:2] for line in f if line.strip())


def definitions(folder):
    """[(synset offset, supersense, definition)] of the nouns in the 8 classes, in file order."""
    wanted = {number: name for number, name in read_lexnames(folder).items() if name in LEXNAMES.values()}
    rows = []
    with open(os.path.join(folder, "data.noun"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("  ") or " | " not in line:  # the license header's lines start with two spaces
                continue
            head, gloss = line.split(" | ", 1)
            offset, lex_filenum = head.split(" ", 2)[:2]
            if lex_filenum in wanted:
                parts = [p.strip() for p in gloss.split(";")]
                text = "; ".join(p for p in parts if p and not p.startswith('"'))
                rows.append((offset, wanted[lex_filenum][len("noun.") :], text))
    return rows


def split_rows(rows, train_per_class, validation_per_class):
    """(train, validation) of (text, label): per class, the synsets ranked by the sha1 of their offset; the first
    validation_per_class go to validation, the next train_per_class to train; each split in sha1 order."""
    copies = collections.Counter(text for _, _, text in rows)
    by_class = collections.defaultdict(list)
    for offset, label, text in rows:
        if copies[text] == 1:
            by_class[label].append((hashlib.sha1(offset.encode()).hexdigest(), text, label))
    train, validation = [], []
    for ranked in by_class.values():
        ranked.sort()
        validation += ranked[:validation_per_class]
        train += ranked[validation_per_class : validation_per_class + train_per_class]
    return [row[1:] for row in sorted(train)], [row[1:] for row in sorted(validation)]


def csv_text(rows):
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([("text", "label")] + rows)
    return out.getvalue()


def write_if_changed(path, text):
    """`text` into a temporary name beside path, renamed over path; nothing when path holds it already."""
    if os.path.isfile(path):
        with open(path, encoding="utf-8", newline="") as f:
            if f.read() == text:
                return False
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir", default=os.path.join("runs", "text", "wordnet"), help="where train.csv and validation.csv go"
    )
    parser.add_argument(
        "--wordnet_dir",
        default=None,
        help=f"the folder holding data.noun; default: the first of {', '.join(WORDNET_FOLDERS)}",
    )
    args = parser.parse_args(argv)
    try:
        rows = definitions(find_wordnet(args.wordnet_dir))
        train, validation = split_rows(rows, TRAIN_PER_CLASS, VALIDATION_PER_CLASS)
        os.makedirs(args.output_dir, exist_ok=True)
        wrote = [
            write_if_changed(os.path.join(args.output_dir, f"{name}.csv"), csv_text(split))
            for name, split in (("train", train), ("validation", validation))
        ]
    except (DataError, OSError) as e:
        parser.exit(1, f"error: {e}\n")
    counts = collections.Counter(label for _, label in train)
    print(
        f"{'wrote' if any(wrote) else 'up to date:'} {args.output_dir}: train.csv {len(train)} rows, "
        f"validation.csv {len(validation)} rows; {len(counts)} classes: "
        + ", ".join(f"{label} {n}" for label, n in sorted(counts.items()))
    )


if __name__ == "__main__":
    main()
