"""data/wordnet.py on a fake WordNet folder in the real file format: which rows and labels it reads,
a split that depends only on the synsets, files written whole and not again, and the one-line refusal."""

import csv
import hashlib
import os

import pytest

from data import wordnet

HEADER = [
    "  1 This software and database is being provided to you, the LICENSEE, by  \n",
    "  2 Princeton University under the following license.  By obtaining, using  \n",
]
LEXNAMES = "03\tnoun.Tops\t1\n04\tnoun.act\t1\n05\tnoun.animal\t1\n13\tnoun.food\t1\n20\tnoun.plant\t1\n"


def synset(offset, lex_filenum, words, gloss):
    """One data.noun line as wndb(5WN) lays it out: offset, lex_filenum, ss_type, hex word count, words with
    lex_id, pointer count, pointers, then the gloss after ' | ' (and WordNet's two trailing spaces)."""
    word_part = " ".join(f"{w} 0" for w in words)
    return f"{offset:08d} {lex_filenum} n {len(words):02x} {word_part} 001 @ 00001740 n 0000 | {gloss}  \n"


def fake_wordnet(folder, lines, lexnames=LEXNAMES):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "data.noun"), "w", encoding="utf-8") as f:
        f.writelines(HEADER + lines)
    if lexnames is not None:
        with open(os.path.join(folder, "lexnames"), "w", encoding="utf-8") as f:
            f.write(lexnames)
    return str(folder)


def many(n_per_class):
    lines, offset = [], 1000
    for lex_filenum, kind in (("05", "beast"), ("13", "dish"), ("20", "herb")):
        for i in range(n_per_class):
            offset += 17
            lines.append(synset(offset, lex_filenum, [f"{kind}_{i}"], f"a {kind} of kind {i}"))
    return lines


def test_definitions_labels_and_what_is_left_out(tmp_path):
    folder = fake_wordnet(
        tmp_path / "wn",
        [
            synset(1740, "03", ["entity"], "that which is perceived or known"),  # noun.Tops: not a class
            synset(15388, "05", ["animal", "beast"], 'a living organism; "animals move"; "a beast of burden"'),
            synset(7555, "13", ["food"], "any substance that can be metabolized; used for energy"),
            synset(17222, "20", ["plant"], "(botany) a living organism lacking the power of locomotion"),
            synset(36762, "04", ["act"], "something that people do"),  # noun.act: not a class
            synset(50001, "05", ["genus_a"], "a genus of bacteria"),
            synset(50002, "20", ["genus_b"], "a genus of bacteria"),  # shared by two synsets: both left out
        ],
    )
    rows = wordnet.definitions(folder)
    assert rows[:3] == [
        ("00015388", "animal", "a living organism"),  # the quoted examples dropped
        ("00007555", "food", "any substance that can be metabolized; used for energy"),
        ("00017222", "plant", "(botany) a living organism lacking the power of locomotion"),
    ]
    train, validation = wordnet.split_rows(rows, 5, 5)
    assert sorted(train + validation) == sorted((text, label) for _, label, text in rows[:3])


def test_lexnames_file_decides_the_numbers_and_without_one_wordnet_3_0s_are_used(tmp_path):
    lines = [synset(15388, "05", ["animal"], "a living organism"), synset(17222, "20", ["plant"], "a flora")]
    swapped = LEXNAMES.replace("05\tnoun.animal", "05\tnoun.plant").replace("20\tnoun.plant", "20\tnoun.animal")
    assert [r[1] for r in wordnet.definitions(fake_wordnet(tmp_path / "a", lines, swapped))] == ["plant", "animal"]
    assert [r[1] for r in wordnet.definitions(fake_wordnet(tmp_path / "b", lines, None))] == ["animal", "plant"]


def test_split_is_balanced_disjoint_and_set_by_the_synset_offsets_alone(tmp_path):
    rows = wordnet.definitions(fake_wordnet(tmp_path / "wn", many(10)))
    train, validation = wordnet.split_rows(rows, 4, 2)
    assert sorted(label for _, label in train) == ["animal"] * 4 + ["food"] * 4 + ["plant"] * 4
    assert sorted(label for _, label in validation) == ["animal"] * 2 + ["food"] * 2 + ["plant"] * 2
    assert not set(train) & set(validation)
    # per class, the lowest sha1 of the offset goes to validation, the next ones to train
    sha = {text: hashlib.sha1(offset.encode()).hexdigest() for offset, _, text in rows}
    animals = sorted((r for r in rows if r[1] == "animal"), key=lambda r: sha[r[2]])
    assert {t for t, label in validation if label == "animal"} == {r[2] for r in animals[:2]}
    assert {t for t, label in train if label == "animal"} == {r[2] for r in animals[2:6]}
    assert (train, validation) == wordnet.split_rows(rows[::-1], 4, 2)  # file order does not matter


def test_main_writes_both_files_once_and_rewrites_a_changed_one(tmp_path, monkeypatch, capsys):
    folder = fake_wordnet(tmp_path / "wn", many(6))
    monkeypatch.setattr(wordnet, "TRAIN_PER_CLASS", 4)
    monkeypatch.setattr(wordnet, "VALIDATION_PER_CLASS", 2)
    out = tmp_path / "out"
    wordnet.main(["--wordnet_dir", folder, "--output_dir", str(out)])
    assert capsys.readouterr().out.startswith(f"wrote {out}: train.csv 12 rows, validation.csv 6 rows; 3 classes")
    with open(out / "train.csv", newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert table[0] == ["text", "label"] and len(table) == 13
    assert {label for _, label in table[1:]} == {"animal", "food", "plant"}
    written = {name: (out / name).read_bytes() for name in ("train.csv", "validation.csv")}
    stamps = {name: os.stat(out / name).st_mtime_ns for name in written}

    wordnet.main(["--wordnet_dir", folder, "--output_dir", str(out)])
    assert capsys.readouterr().out.startswith(f"up to date: {out}")
    assert {name: os.stat(out / name).st_mtime_ns for name in written} == stamps  # nothing written

    (out / "validation.csv").write_bytes(written["validation.csv"][:20])  # a file cut short
    wordnet.main(["--wordnet_dir", folder, "--output_dir", str(out)])
    assert capsys.readouterr().out.startswith("wrote")
    assert {name: (out / name).read_bytes() for name in written} == written
    assert sorted(os.listdir(out)) == ["train.csv", "validation.csv"]  # no temporary file left


def test_missing_wordnet_is_one_line_and_exit_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        wordnet.main(["--wordnet_dir", str(tmp_path / "none"), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: WordNet's data.noun is not in {tmp_path / 'none'}; ")
    assert "make text-data" in err and "apt-get download wordnet-base" in err
    assert not (tmp_path / "out").exists()
