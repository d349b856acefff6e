"""A batch file's lines are checked before any token is spent: every bad line is named."""

from __future__ import annotations

import json

from batches.lines import check_lines


def line(custom_id="a", url="/v1/chat/completions", model="chat", **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def check(lines, endpoint="/v1/chat/completions", max_lines=100, problems=None):
    return check_lines(lines, endpoint, max_lines=max_lines, model_problem=lambda name: (problems or {}).get(name))


def test_good_lines_give_their_count_and_model_and_blank_lines_are_skipped():
    checked = check([line("a"), b"", line("b"), b"   "])
    assert (checked.lines, checked.model, checked.errors) == (2, "chat", [])


def test_every_bad_line_is_named_with_its_number_and_code():
    lines = [line("a"), b"{not json", b"[1, 2]", line("a"), line("c", url="/v1/embeddings"),
             json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}).encode(),
             line("e", model=""), line("f", stream=True), line("g", model="other"),
             json.dumps({"custom_id": "", "method": "POST"}).encode(),
             json.dumps({"custom_id": "h", "method": "POST", "url": "/v1/chat/completions", "body": "x"}).encode()]
    checked = check(lines)
    assert [(e.line, e.code) for e in checked.errors] == [
        (2, "invalid_json_line"), (3, "invalid_request"), (4, "duplicate_custom_id"), (5, "invalid_url"),
        (6, "invalid_method"), (7, "missing_model"), (8, "invalid_request"), (9, "mismatched_model"),
        (10, "invalid_request"), (11, "invalid_request")]
    assert "line 1" in checked.errors[2].message and checked.errors[2].custom_id == "a"


def test_a_model_the_key_may_not_use_fails_every_line_that_names_it():
    checked = check([line("a", model="secret"), line("b", model="secret")],
                    problems={"secret": ("model_not_allowed", "API key abc may not use `secret`.")})
    assert [(e.line, e.code, e.param) for e in checked.errors] == [(1, "model_not_allowed", "body.model"),
                                                                   (2, "model_not_allowed", "body.model")]


def test_too_many_lines_and_an_empty_file_are_refused():
    assert [e.code for e in check([line(str(i)) for i in range(5)], max_lines=3).errors] == ["too_many_requests"]
    assert [e.code for e in check([b"", b"\n"]).errors] == ["empty_file"]


def test_error_lines_and_openai_errors_carry_the_line():
    error = check([b"nope"]).errors[0]
    assert error.as_openai()["line"] == 1 and error.as_error_line()["error"]["code"] == "invalid_json_line"
