"""Prompt/response pairs from the GCIDE dictionary, offline: headwords and their first definitions.

For train/sft.py's demo,

    python -m data.definitions --output_dir runs/sft/gcide [--max_train_rows N] [--max_validation_rows M]
    (make sft-data unpacks GCIDE first)

writes train.jsonl and validation.jsonl, one {"prompt": "Define: WORD\\n", "response": "DEFINITION"} a
line; with --preferences (train/dpo.py's demo, make dpo-data) one {"prompt", "chosen": DEFINITION,
"rejected": the next word's DEFINITION} a line. WORD is the headword as the entry spells it before its
pronunciation (`Serendipity \\Ser`en*dip"i*ty\\, n.` gives Serendipity; `Pis'e \\Pi`s['e]"\\` gives
Pisé); DEFINITION is the text of the entry's first sense, without the dictionary's markup, etymologies,
labels, quotations, citations, cross-references and derived forms, whitespace collapsed,
capitalized, ending with a period.

The split follows data/text.py's gcide_documents, which train/lm.py pretrains on: training pairs come
only from its training entries, validation pairs only from its validation entries (every 100th), and
a validation word that is also the headword of a training entry is left out, so the pretrained model
never read an entry of a validation word and fine-tuning never teaches one. A word (case ignored) gives
one pair, from its first entry in dictionary order whose first sense is usable: present, not a bare
pointer ("See X.", "Imp. & p. p. of Reach."), 10 to 300 characters, and without a character the dictd
text lost. GCIDE 0.48.5 (Debian's dict-gcide) yields 96,241 training and 857 validation pairs (of 124,974
and 1,262 entries); each split is shuffled with --seed and cut to --max_train_rows (20,000) and
--max_validation_rows (500), so the rows span the alphabet. The same GCIDE gives byte-identical files
anywhere; a rerun that would write the same bytes writes nothing.
"""

import argparse
import json
import os
import random
import re
import unicodedata

from data.errors import DataError
from data.text import GCIDE_FOLDERS, find_gcide, gcide_documents
from data.wordnet import write_if_changed

PROMPT = "Define: {word}\n"
MIN_DEFINITION_CHARS, MAX_DEFINITION_CHARS = 10, 300
MAX_TRAIN_ROWS, MAX_VALIDATION_ROWS = 20_000, 500
LOST = "\x00"  # stands for a character the dictd text cannot show: a definition holding one is left out

# GCIDE's dictd text writes accented letters as [mark letter] (['e] é, [=a] ā, [a^] ă) and others by name
_MARKS = {
    "=": "\u0304",
    "^": "\u0302",
    "'": "\u0301",
    "`": "\u0300",
    '"': "\u0308",
    "~": "\u0303",
    ".": "\u0307",
    ",": "\u0327",
    "*": "\u030a",
}
_NAMED = {
    "ae": "æ",
    "AE": "Æ",
    "oe": "œ",
    "OE": "Œ",
    "eth": "ð",
    "thorn": "þ",
    "yogh": "ȝ",
    "deg": "°",
    "min": "′",
    "sec": "″",
    "sect": "§",
    "para": "¶",
    "root": "√",
    "sharp": "♯",
    "flat": "♭",
    "imac": "ī",
    "aum": "ä",
    "middot": "·",
    "times": "×",
    "pounds": "£",
    "rarr": "→",
    "nbsp": " ",
}
_GREEK = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()
_NAMED.update(zip(_GREEK, "αβγδεζηθικλμνξοπρστυφχψω", strict=True))
_NAMED.update(zip((name.capitalize() for name in _GREEK), "ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ", strict=True))

_HEAD = re.compile(r"^([^\s\\][^\\\n]*?)\s*\\([^\\\n]*)\\", re.M)  # `Word \Pro*nun"ci*a`tion\` at a line's start
_PRONUNCIATION = re.compile(r"\s*\((?:-|[^)]*[\[\"*`])")  # (p[a^]r`[e^]n*th...), (-s[i^]z): not a label as (Zool.)
_BRACKETS = re.compile(r"\[([^\[\]\n]{1,8})\]")
# a line that starts with a bracket ends a sense: [1913 Webster], [WordNet 1.5], [PJC], or [Obs.] before a citation;
# the rest of such a line goes too (dictd's index spans sometimes run on into the next entry's first word there)
_SOURCE_LINE = re.compile(r"^[ \t]*\[.*$", re.M)
# what may come before a sense's text: "1. pl. (Anat.) (a) ", and a plural's pronunciation ("(-s[i^]z). ")
_SENSE_START = re.compile(
    r"^(?:\d+\.?\s+|(?:n|pl|sing|a|adj|adv|v|[ti]|prep|interj)\.(?:\s*&)?,?\s+|"
    r"\([^()]{1,80}\),?\s*|[.,;:=]\s*)*"
)
# a definition that only points at another entry: "See X.", "Same as X.", or an inflection ("Imp. & p. p. of Reach.")
_POINTER = re.compile(
    r"^(?:see|same as|alt\. of|variant of|obs\. or \w+ forms? of)\b"
    r"|^(?:of|from|fr\.) [\w'-]+(?:, v\b.*)?\.?$"  # what "pl. of X", "a. & n. from X, v." leave
    r"|^(?:obs\. |archaic )?(?:imp|p\. ?p|p\. ?pr|p\. ?a|vb\. n|pl|plural|pres|sing|pret|inf|superl|"
    r"compar|\d(?:st|d|nd|rd|th))\b[^;]*?(?:\bof|\bfrom|\bfr\.)\s",
    re.I,
)
_HEADWORD = re.compile(r"[^\W\d_][\w]*(?:[-' .][\w]+)*'?")


def decode_entities(text):
    """GCIDE's [mark letter] and [name] characters as Unicode; an unknown one touching a letter becomes LOST,
    other bracketed text (labels, etymologies, sources) is left for the caller."""

    def one(match):
        inner = match.group(1)
        if inner in _NAMED:
            return _NAMED[inner]
        if len(inner) == 2 and inner[0] in _MARKS and inner[1].isalpha():
            return unicodedata.normalize("NFC", inner[1] + _MARKS[inner[0]])
        if len(inner) == 2 and inner[1] == "^" and inner[0].isalpha():  # [a^]: breve
            return unicodedata.normalize("NFC", inner[0] + "\u0306")
        if re.fullmatch(r"\d+[a-z]?", inner) and match.start() and text[match.start() - 1].isalpha():
            return ""  # a homograph's number: {abortion[2]}
        touching = (match.start() and text[match.start() - 1].isalpha()) or (
            match.end() < len(text) and text[match.end()].isalpha()
        )
        return LOST if touching and re.fullmatch(r"[-=^'`\"~.,*]?[a-z]{1,5}\^?", inner) else match.group(0)

    return _BRACKETS.sub(one, text)


def remove_brackets(text):
    """Text without its [bracketed] parts, nested or over several lines (etymologies, labels, sources)."""
    out, depth = [], 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
        elif not depth:
            out.append(char)
    return "".join(out)


def reader_headword(head, pronunciation):
    """The headword as a reader writes it. The dictd text spells some letters of a headword as their
    markup without brackets (Pis'e, Fraumulein, AEdile); the pronunciation part keeps the markup
    (Pi`s['e]", Fr[aum]u"lein, [AE]"dile), so each of those, in order, becomes Pisé, Fräulein, Aedile.
    Other marks (the diaeresis of A["e]rate, Aërate) only guide pronunciation: the headword keeps its letter."""
    cursor = 0
    for entity in re.findall(r"\[('[A-Za-z]|aum|AE|OE)\]", pronunciation):
        spelled = {"aum": "ä", "AE": "Ae", "OE": "Oe"}.get(entity) or unicodedata.normalize("NFC", entity[1] + "\u0301")
        at = head.find(entity, cursor)
        if at >= 0:
            head, cursor = head[:at] + spelled + head[at + len(entity) :], at + len(spelled)
    head = " ".join(head.split())
    if len(head) > 40 or sum(c.isalpha() for c in head) < 2 or not _HEADWORD.fullmatch(head):
        return None  # empty, a suffix (-ling), a number, a symbol (9/11) or a spelling with a stray mark
    return head


def _head_length(text):
    """How many lines of `text` (an entry from its headword line on) its head takes: headwords, pronunciations,
    parts of speech, etymology. A line belongs to the head when it starts unindented (another headword),
    inside a bracket or parenthesis left open, with a bracket (an etymology, a label, a stray source line),
    or with a pronunciation in parentheses after a line that ended with a headword's or a plural's."""
    lines, depth, after_word, count = text.split("\n"), 0, False, 1
    for i, line in enumerate(lines):
        if i and not (
            depth > 0
            or not line[:1].isspace()
            or line.lstrip().startswith("[")
            or (after_word and _PRONUNCIATION.match(line))
        ):
            break
        count = i + 1
        for char in line:
            depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        after_word = line.rstrip().endswith(("\\", ",", "}"))
    return count


def first_definition(body):
    """The cleaned text of the first sense in `body` (an entry after its head), or None."""
    body = _SOURCE_LINE.sub("\n", body)  # a source line ends a sense
    # the first paragraph with text: a part of speech (n. pl.) or a label may stand alone before it
    paragraphs = [
        p.lstrip("\n")
        for p in re.split(r"\n[ \t]*\n", remove_brackets(body))
        if _SENSE_START.sub("", " ".join(p.split()))
    ]
    if not paragraphs:
        return None
    sense = paragraphs[0]
    if re.match(r" *(?:Note|Syn|Usage|Fig)\b| *\{| {9}", sense):  # a note, synonyms, a phrase, a quotation
        return None
    sense = re.split(r"\n\s*(?:\([b-z]\)|\d+\.)\s", sense)[0]  # the next subsense or sense
    sense = " ".join(sense.split())
    sense = _SENSE_START.sub("", sense)
    # a citation (--Shak.), derived forms (-- {Word*ly}, adv.), the sense of another part of speech (-- n. A ...)
    sense = re.split(r"--(?=[A-Z])|\s--\s(?:\{|[a-z]{1,4}\.)|\s--\s(?=[A-Z][\w.' &]{0,40}$)", sense)[0]
    sense = re.sub(r"\{([^{}]*)\}", lambda m: re.sub(r'["*`]', "", m.group(1)), sense)  # {Cross*ref"} as text
    # a trailing pointer to other entries (See X; WordNet's Also See:, Antonym:, Opposite of)
    sense = re.split(r"(?<=[.;])\s*(?:See|Cf\.|Same as|Also [Ss]ee:?|Antonyms?:?|Opposite)(?=\s|[A-Z])", sense)[0]
    sense = re.sub(r'(?<=[.;!?])\s*"[^"]*"?\s*$|;\s*as,\s*".*$', "", sense)  # a trailing quoted example
    sense = re.sub(r"\s*\((?:See|Cf\.)\s[^()]*(?:\([^()]*\)[^()]*)*\)", "", sense)  # (See Base, n., 3 (a).)
    if sense.count("(") > sense.count(")"):  # a parenthesis the citation cut off: ("The term ... 1825. --Judd)
        sense = sense[: sense.rindex("(")]
    sense = re.sub(r"(?<=[.;])\s+\w+[:,]?\s*$", "", sense)  # the first word of a sentence cut off (Also, Hence:)
    sense = re.sub(r"\s+([.,;:)])(?!\d)", r"\1", " ".join(sense.split()))  # "a torrent ." where a label was
    sense = re.sub(r"\(\s+", "(", sense)
    sense = re.sub(r"(?<!\.)\.\.(?!\.)", ".", sense).strip(" ;:,-")  # "v. t.." and ". ." as one period
    if not sense[:1].isalnum() or _POINTER.match(sense):
        return None
    sense = sense[0].upper() + sense[1:]
    if not sense.endswith("."):
        sense += "."
    if (
        not MIN_DEFINITION_CHARS <= len(sense) <= MAX_DEFINITION_CHARS
        or sense.count('"') % 2
        or re.search(r'[\\{}\[\]?*]|\(\)|"\.$|' + LOST, sense)
    ):
        return None
    return sense


def parse_entry(document):
    """(headword, definition) of one GCIDE entry, or None when it has no usable pair."""
    match = _HEAD.search(document)
    if not match:
        return None  # a fragment the index points into: no headword line
    text = document[match.start() :]
    headword = reader_headword(match.group(1), match.group(2))
    if headword is None:
        return None
    body = "\n".join(text.split("\n")[_head_length(text) :])
    definition = first_definition(decode_entities(body))
    return (headword, definition) if definition else None


def headwords(documents):
    """The set of casefolded headwords of `documents`."""
    words = set()
    for document in documents:
        match = _HEAD.search(document)
        if match:
            words.add(" ".join(match.group(1).split()).casefold())
    return words


def pairs_of(documents, exclude=frozenset()):
    """[(headword, definition)]: one per word (case ignored), from its first entry that gives one, in dictionary
    order; words in `exclude` (casefolded) left out."""
    seen, pairs = set(exclude), []
    for document in documents:
        match = _HEAD.search(document)
        key = match and " ".join(match.group(1).split()).casefold()
        pair = key and key not in seen and parse_entry(document)
        if pair:
            seen.add(key)
            pairs.append(pair)
    return pairs


def split_pairs(train_documents, validation_documents):
    """(train, validation) pairs: the validation words that head no training entry."""
    return pairs_of(train_documents), pairs_of(validation_documents, exclude=headwords(train_documents))


def jsonl_text(pairs, max_rows, seed, preferences=False):
    """The pairs shuffled with `seed`, the first `max_rows`, as jsonl lines: {prompt, response}, or with
    `preferences` {prompt, chosen, rejected}, rejected the definition of the next word in dictionary
    order (a neighbour such as Roe for Roebuck: often a related word, so the two are hard to tell apart)."""
    pairs = list(pairs)
    rows = [{"prompt": PROMPT.format(word=word), "response": definition} for word, definition in pairs]
    if preferences:
        rows = [
            {"prompt": row["prompt"], "chosen": row["response"], "rejected": pairs[(i + 1) % len(pairs)][1]}
            for i, row in enumerate(rows)
        ]
    random.Random(seed).shuffle(rows)
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows[:max_rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output_dir", default=os.path.join("runs", "sft", "gcide"), help="where train.jsonl and validation.jsonl go"
    )
    parser.add_argument(
        "--max_train_rows",
        type=int,
        default=MAX_TRAIN_ROWS,
        help="at most this many training pairs, cut from a seeded shuffle of all (default %(default)s)",
    )
    parser.add_argument(
        "--max_validation_rows",
        type=int,
        default=MAX_VALIDATION_ROWS,
        help="at most this many validation pairs, likewise (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the shuffle before the cut")
    parser.add_argument(
        "--preferences",
        action="store_true",
        help="preference pairs for train/dpo.py: {prompt, chosen, rejected}, the chosen response the "
        "word's definition, the rejected one the next word's (in dictionary order)",
    )
    parser.add_argument(
        "--gcide_dir",
        default=None,
        help=f"the folder holding gcide.index and gcide.dict.dz; default: the first of {', '.join(GCIDE_FOLDERS)}",
    )
    args = parser.parse_args(argv)
    for flag in ("max_train_rows", "max_validation_rows"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    try:
        train, validation = split_pairs(*gcide_documents(find_gcide(args.gcide_dir)))
        os.makedirs(args.output_dir, exist_ok=True)
        wrote = [
            write_if_changed(
                os.path.join(args.output_dir, f"{name}.jsonl"), jsonl_text(pairs, rows, args.seed, args.preferences)
            )
            for name, pairs, rows in (
                ("train", train, args.max_train_rows),
                ("validation", validation, args.max_validation_rows),
            )
        ]
    except (DataError, OSError) as e:
        parser.exit(1, f"error: {e}\n")
    print(
        f"{'wrote' if any(wrote) else 'up to date:'} {args.output_dir}: train.jsonl "
        f"{min(len(train), args.max_train_rows)} of {len(train)} pairs, validation.jsonl "
        f"{min(len(validation), args.max_validation_rows)} of {len(validation)}"
    )


if __name__ == "__main__":
    main()
