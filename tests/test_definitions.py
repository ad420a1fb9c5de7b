"""data/definitions.py: GCIDE entries as they are written (markup, bracketed etymologies, several senses,
entries to leave out) parsed into (headword, definition); pairs split by the dictionary's own document
split; files written whole, and not again; the one-line refusal without GCIDE; and, where GCIDE is
installed or unpacked (make gcide), a slice of the real dictionary."""

import gzip
import itertools
import json
import os
import re

import pytest

from data import definitions
from data.errors import DataError
from data.text import GCIDE_HOW_TO_GET, VALIDATION_EVERY, find_gcide, gcide_documents

# Entries as dict-gcide's text has them (a few cut short), with what parse_entry must give
ENTRIES = [
    # an etymology over two lines, a quotation and a citation after the first sense, a second sense
    (
        'Donative \\Don"a*tive\\, n. [L. donativum, fr. donare: cf. F.\n   donatif. See {Donate}.]\n'
        '   1. A gift; a largess; a gratuity; a present. "The Romans were\n      entertained with shows and donatives."'
        " --Dryden.\n      [1913 Webster]\n\n   2. (Eccl. Law) A benefice conferred on a person by the\n"
        "      founder or patron.\n      [1913 Webster]",
        ("Donative", "A gift; a largess; a gratuity; a present."),
    ),
    # a field label, subsenses (a) and (b), a cross-reference in braces
    (
        'Auricle \\Au"ri*cle\\, n. [L. auricula, dim. of auris ear. See\n   {Ear}.]\n   1. (Anat.)\n'
        "      (a) The external ear, or that part of the ear which is\n          prominent from the head.\n"
        "      (b) The chamber, or one of the two chambers, of the heart.\n          See {Heart}.\n"
        "          [1913 Webster]\n\n   2. (Zool.) An angular or ear-shaped lobe.\n      [1913 Webster]",
        ("Auricle", "The external ear, or that part of the ear which is prominent from the head."),
    ),
    # a pronunciation in parentheses, derived forms after " -- {", accented letters in [mark letter]
    (
        'Blamable \\Blam"a*ble\\ (bl[=a]m"[.a]*b\'l), a. [Cf. F.\n   bl[^a]mable.]\n'
        "   Deserving of censure; faulty; culpable; reprehensible;\n"
        '   censurable; blameworthy. -- {Blam"a*ble*ness}, n. --\n   {Blam"a*bly}, adv.\n   [1913 Webster]',
        ("Blamable", "Deserving of censure; faulty; culpable; reprehensible; censurable; blameworthy."),
    ),
    # the headword's acute accents, which the dictd text writes as 'e, come back from the pronunciation
    (
        "Pis'e \\Pi`s['e]\"\\, n. [F.]\n   Rammed earth or clay used to form walls, as in a\n   caf['e]. [Obs.]\n"
        "   [1913 Webster]",
        ("Pisé", "Rammed earth or clay used to form walls, as in a café."),
    ),
    # two headwords over two lines, a label after the part of speech, a source line running on into the next entry
    (
        'Tetradynamian \\Tet`ra*dy*na"mi*an\\, Tetradynamous\n\\Tet`ra*dyn"a*mous\\, a. (Bot.)\n'
        "   Belonging to the order Tetradynamia; having six stamens, four\n   of which are uniformly longer than the"
        " others.\n   [1913 Webster] Tetragon",
        (
            "Tetradynamian",
            "Belonging to the order Tetradynamia; having six stamens, four of which are uniformly longer "
            "than the others.",
        ),
    ),
    # WordNet's entries: lowercase, numbered, synonyms after a blank line, "Also See:" pointers
    (
        'bangtail \\bang"tail\\ n.\n   1. a horse bred for racing. Also See: racehorse.\n\n'
        "   Syn: racehorse, race horse.\n        [WordNet 1.5]",
        ("bangtail", "A horse bred for racing."),
    ),
    # a stray source line before the first sense, the text of the previous entry before the headword
    (
        'for.                                        --Locke.\nIrritant \\Ir"ri*tant\\, n. [Cf. F. irritant.]\n'
        "   [1913 Webster]\n   1. That which irritates or excites.\n      [1913 Webster]\n\n"
        "   2. (Physiol. & Med.) Any agent by which irritation is\n      produced.\n      [1913 Webster]",
        ("Irritant", "That which irritates or excites."),
    ),
    # left out: a pointer, an inflection, too short, a suffix, a number, a lost character, a phrase only, no headword
    ('Marmozet \\Mar"mo*zet`\\, n.\n   See {Marmoset}.\n   [1913 Webster]', None),
    ("Red \\Red\\,\n   imp. & p. p. of {Read}.\n   [1913 Webster]", None),
    ("Straik \\Straik\\, n.\n   A strake.\n   [1913 Webster]", None),
    ("-ling \\-ling\\ (-l[i^]ng).\n   A noun suffix having a diminutive force.\n   [1913 Webster]", None),
    ("24 \\24\\ adj.\n   1. being four more than twenty.\n\n   Syn: twenty-four, xxiv.\n        [WordNet 1.5]", None),
    ('Kibble \\Kib"ble\\, n.\n   A large bucket for raising ore from a m[-i]ne.\n   [1913 Webster]', None),
    ("Gag \\Gag\\, n.\n   {Gag rein} (Harness), a rein for drawing the bit upward.\n   [1913 Webster]", None),
    ("[1913 Webster]\n\n   2. (Min.) A rose-red mineral, a hydrous arseniate of cobalt.\n   [1913 Webster]", None),
]


def test_entries_give_their_headword_and_first_definition():
    for document, expected in ENTRIES:
        assert definitions.parse_entry(document) == expected, document


def test_a_definition_over_the_length_limit_is_left_out():
    long = "Zinc \\Zinc\\, n.\n   An abundant element" + ", bluish white" * 30 + ".\n   [1913 Webster]"
    assert definitions.parse_entry(long) is None
    assert definitions.parse_entry(long.replace(", bluish white" * 30, ", bluish white")) == (
        "Zinc",
        "An abundant element, bluish white.",
    )


def dictd(n):
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    digits = ""
    while True:
        digits = alphabet[n % 64] + digits
        n //= 64
        if not n:
            return digits


def fake_gcide(folder, documents):
    """A dictd database the way dict-gcide ships it (tests/test_text.py has the same): gzip-compatible
    text and an index of base-64 spans, with a metadata entry gcide_documents leaves out."""
    text = b"00-database-info\nThis file was converted ...\n"
    index = [("00-database-info", 0, len(text))]
    for i, document in enumerate(documents):
        raw = document.encode("utf-8") + b"\n\n"
        index.append((f"head{i}", len(text), len(raw)))
        text += raw
    os.makedirs(folder, exist_ok=True)
    with gzip.open(os.path.join(folder, "gcide.dict.dz"), "wb") as f:
        f.write(text)
    with open(os.path.join(folder, "gcide.index"), "w", encoding="utf-8") as f:
        f.writelines(f"{word}\t{dictd(start)}\t{dictd(length)}\n" for word, start, length in index)
    return str(folder)


def entry(word, definition):
    return f"{word} \\{word}\\, n.\n   {definition}\n   [1913 Webster]"


WORDS = ["".join(letters).capitalize() for letters in itertools.product("bcdfg", "aeiou", "lmnrst", "aeiou")][:300]


def dictionary():
    """300 entries, of which gcide_documents makes 3 validation ones (the 100th, 200th, 300th): the 100th a
    word of its own, the 200th a second entry of a training word, the 300th a pointer; in training a word
    with two entries and one whose first entry is a pointer."""
    documents = [entry(word, f"The thing called {word.lower()} in the list.") for word in WORDS]
    documents[199] = entry(WORDS[5].lower(), "Another sense of a training word.")
    documents[299] = entry(WORDS[299], "See {Something}.")
    documents[11] = entry(WORDS[10], "A second entry of the same word.")
    documents[20] = entry(WORDS[20], "Same as {Other}.")
    documents[21] = entry(WORDS[20], "The entry of this word that defines it.")
    return documents


def test_pairs_follow_the_document_split_one_per_word(tmp_path):
    train_documents, validation_documents = gcide_documents(fake_gcide(tmp_path / "gcide", dictionary()))
    assert len(validation_documents) == 300 // VALIDATION_EVERY
    train, validation = definitions.split_pairs(train_documents, validation_documents)
    assert validation == [(WORDS[99], f"The thing called {WORDS[99].lower()} in the list.")]
    words = [word for word, _ in train]
    assert len(words) == len(set(words)) == 297 - 2  # 297 training entries: a second entry and a pointer give none
    assert dict(train)[WORDS[10]] == f"The thing called {WORDS[10].lower()} in the list."  # the first entry
    assert dict(train)[WORDS[20]] == "The entry of this word that defines it."  # the first one that defines it
    assert not {w.casefold() for w, _ in validation} & {w.casefold() for w in definitions.headwords(train_documents)}


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_main_writes_seeded_cuts_once_and_rewrites_a_changed_file(tmp_path, capsys):
    folder = fake_gcide(tmp_path / "gcide", dictionary())
    full, out = tmp_path / "full", tmp_path / "out"
    definitions.main(["--gcide_dir", folder, "--output_dir", str(full)])
    assert capsys.readouterr().out == f"wrote {full}: train.jsonl 295 of 295 pairs, validation.jsonl 1 of 1\n"
    rows = read_jsonl(full / "train.jsonl")
    assert all(list(row) == ["prompt", "response"] and re.fullmatch(r"Define: \w+\n", row["prompt"]) for row in rows)
    assert [row["prompt"] for row in rows] != sorted(row["prompt"] for row in rows)  # shuffled, not alphabetical

    args = ["--gcide_dir", folder, "--output_dir", str(out), "--max_train_rows", "10", "--max_validation_rows", "5"]
    definitions.main(args)
    assert capsys.readouterr().out.startswith(f"wrote {out}: train.jsonl 10 of 295 pairs, validation.jsonl 1 of 1")
    assert read_jsonl(out / "train.jsonl") == rows[:10]  # the cut of the same seeded shuffle
    written = {name: (out / name).read_bytes() for name in ("train.jsonl", "validation.jsonl")}
    stamps = {name: os.stat(out / name).st_mtime_ns for name in written}

    definitions.main(args)
    assert capsys.readouterr().out.startswith(f"up to date: {out}")
    assert {name: os.stat(out / name).st_mtime_ns for name in written} == stamps  # nothing written

    (out / "train.jsonl").write_bytes(written["train.jsonl"][:30])  # a file cut short
    definitions.main(args)
    assert capsys.readouterr().out.startswith("wrote")
    assert {name: (out / name).read_bytes() for name in written} == written
    assert sorted(os.listdir(out)) == ["train.jsonl", "validation.jsonl"]  # no temporary file left

    definitions.main(args[:-4] + ["--seed", "1", "--max_train_rows", "10"])  # another seed, other rows
    assert read_jsonl(out / "train.jsonl") != rows[:10]


def test_missing_gcide_is_one_line_and_exit_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        definitions.main(["--gcide_dir", str(tmp_path / "none"), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: the GCIDE dictionary (gcide.index, gcide.dict.dz) is not in {tmp_path / 'none'}; "
    )
    assert GCIDE_HOW_TO_GET in err
    assert not (tmp_path / "out").exists()


def real_gcide():
    try:
        return find_gcide()
    except DataError:
        pytest.skip("GCIDE is neither installed nor unpacked (make gcide)")


def test_the_real_dictionary_gives_clean_pairs():
    train_documents, validation_documents = gcide_documents(real_gcide())
    train = definitions.pairs_of(train_documents[:6000])
    validation = definitions.pairs_of(validation_documents, exclude=definitions.headwords(train_documents))
    assert len(train) > 4000 and len(validation) > 600  # about 76% of the first 6,000 entries, 848 of 1,262
    assert ("Abhorrence", "Extreme hatred or detestation; the feeling of utter dislike.") in train
    for word, definition in train + validation:
        assert definitions.MIN_DEFINITION_CHARS <= len(definition) <= definitions.MAX_DEFINITION_CHARS
        assert definition.endswith(".") and definition[0].isalnum()
        assert not re.search(r"[\\{}\[\]*]|--[A-Z]", definition), definition
        assert word == word.strip() and "\\" not in word and "\n" not in word
