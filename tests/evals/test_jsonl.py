"""Reading an eval set's JSONL: the normalised cases of a good file, and every bad line of a bad one named
with what is wrong."""

from __future__ import annotations

import json

import pytest

from evals.sets.jsonl import BadFile, FileTooLarge, Limits, parse_cases

LIMITS = Limits(max_bytes=1 << 20, max_cases=100)


def lines(*cases) -> bytes:
    return "".join((case if isinstance(case, str) else json.dumps(case)) + "\n" for case in cases).encode()


def refused(raw: bytes, default_scorer: str = "exact", limits: Limits = LIMITS) -> list[dict]:
    with pytest.raises(BadFile) as caught:
        parse_cases(raw, default_scorer=default_scorer, limits=limits)
    return caught.value.errors


def only_error(raw: bytes, **kwargs) -> dict:
    errors = refused(raw, **kwargs)
    assert len(errors) == 1, errors
    return errors[0]


def test_a_good_file_is_normalised_in_file_order():
    raw = lines(
        {"id": "q1", "prompt": "2+2=", "expected": "4"},
        {"id": "q2", "prompt": "Name a colour", "scorer": "regex", "expected": "^(red|blue)$", "max_tokens": 5},
        "",
        {"id": "q3", "messages": [{"role": "user", "content": "Capital of France?"}], "scorer": "choice",
         "choices": [" Paris", " Rome"], "answer": 0},
        {"id": "q4", "prompt": "Say hello", "scorer": "similarity", "reference": "Hello!"},
        {"id": "q5", "prompt": "Tell a story", "scorer": "similarity", "reference": "Once", "threshold": 1},
        {"id": "q6", "prompt": "Continue: the cat", "scorer": "parity"},
    ) + b"   \n"
    cases = parse_cases(raw, default_scorer="exact", limits=LIMITS)
    assert cases == [
        {"id": "q1", "prompt": "2+2=", "scorer": "exact", "max_tokens": 64, "expected": "4"},
        {"id": "q2", "prompt": "Name a colour", "scorer": "regex", "max_tokens": 5, "expected": "^(red|blue)$"},
        {"id": "q3", "messages": [{"role": "user", "content": "Capital of France?"}], "scorer": "choice",
         "max_tokens": 64, "choices": [" Paris", " Rome"], "answer": 0},
        {"id": "q4", "prompt": "Say hello", "scorer": "similarity", "max_tokens": 64, "reference": "Hello!",
         "threshold": 0.8},
        {"id": "q5", "prompt": "Tell a story", "scorer": "similarity", "max_tokens": 64, "reference": "Once",
         "threshold": 1.0},
        {"id": "q6", "prompt": "Continue: the cat", "scorer": "parity", "max_tokens": 64},
    ]


def test_windows_line_ends_and_a_byte_order_mark_are_read():
    raw = b"\xef\xbb\xbf" + lines({"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}).replace(b"\n", b"\r\n")
    assert [case["id"] for case in parse_cases(raw, default_scorer="parity", limits=LIMITS)] == ["a", "b"]


def test_every_bad_line_is_named_at_once():
    raw = lines(
        {"id": "ok", "prompt": "fine", "expected": "yes"},
        '{"id": "broken", "prompt": ',
        {"prompt": "no id", "expected": "x"},
        {"id": "ok", "prompt": "again", "expected": "x"},
        {"id": "c", "prompt": "pick", "scorer": "choice", "choices": ["a", "b", "c"], "answer": 4},
        {"id": "s", "prompt": "p", "scorer": "fuzzy"},
    )
    assert [error["line"] for error in refused(raw)] == [2, 3, 4, 5, 6]


@pytest.mark.parametrize(("line", "words"), [
    ('{"id": "a", "prompt": ', "Malformed JSON (Expecting value at column 23): write one JSON object per line."),
    ('["id", "a"]', "A line must be a JSON object, not an array."),
    ('"just text"', "A line must be a JSON object, not a string."),
    ({"prompt": "p", "expected": "x"}, "Missing `id`: give each case a unique string id."),
    ({"id": 7, "prompt": "p", "expected": "x"}, "`id` must be a string, not a number (7)."),
    ({"id": " ", "prompt": "p", "expected": "x"}, "`id` is empty"),
    ({"id": "x" * 201, "prompt": "p", "expected": "x"}, "`id` is 201 characters; keep it to 200."),
    ({"id": "a", "expected": "x"}, "Needs `prompt` (a string) or `messages` (a list of {role, content})."),
    ({"id": "a", "prompt": "p", "messages": [], "expected": "x"}, "Has both `prompt` and `messages`: keep one."),
    ({"id": "a", "prompt": "", "expected": "x"}, "`prompt` must be a non-empty string."),
    ({"id": "a", "messages": "hi", "expected": "x"}, "`messages` must be a non-empty list"),
    ({"id": "a", "messages": [{"role": "user"}], "expected": "x"}, "`messages[0]`.content must be a string."),
    ({"id": "a", "messages": [{"role": "robot", "content": "hi"}], "expected": "x"},
     '`messages[0]`.role must be one of system, developer, user, assistant, not "robot".'),
    ({"id": "a", "messages": [{"role": "user", "content": "hi", "mood": 1}], "expected": "x"},
     "`messages[0]` has unknown keys mood"),
    ({"id": "a", "prompt": "p", "scorer": "fuzzy"},
     'Unknown scorer "fuzzy": use one of exact, regex, choice, similarity, parity.'),
    ({"id": "a", "prompt": "p", "expected": "x", "max_tokens": 0},
     "`max_tokens` must be a whole number from 1 to 4096, not 0."),
    ({"id": "a", "prompt": "p", "expected": "x", "max_tokens": 4097}, "from 1 to 4096, not 4097."),
    ({"id": "a", "prompt": "p", "expected": "x", "max_tokens": 2.5}, "not 2.5."),
    ({"id": "a", "prompt": "p", "expected": "x", "max_tokens": True}, "not true."),
    ({"id": "a", "prompt": "p"}, "`expected` must be a non-empty string (the answer)."),
    ({"id": "a", "prompt": "p", "expected": 4}, "`expected` must be a non-empty string"),
    ({"id": "a", "prompt": "p", "scorer": "regex", "expected": "[a-"},
     "`expected` is not a valid regular expression: unterminated character set at position 0."),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["only"], "answer": 0},
     "`choices` must be a list of two or more non-empty strings."),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["a", ""], "answer": 0}, "non-empty strings"),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["a", "b", "c"], "answer": 4},
     "`answer` 4 is out of range: 3 choices (index from 0 to 2)."),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["a", "b"], "answer": -1},
     "`answer` -1 is out of range"),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["a", "b"], "answer": "a"},
     "`answer` must be the index of the right choice"),
    ({"id": "a", "prompt": "p", "scorer": "choice", "choices": ["a", "b"]}, "Missing `answer`"),
    ({"id": "a", "prompt": "p", "scorer": "similarity"}, "`reference` must be a non-empty string"),
    ({"id": "a", "prompt": "p", "scorer": "similarity", "reference": "r", "threshold": 0},
     "`threshold` must be a number above 0 and at most 1, not 0."),
    ({"id": "a", "prompt": "p", "scorer": "similarity", "reference": "r", "threshold": 1.5}, "not 1.5."),
    ({"id": "a", "prompt": "p", "scorer": "similarity", "reference": "r", "threshold": "high"}, 'not "high".'),
    ({"id": "a", "prompt": "p", "expected": "x", "tags": ["t"], "weight": 2},
     "Unknown keys tags, weight: a case takes answer, choices, expected, id, max_tokens, messages, prompt, "
     "reference, scorer, threshold."),
    ({"id": "a", "prompt": "p", "expected": "x", "choices": ["a", "b"]},
     "Choices not used by the exact scorer: remove them or set this case's `scorer`."),
    ({"id": "a", "prompt": "p\u0000", "expected": "x"}, "Holds a NUL character"),
])
def test_a_bad_line_is_refused_saying_what_to_do(line, words):
    raw = lines({"id": "first", "prompt": "fine", "expected": "ok"}, line)
    error = only_error(raw)
    assert error["line"] == 2
    assert words in error["error"]


def test_invalid_utf8_names_its_line_and_byte():
    raw = lines({"id": "a", "prompt": "fine", "expected": "x"}) + b'{"id": "b", "prompt": "caf\xe9"}\n'
    assert only_error(raw) == {"line": 2, "error": "Not valid UTF-8 (byte 0xe9 at column 27): save the file as UTF-8."}


def test_a_duplicate_id_names_the_line_that_used_it_first():
    raw = lines({"id": "q1", "prompt": "a", "expected": "x"}, {"id": "q2", "prompt": "b", "expected": "x"},
                {"id": "q1", "prompt": "c", "expected": "x"}, {"id": "q1", "prompt": "d", "expected": "x"})
    assert refused(raw) == [
        {"line": 3, "error": "Duplicate id 'q1': line 1 already uses it; give each case its own id."},
        {"line": 4, "error": "Duplicate id 'q1': line 1 already uses it; give each case its own id."},
    ]


def test_a_line_with_several_problems_names_each():
    raw = lines({"id": 1, "prompt": "p", "scorer": "choice", "choices": ["a", "b"], "answer": 3, "extra": 1})
    texts = [error["error"].split(":")[0] for error in refused(raw)]
    assert texts == ["`id` must be a string, not a number (1).", "Unknown keys extra", "`answer` 3 is out of range"]


def test_the_sets_default_scorer_applies_and_is_checked():
    raw = lines({"id": "a", "prompt": "p", "reference": "r"})
    assert parse_cases(raw, default_scorer="similarity", limits=LIMITS)[0]["scorer"] == "similarity"
    assert only_error(lines({"id": "a", "prompt": "p"}), default_scorer="bogus")["error"] == (
        'Unknown scorer "bogus" (the set\'s default): use one of exact, regex, choice, similarity, parity.')


@pytest.mark.parametrize("raw", [b"", b"\n\n  \n", b"\xef\xbb\xbf\n"])
def test_an_empty_set_is_refused(raw):
    assert refused(raw) == [{"line": None, "error": "The file holds no cases: write one JSON object per line."}]


def test_over_the_case_limit_names_the_first_line_over():
    raw = lines(*({"id": f"q{n}", "prompt": "p", "expected": "x"} for n in range(4)))
    errors = refused(raw, limits=Limits(max_bytes=1 << 20, max_cases=3))
    assert errors == [{"line": 4, "error": "More than 3 cases, the limit of one version "
                                           "(INFEROPS_EVALSET_MAX_CASES): split the set."}]
    assert len(parse_cases(raw, default_scorer="exact", limits=Limits(max_bytes=1 << 20, max_cases=4))) == 4


def test_over_the_byte_limit_is_refused_before_reading():
    raw = lines({"id": "a", "prompt": "p" * 100, "expected": "x"})
    with pytest.raises(FileTooLarge, match="over 50 bytes, the limit of one version"):
        parse_cases(raw, default_scorer="exact", limits=Limits(max_bytes=50, max_cases=10))
    assert parse_cases(raw, default_scorer="exact", limits=Limits(max_bytes=len(raw), max_cases=10))
